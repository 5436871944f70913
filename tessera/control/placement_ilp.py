"""Exact placement for one stage-1 partition as a PuLP/CBC MILP (our variant; docs/papers.md).

Variables ``x[s,b] ∈ {0,1}`` (s placed on b), ``f[s,b] ∈ [0,1]`` (share of s's traffic on b), ``U ≥ 0``.
Constraints: ``f ≤ x``; ``Σ_b f[s,b] = 1`` (Eq. 3); ``Σ_s x[s,b] ≤ K_max``; ``x = 0`` where TP < tp_min;
memory per GPU (``Σ x·W/p + A + KV_min ≤ γM``); load ``Σ_s f·λ_s·w_s(p_b) ≤ U`` with ``w_s`` the
estimator's per-request group time. Objective: ``min U + ε·Σx`` (ε avoids needless replicas).
For small problems; the greedy (``placement.py``) is the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from tessera.control.placement import (
    Group,
    PlacementError,
    estimate,
    request_work,
    service_rate,
    to_plan,
)
from tessera.core.planners.types import PlacementPlan, PoolInput, ServiceInput
from tessera.core.policies.qlm.milp import bundled_cbc

EPSILON = 1e-4


@dataclass(frozen=True, slots=True)
class IlpResult:
    """The optimal placement of one partition, its max utilization U and the solver status."""

    plan: PlacementPlan
    max_utilization: float
    status: str
    shares: dict[tuple[str, int], float]


def solve_partition(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    groups: Sequence[Group],
    k_max: int,
    *,
    time_limit_s: float = 30.0,
) -> IlpResult:
    """Place ``services`` on the empty ``groups`` minimising the maximum group utilization."""
    if any(g.services for g in groups):
        raise ValueError("solve_partition needs empty groups")
    prob = pulp.LpProblem("seallm_placement", pulp.LpMinimize)
    S = range(len(services))
    B = range(len(groups))
    ok = {(s, b): groups[b].tp >= services[s].tp_min for s in S for b in B}
    x = {(s, b): prob.add_variable(f"x_{s}_{b}", 0, 1, pulp.LpBinary) for s in S for b in B if ok[s, b]}
    f = {(s, b): prob.add_variable(f"f_{s}_{b}", 0, 1) for s in S for b in B if ok[s, b]}
    u = prob.add_variable("U", 0)
    prob += u + EPSILON * pulp.lpSum(x.values())
    for s in S:
        if not any(ok[s, b] for b in B):
            raise PlacementError(f"service {services[s].name!r} fits no group of this partition")
        prob += pulp.lpSum(f[s, b] for b in B if ok[s, b]) == 1
        for b in B:
            if ok[s, b]:
                prob += f[s, b] <= x[s, b]
    for b in B:
        tp = groups[b].tp
        on_b = [s for s in S if ok[s, b]]
        prob += pulp.lpSum(x[s, b] for s in on_b) <= k_max
        budget = pool.memory_fraction * pool.gpu_memory_bytes - pool.activation_bytes_per_gpu
        prob += (
            pulp.lpSum(
                x[s, b]
                * (
                    services[s].weights_bytes
                    + services[s].kv_bytes_per_token * services[s].p99_context_tokens
                )
                / tp
                for s in on_b
            )
            <= budget
        )
        work = {s: service_rate(services[s]) * request_work(pool, services[s], tp) for s in on_b}
        prob += pulp.lpSum(f[s, b] * work[s] for s in on_b) <= u
    status = prob.solve(bundled_cbc(timeLimit=time_limit_s))
    name = pulp.LpStatus[status]
    if name != "Optimal":
        raise PlacementError(f"placement MILP is {name}: the partition cannot host every service")
    placed = [Group(g.index, g.tp, g.reserved, []) for g in groups]
    shares: dict[tuple[str, int], float] = {}
    for (s, b), var in x.items():
        if var.value() > 0.5:
            placed[b].services.append(services[s].name)
            shares[services[s].name, b] = float(f[s, b].value())
    est = estimate(pool, services, placed)
    return IlpResult(to_plan("seallm-ilp", placed, est), float(u.value()), name, shares)


def max_utilization(pool: PoolInput, services: Sequence[ServiceInput], groups: Sequence[Group]) -> float:
    """The MILP's objective U for a filled partition with traffic split evenly over replicas (the
    dispatcher's static split), to compare the greedy with the optimum on the same terms."""
    by_name = {s.name: s for s in services}
    hosts: dict[str, int] = {}
    for g in groups:
        for n in g.services:
            hosts[n] = hosts.get(n, 0) + 1
    return max(
        (
            sum(
                service_rate(by_name[n]) / hosts[n] * request_work(pool, by_name[n], g.tp) for n in g.services
            )
            for g in groups
        ),
        default=0.0,
    )
