"""QLM's global scheduler: the MILP that orders and assigns request groups to virtual queues
(qlm_chiron_spec A7; paper Eq. 6-13), solved with PuLP's bundled CBC, with EDF as the fallback.

We use the spec's corrected linear model (A7 "Recommended linear model"):

- Eq. 6 is printed with ``sum_q``; it sums over VQs and positions. Empty positions are
  "at most one group per slot, no gaps" (B) instead of dummy groups.
- Eq. 9 (model switch) is written big-M-free over per-model indicators (D). The
  reference code's big-M for Eq. 9 is infeasible for t=0 and is not copied.
- Eq. 10's third term is bilinear (t x) and indexes the wrong group; we charge the
  *previous* group's completion beyond its drain, ``C - W``, linearised with big-M (E).
  Its swap sum runs to ``k <= j`` so a group never starts before its own model is
  loaded (the paper's ``k <= j-1`` would allow it). Waiting time is written
  recursively (F), ``wt_j = wt_{j-1} + W(slot j-1) + S t_j + u_j``, which is the same
  sum with O(positions) instead of O(positions^2) terms.
- Eq. 13 sums over ``i`` in print; it is the sum over slots. Since the sum of SLOs is
  constant it is the total waiting time of the groups (I), under hard SLOs (H).

Pure: inputs are numbers, no clock except the solver's own time limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import pulp

from tessera.worker.policies.qlm.estimator import GroupCosts, QueuedGroup, start_times

PlanStatus = Literal["optimal", "feasible", "edf-timeout", "edf-infeasible", "trivial"]


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One virtual queue (instance) as the MILP sees it."""

    name: str
    loaded_model: str | None  # model in GPU memory now (None: no swap needed for the first group)
    residual: float = 0.0  # R_g: drain of running work that cannot be evicted (spec A12-9)
    swap_s: float = 0.0  # S_g: model swap time (spec A12-13: one constant per instance)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One request group: its model, slack, and its estimated costs on each VQ that can host it."""

    id: int
    model: str
    slack: float  # earliest deadline of its waiting members minus now
    costs: Mapping[str, GroupCosts]  # VQ name -> costs; a VQ missing here cannot host the model
    pinned: str | None = None  # started there: no migration (spec A4)
    current: str | None = None  # VQ it sits in now (EDF fallback keeps it; warm start)

    def __post_init__(self) -> None:
        if not self.costs:
            raise ValueError(f"group {self.id} can run on no virtual queue")
        for vq in (self.pinned, self.current):
            if vq is not None and vq not in self.costs:
                raise ValueError(f"group {self.id} sits on {vq!r}, which cannot host model {self.model!r}")


@dataclass(slots=True)
class Plan:
    """The scheduler's answer: group ids per VQ in execution order."""

    order: dict[str, list[int]]
    status: PlanStatus
    objective: float | None = None  # sum of group waiting times (seconds) when solved
    solve_s: float = 0.0  # wall time of building and solving
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SolverSettings:
    """Knobs of the global scheduler (spec A7 "Size control and solver settings")."""

    time_limit_s: float = 5.0  # spec: the paper's 5 s per-group production budget
    mip_gap: float = 0.01
    slots_factor: float = 3.0  # L = min(N, ceil(slots_factor * N / |G|) + 2)
    tail_aware: bool = True  # compare start + W_last + P with the slack (spec A12-8)
    threads: int = 1

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError(f"solver time limit must be > 0 s, got {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise ValueError(f"mip_gap must be in [0, 1), got {self.mip_gap}")
        if self.slots_factor < 1:
            raise ValueError(f"slots_factor must be >= 1, got {self.slots_factor}")


def _queued(group: GroupSpec, vq: str) -> QueuedGroup:
    return QueuedGroup(group.model, group.costs[vq], group.slack)


def evaluate(
    order: Mapping[str, Sequence[int]],
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    tail_aware: bool = True,
) -> tuple[float, bool]:
    """Total group waiting time of an order and whether every group meets its SLO (the MILP's model)."""
    by_id = {g.id: g for g in groups}
    total, ok = 0.0, True
    for q in queues:
        seq = [_queued(by_id[gid], q.name) for gid in order.get(q.name, [])]
        starts = start_times(seq, q.loaded_model, q.residual, q.swap_s)
        total += sum(starts)
        for group, start in zip(seq, starts, strict=True):
            if start + (group.costs.tail if tail_aware else 0.0) > group.slack + 1e-6:
                ok = False
    return total, ok


def edf_plan(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], status: PlanStatus) -> Plan:
    """EDF fallback (spec A7): each group stays on its VQ (pinned, else current, else the first that
    can host it) and every VQ is sorted by slack ascending."""
    order: dict[str, list[int]] = {q.name: [] for q in queues}
    for g in sorted(groups, key=lambda g: (g.slack, g.id)):
        vq = g.pinned or g.current or next(q.name for q in queues if q.name in g.costs)
        order[vq].append(g.id)
    return Plan(order=order, status=status)


def heuristic_plan(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], tail_aware: bool = True) -> Plan:
    """A good starting order for the solver (its warm start).

    Assignment: pinned groups stay; the others, shortest drain first, go to the VQ whose
    queued drain is smallest (list scheduling, optimal for total wait without deadlines).
    Order per VQ: Smith's backward rule (optimal for one machine, total completion time
    under deadlines): repeatedly put last the longest group that may finish last.
    """
    load = {q.name: q.residual for q in queues}
    members: dict[str, list[GroupSpec]] = {q.name: [] for q in queues}
    free = []
    for g in groups:
        if g.pinned is not None:
            members[g.pinned].append(g)
            load[g.pinned] += g.costs[g.pinned].drain
        else:
            free.append(g)
    for g in sorted(free, key=lambda g: (min(c.drain for c in g.costs.values()), g.id)):
        vq = min(g.costs, key=lambda name: (load[name] + g.costs[name].drain, name))
        members[vq].append(g)
        load[vq] += g.costs[vq].drain
    order: dict[str, list[int]] = {}
    for q in queues:
        remaining = list(members[q.name])
        end = q.residual + sum(g.costs[q.name].drain for g in remaining)
        if q.loaded_model is not None and any(g.model != q.loaded_model for g in remaining):
            end += q.swap_s  # at least one swap ahead of everything (exact for one model)
        backward: list[GroupSpec] = []
        while remaining:

            def deadline(g: GroupSpec, q: QueueSpec = q) -> float:
                c = g.costs[q.name]
                return g.slack - (c.tail if tail_aware else 0.0) + c.drain

            fits = [g for g in remaining if deadline(g) >= end - 1e-9]
            pick = max(fits or remaining, key=lambda g, q=q: (g.costs[q.name].drain, -deadline(g), g.id))
            remaining.remove(pick)
            backward.append(pick)
            end -= pick.costs[q.name].drain
        order[q.name] = [g.id for g in reversed(backward)]
    return Plan(order=order, status="trivial")


def _expr(terms: Sequence[tuple[pulp.LpVariable, float]], constant: float = 0.0) -> pulp.LpAffineExpression:
    """A linear expression built in one go (PuLP's operator overloading is ~10x slower)."""
    expr = pulp.LpAffineExpression(constant=constant)
    for var, coef in terms:
        expr[var] = expr.get(var, 0.0) + coef
    return expr


def solve(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], settings: SolverSettings) -> Plan:
    """Order and assign ``groups`` over ``queues`` minimising total waiting time with every SLO met.

    Slots are indexed from the tail of each VQ (slot r has r groups behind it), which
    makes the objective exactly linear without the big-M of the paper's Eq. 13 form and
    keeps the relaxation an assignment problem; feasible set and objective are the
    spec's. CBC starts from ``heuristic_plan``. Falls back to EDF when CBC proves the
    model infeasible or has no solution at the time limit; a feasible incumbent at the
    time limit is accepted.
    """
    started = time.perf_counter()
    names = [q.name for q in queues]
    if len(set(names)) != len(names):
        raise ValueError(f"virtual queue names must be unique: {names}")
    for g in groups:
        unknown = set(g.costs) - set(names)
        if unknown:
            raise ValueError(f"group {g.id} has costs for unknown virtual queues {sorted(unknown)}")
    if not groups:
        return Plan(order={n: [] for n in names}, status="trivial", objective=0.0)

    warm = heuristic_plan(groups, queues, settings.tail_aware)
    if len(queues) == 1 and len({g.model for g in groups}) == 1:
        # One VQ, one model: 1|deadlines|sum C_j, which Smith's backward rule solves exactly
        # (it finds a feasible order iff one exists), so CBC is not needed.
        total, ok = evaluate(warm.order, groups, queues, settings.tail_aware)
        if ok:
            return Plan(warm.order, "optimal", total, time.perf_counter() - started, ["smith"])
        plan = edf_plan(groups, queues, "edf-infeasible")
        plan.solve_s = time.perf_counter() - started
        return plan

    n_groups = len(groups)
    slots = min(n_groups, math.ceil(settings.slots_factor * n_groups / len(queues)) + 2)
    by_id = {g.id: gi for gi, g in enumerate(groups)}
    prob = pulp.LpProblem("qlm_vq_order", pulp.LpMinimize)
    x: dict[tuple[str, int, int], pulp.LpVariable] = {}
    allowed: dict[str, list[int]] = {}  # VQ -> indices of the groups it may host
    for q in queues:
        allowed[q.name] = [
            gi for gi, g in enumerate(groups) if q.name in g.costs and g.pinned in (None, q.name)
        ]
        for gi in allowed[q.name]:
            for r in range(slots):
                x[q.name, gi, r] = pulp.LpVariable(f"x_{len(x)}", cat=pulp.LpBinary)

    # (A) each group in exactly one slot.
    for gi, g in enumerate(groups):
        terms = [(x[q.name, gi, r], 1.0) for q in queues if gi in allowed[q.name] for r in range(slots)]
        if not terms:
            raise ValueError(f"group {g.id} is pinned to {g.pinned!r}, which is not a virtual queue")
        prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintEQ, rhs=1)

    objective: list[tuple[pulp.LpVariable, float]] = []
    for q in queues:
        hosted = allowed[q.name]
        if not hosted:
            continue
        cost = {gi: groups[gi].costs[q.name] for gi in hosted}
        models = sorted({groups[gi].model for gi in hosted})
        max_cw = max(c.completion - c.drain for c in cost.values())
        big = (
            q.residual
            + sum(c.drain for c in cost.values())
            + len(hosted) * (q.swap_s + max_cw)
            + max(c.tail for c in cost.values())
        )
        tail = {gi: cost[gi].tail if settings.tail_aware else 0.0 for gi in hosted}
        # Slot r counts groups *behind*: r = 0 is the tail, the highest occupied r the head.
        xs = [[(gi, x[q.name, gi, r]) for gi in hosted] for r in range(slots)]
        occ = [[(v, 1.0) for _, v in xs[r]] for r in range(slots)]
        start_next: pulp.LpVariable | None = None
        for r in reversed(range(slots)):
            # (B) at most one group per slot, no gaps (occupied slots are 0..n-1).
            prob += pulp.LpConstraint(_expr(occ[r]), pulp.LpConstraintLE, rhs=1)
            if r + 1 < slots:
                prob += pulp.LpConstraint(
                    _expr(occ[r + 1] + [(v, -c) for v, c in occ[r]]), pulp.LpConstraintLE, rhs=0
                )
            # (D) model switch into slot r: its model differs from the group ahead (slot r+1) or,
            # at the head (occ_r - occ_{r+1} = 1), from the loaded model.
            t = pulp.LpVariable(f"t_{q.name}_{r}", cat=pulp.LpBinary)
            for m in models:
                terms = [(t, 1.0)] + [(v, -1.0) for gi, v in xs[r] if groups[gi].model == m]
                ahead = [(v, 1.0) for gi, v in xs[r + 1] if groups[gi].model == m] if r + 1 < slots else []
                terms += ahead
                if q.loaded_model is None or q.loaded_model == m:
                    terms += occ[r] + ([(v, -1.0) for v, _ in occ[r + 1]] if r + 1 < slots else [])
                prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintGE, rhs=0)
            # (E) drain of the group ahead beyond its W before the swap (big-M on t); 0 at the head.
            u = pulp.LpVariable(f"u_{q.name}_{r}", lowBound=0)
            if r + 1 < slots:
                terms = [(u, 1.0), (t, -max_cw)]
                terms += [(v, -(cost[gi].completion - cost[gi].drain)) for gi, v in xs[r + 1]]
                prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintGE, rhs=-max_cw)
            # (F) start (waiting time) of slot r: everything ahead plus its own swap.
            start = pulp.LpVariable(f"wt_{q.name}_{r}", lowBound=0)
            terms = [(start, 1.0), (t, -q.swap_s), (u, -1.0)]
            if start_next is None:
                prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintEQ, rhs=q.residual)
            else:
                terms += [(start_next, -1.0)] + [(v, -cost[gi].drain) for gi, v in xs[r + 1]]
                prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintEQ, rhs=0)
            start_next = start
            # (G, H) every occupied slot meets its group's SLO: start + tail - slack <= M (1 - occ).
            terms = [(start, 1.0)] + [(v, tail[gi] - groups[gi].slack + big) for gi, v in xs[r]]
            prob += pulp.LpConstraint(_expr(terms), pulp.LpConstraintLE, rhs=big)
            # (I) objective, exactly linear in tail-indexed slots: a group's drain delays the r
            # groups behind it, a swap into slot r delays r + 1 groups, R_g delays every group.
            objective += [(v, cost[gi].drain * r + q.residual) for gi, v in xs[r]]
            objective += [(t, (r + 1) * q.swap_s), (u, float(r + 1))]
            _warm_slot(warm, q, r, groups, by_id, x, t, u, start)
    prob.setObjective(_expr(objective))

    solver = pulp.PULP_CBC_CMD(
        msg=False,
        timeLimit=settings.time_limit_s,
        gapRel=settings.mip_gap,
        threads=settings.threads,
        warmStart=True,
    )
    status = prob.solve(solver)
    elapsed = time.perf_counter() - started
    if status != pulp.LpStatusOptimal or prob.sol_status not in (
        pulp.LpSolutionOptimal,
        pulp.LpSolutionIntegerFeasible,
    ):
        infeasible = status == pulp.LpStatusInfeasible
        plan = edf_plan(groups, queues, "edf-infeasible" if infeasible else "edf-timeout")
        plan.solve_s = elapsed
        plan.notes.append(f"CBC status {pulp.LpStatus[status]}, solution status {prob.sol_status}")
        return plan

    order: dict[str, list[int]] = {}
    for q in queues:
        placed = [
            (r, groups[gi].id)
            for gi in allowed[q.name]
            for r in range(slots)
            if (x[q.name, gi, r].value() or 0.0) > 0.5
        ]
        order[q.name] = [gid for _, gid in sorted(placed, reverse=True)]
    total, _ = evaluate(order, groups, queues, settings.tail_aware)
    return Plan(
        order=order,
        status="optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible",
        objective=total,
        solve_s=elapsed,
    )


def _warm_slot(
    warm: Plan,
    q: QueueSpec,
    r: int,
    groups: Sequence[GroupSpec],
    by_id: Mapping[int, int],
    x: Mapping[tuple[str, int, int], pulp.LpVariable],
    t: pulp.LpVariable,
    u: pulp.LpVariable,
    start: pulp.LpVariable,
) -> None:
    """Set the warm-start values of slot r of VQ q from the heuristic order."""
    seq = warm.order[q.name]
    n = len(seq)
    if r >= n:
        t.setInitialValue(0)
        u.setInitialValue(0.0)
        start.setInitialValue(q.residual + sum(groups[by_id[gid]].costs[q.name].drain for gid in seq))
        return
    j = n - 1 - r  # head-indexed position
    queued = [_queued(groups[by_id[gid]], q.name) for gid in seq]
    starts = start_times(queued, q.loaded_model, q.residual, q.swap_s)
    model_ahead = queued[j - 1].model if j else q.loaded_model
    switch = model_ahead is not None and queued[j].model != model_ahead
    t.setInitialValue(int(switch))
    u.setInitialValue(queued[j - 1].costs.completion - queued[j - 1].costs.drain if switch and j else 0.0)
    start.setInitialValue(starts[j])
    x[q.name, by_id[seq[j]], r].setInitialValue(1)
