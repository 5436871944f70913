"""SeaLLM placement: validity (Eq. 3-4, K_max, TP, memory), ILP optimality vs brute force, greedy gap."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import linprog

from tessera.control.placement import (
    Estimate,
    Group,
    PlacementError,
    choose,
    fits,
    generate_groups,
    greedy_allocate,
    plan_placement,
    request_work,
    service_rate,
)
from tessera.control.placement_ilp import EPSILON, max_utilization, solve_partition
from tessera.core.planners import (
    PoolInput,
    ServiceInput,
)
from tessera.core.profile import StepProfile

GIB = 2**30
LM7 = StepProfile("lm", 0.008, 2e-5, 6.6e-8, 0.005, 8.5e-5, 65536)
LM70 = StepProfile("lm", 0.022, 2e-5, 4e-8, 0.01, 2.2e-4, 65536, gpus=4)


def svc(name, rate, *, weights=14 * GIB, tp_min=1, lm=LM7, out=300):
    return ServiceInput(
        name,
        weights,
        512 * 1024,
        lm,
        tp_min=tp_min,
        request_rate=rate,
        mean_output_tokens=out,
        p99_context_tokens=2048,
    )


POOL = PoolInput("p", "A800", 80 * GIB, 32)


def test_sixteen_services_on_32_gpus_valid_plan():
    services = [svc(f"s{i}", 0.2 + 0.15 * i) for i in range(14)]
    services += [
        svc("big-a", 0.3, weights=130 * GIB, tp_min=4, lm=LM70),
        svc("big-b", 0.2, weights=130 * GIB, tp_min=4, lm=LM70),
    ]
    plan = plan_placement(POOL, services, strategy="seallm", now=0.0)
    placed = {n for g in plan.groups for n in g.services}
    assert placed == {s.name for s in services}  # Eq. 3
    assert plan.gpus <= 32  # Eq. 4
    by = {s.name: s for s in services}
    for g in plan.groups:
        assert len(g.services) <= 2
        assert g.tp in (1, 2, 4, 8)
        assert all(g.tp >= by[n].tp_min for n in g.services)
        assert fits(POOL, [by[n] for n in g.services], g.tp)
    assert 0 <= plan.estimated_slo_attainment <= 1


def test_dedicated_splits_evenly_and_rejects_too_small_pools():
    services = [svc(f"s{i}", 1.0) for i in range(4)]
    plan = plan_placement(POOL, services, strategy="dedicated", now=0.0)
    assert [g.replicas.total for g in plan.groups] == [8, 8, 8, 8]
    with pytest.raises(PlacementError, match="need at least"):
        plan_placement(PoolInput("q", "A800", 80 * GIB, 2), services, strategy="dedicated", now=0.0)
    with pytest.raises(PlacementError, match="unknown placement strategy"):
        plan_placement(POOL, services, strategy="magic", now=0.0)  # type: ignore[arg-type]


def test_service_that_fits_nowhere_is_rejected_clearly():
    with pytest.raises(PlacementError, match="does not fit"):
        plan_placement(POOL, [svc("huge", 1.0, weights=500 * GIB)], strategy="seallm", now=0.0)
    with pytest.raises(PlacementError, match="unique"):
        plan_placement(POOL, [svc("a", 1.0), svc("a", 2.0)], strategy="seallm", now=0.0)


def test_big_models_get_merged_reserved_groups():
    services = [svc("big", 0.3, weights=130 * GIB, tp_min=4, lm=LM70), svc("small", 1.0)]
    groups = generate_groups(PoolInput("p", "A800", 80 * GIB, 8), services, tp=1)
    assert sorted(g.tp for g in groups) == [1, 1, 1, 1, 4]
    assert [g.reserved for g in groups if g.tp == 4] == [True]


def test_previous_plan_kept_when_new_not_better():
    services = [svc(f"s{i}", 0.5) for i in range(4)]
    pool = PoolInput("p", "A800", 80 * GIB, 8)
    first = plan_placement(pool, services, strategy="seallm", now=0.0)
    again = plan_placement(pool, services, strategy="seallm", now=300.0, previous=first)
    assert {g.key for g in again.groups} == {g.key for g in first.groups}


def test_plan_choice_leaves_out_candidates_far_above_the_lowest_l_n():
    """tessera bench seallm --seed 1 at 300 s: a burst put every candidate below 0.13 attainment.
    Attainment first chose 0.122 at L_N 81.9, the plan that gave the bursting service 2 GPUs of 32;
    within twice the lowest L_N (19.8) the best attainment is 0.113 at 33.5."""
    burst = ((0.113, 33.5), (0.096, 19.8), (0.122, 81.9), (0.118, 78.0))
    assert choose([Estimate(a, ln, {}, 0.0) for a, ln in burst]) == 0
    # candidates of similar L_N still go by attainment first
    similar = ((0.95, 1.3), (0.97, 1.9), (0.9, 1.0))
    assert choose([Estimate(a, ln, {}, 0.0) for a, ln in similar]) == 1


def _brute_force_objective(pool, services, groups, k_max):
    """min over all x of (min_f U) + ε Σx, with the inner LP solved by scipy (independent of CBC)."""
    n_s, n_b = len(services), len(groups)
    best = np.inf
    options = [
        [subset for r in range(1, n_b + 1) for subset in itertools.combinations(range(n_b), r)]
        for _ in range(n_s)
    ]
    for choice in itertools.product(*options):
        load_count = [sum(b in c for c in choice) for b in range(n_b)]
        if max(load_count) > k_max:
            continue
        if not all(
            fits(pool, [services[s] for s in range(n_s) if b in choice[s]], groups[b].tp) for b in range(n_b)
        ):
            continue
        # variables: f[s,b] for b in choice[s], then U
        idx = [(s, b) for s in range(n_s) for b in choice[s]]
        c = np.zeros(len(idx) + 1)
        c[-1] = 1
        a_eq = np.zeros((n_s, len(idx) + 1))
        for j, (s, _) in enumerate(idx):
            a_eq[s, j] = 1
        a_ub = np.zeros((n_b, len(idx) + 1))
        for j, (s, b) in enumerate(idx):
            a_ub[b, j] = service_rate(services[s]) * request_work(pool, services[s], groups[b].tp)
        a_ub[:, -1] = -1
        res = linprog(
            c,
            A_ub=a_ub,
            b_ub=np.zeros(n_b),
            A_eq=a_eq,
            b_eq=np.ones(n_s),
            bounds=[(0, 1)] * len(idx) + [(0, None)],
        )
        assert res.status == 0
        best = min(best, res.fun + EPSILON * len(idx))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ilp_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    services = [svc(f"s{i}", float(rng.uniform(0.2, 3.0)), out=int(rng.integers(50, 600))) for i in range(3)]
    pool = PoolInput("p", "A800", 80 * GIB, 3, gpus_per_node=4)
    groups = [Group(i, 1) for i in range(3)]
    ilp = solve_partition(pool, services, groups, k_max=2)
    n_x = len(ilp.shares)  # placed (service, group) pairs
    assert ilp.max_utilization + EPSILON * n_x == pytest.approx(
        _brute_force_objective(pool, services, groups, 2), rel=1e-6
    )


def test_greedy_within_reported_gap_of_ilp():
    rng = np.random.default_rng(7)
    services = [svc(f"s{i}", float(rng.lognormal(0, 1)), out=int(rng.integers(50, 600))) for i in range(5)]
    pool = PoolInput("p", "A800", 80 * GIB, 4, gpus_per_node=4)
    greedy_groups = generate_groups(pool, services, 1)
    greedy_allocate(pool, services, greedy_groups, 2)
    u_greedy = max_utilization(pool, services, greedy_groups)
    u_opt = solve_partition(pool, services, generate_groups(pool, services, 1), 2).max_utilization
    assert u_opt <= u_greedy + 1e-9
    gap = u_greedy / u_opt - 1
    assert gap < 1.0, f"greedy max utilization {gap:.1%} above the optimum"


def test_the_estimator_prices_decode_at_the_batch_a_busy_instance_runs():
    import math

    from tessera.control.placement import sustained_batch
    from tessera.control.placement_sim import kv_capacity_bytes, separate_kv_bytes
    from tessera.core.planners.types import HistoryRequest
    from tessera.core.profiles import PROFILES
    from tessera.core.request import ServiceClass

    h100 = PROFILES["h100-llama3-8b"]
    chat = ServiceClass("chat", ttft_slo_s=1.0, itl_slo_s=0.1)
    rng = np.random.default_rng(0)

    def history(rate: float) -> tuple[HistoryRequest, ...]:
        t, out = 0.0, []
        while (t := t + rng.exponential(1 / rate)) < 300:
            prompt, output = rng.lognormal(math.log(1024), 0.47), rng.lognormal(7.5, 0.47)
            out.append(HistoryRequest(t, round(prompt), round(output)))
        return tuple(out)

    def eight_b(name: str, slo_class: ServiceClass = chat) -> ServiceInput:
        return ServiceInput(
            name, 16 * GIB, 128 * 1024, h100, request_rate=4.0, mean_prompt_tokens=1024,
            mean_output_tokens=2048, p99_context_tokens=4096, slo_class=slo_class,
        )  # fmt: skip

    pool = PoolInput("p", "H100", 80 * GIB, 4)
    one = eight_b("x")
    # KV-bound: what the GPU holds beside the weights, at the mean context (prompt + half the output);
    # a group of two splits it as its pods do (two engines, an activation reserve each), or SeaLLM's
    # unified pool in halves.
    kv_tokens = kv_capacity_bytes(pool, [one], 1) / one.kv_bytes_per_token
    assert sustained_batch(pool, one, 1) == int(kv_tokens // 2048) < 256
    two = [one, eight_b("z")]
    assert sustained_batch(pool, one, 1, two) == int(separate_kv_bytes(pool, two, 1) / 128 / 1024 // 2048)
    temporal = replace(pool, temporal_sharing=True)
    halves = int(kv_capacity_bytes(pool, two, 1) / 128 / 1024 / 2 // 2048)
    assert sustained_batch(temporal, one, 1, two) == halves > sustained_batch(pool, one, 1, two)
    # ITL-bound: a tighter class keeps the batch to what decodes within the bound.
    tight = eight_b("y", slo_class=ServiceClass("fast", itl_slo_s=0.01))
    n = sustained_batch(pool, tight, 1)
    assert h100.decode_step(n, n * 2048) <= 0.01 < h100.decode_step(n + 1, (n + 1) * 2048)
    # Two equal loads on four GPUs get two instances each (priced at a batch of 16, every candidate
    # looked overloaded and the greedy gave one service 1 GPU and the other 3).
    services = [replace(eight_b(n), history=history(4.0)) for n in ("s0", "s1")]
    groups = generate_groups(pool, services, 1)
    greedy_allocate(pool, services, groups, 1)
    assert sorted(g.services[0] for g in groups) == ["s0", "s0", "s1", "s1"]
