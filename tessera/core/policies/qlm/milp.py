"""QLM's global scheduler: the MILP that orders and assigns request groups to virtual queues
(QLM §7, Eq. 6-13), modelled with PuLP and solved by its bundled CBC, with EDF
as the fallback.

We correct the printed model into a linear, solvable one (docs/papers.md, "QLM: global scheduler"):

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
  constant it is the total waiting time of the groups (I), under hard SLOs (H, big-M).

Size and speed (our settings, same model):

- Slots are indexed from the tail of each VQ (slot r has r groups behind it), which makes
  the objective exactly linear (a group's drain delays the r groups behind it) without
  the (I) big-M; feasible set and optimum are those of the model above.
- ``L = min(N_q, ceil(slots_factor * N / |G|) + 2)`` with ``slots_factor = 1.25`` instead of
  3 (a looser bound; QLM's reference code uses L = N). With identical VQs the optimum of total
  wait is balanced (SPT round-robin is optimal for P||sum C_j: every VQ holds floor or ceil of
  N/|G| groups);
  deadlines and model affinity unbalance it, which the 25% headroom allows. It is an
  approximation only when an optimal plan needs a VQ longer than L (then we return the
  best plan within L); with L >= N_q it is exact.
- The model is assembled as numpy coefficient triplets and turned into PuLP rows in one pass
  (``LpAffineExpression`` from prepared pairs); PuLP writes the MPS file and the MIP start and
  reads CBC's solution (``_run_cbc``). ``Plan.phases`` holds build, write and CBC seconds.
- MIP start: ``heuristic_plan`` (below) is handed to CBC as its incumbent, so CBC always has
  one; a plan CBC returns that is no better than it has status ``heuristic``.
- Time limit: it bounds the heuristic, the build, the write and CBC. CBC gets 90% of what is
  left after the write as its own ``-sec`` limit and is killed at the deadline (CBC checks its
  limit only between search steps; we measured 1.7 s over a 5 s limit). PuLP's MPS write cannot
  be interrupted, so CBC is skipped when the time left is under 3x the row-building time (the
  write took 2-2.5x; 200 groups forced into one joint model ran 1.9 s over a 0.5 s limit
  without this). At the limit the best feasible incumbent wins; EDF when there is
  none or the joint model is infeasible.

Size control: the joint MILP up to ``joint_max_binaries`` x[g, q, r] binaries (1000: 24 groups
on 4 VQs; measured p50 0.1 s, optimal). Above it a rolling-horizon MILP (``window_groups``, 24):

- Why: the joint model of 100 groups on 4 VQs (13.6k binaries, 122k nonzeros) takes CBC about
  0.5 s for the root LP and 3 s of probing; with the heuristic as MIP start it found nothing
  better in 60 s (root bound 2.6% below it; with cuts off, 8,600 nodes without an
  improvement), and build + write alone take 0.3-0.7 s. Pinning each group to the heuristic's
  VQ (ordering only, 2.5k binaries) did not prove optimality within 5 s on 2 of 3 seeds either.
- What: the window is the groups that miss their SLO in the heuristic plan (tightest slack
  first) plus the groups that start first, ``window_groups`` in all; every VQ keeps the rest
  of its heuristic order as a fixed tail behind the window. The window MILP is the same model
  over the window's groups, with three exact terms for the tail of k groups: every drain, swap
  and C - W in the window delays k more groups (objective coefficients r + k instead of r); a
  switch into the tail's first model is charged like any other (D, E on a boundary slot); and
  the tail's start must leave every tail group its SLO (H on the tail's latest start). Its
  optimum is the best plan that keeps the tails fixed (brute-force test); status
  ``window-optimal`` (never ``optimal``: the tails are not optimised). ``window_groups = 0``
  returns the heuristic plan above the threshold instead.
- The heuristic: swap-aware SPT list scheduling for the assignment (optimal for total wait on
  identical VQs without deadlines or swaps, P||sum C_j) and, per VQ, one block per model in the
  best block order with Smith's rule inside (exact for a single-model VQ).

Class priority (``GroupSpec.priority``, its requests' ``ServiceClass.priority``, higher first) never
outweighs wait or slack; it breaks their ties: the EDF fallback (the plan when no order meets every
SLO, so the one that decides which group misses) puts the higher class first among equal slack, the
heuristic's list scheduling places it first among equal drains, Smith's rule puts the lower class
last among groups of equal drain and latest end, and the rolling horizon's window takes late groups
of equal slack higher class first. Among MILP optima of equal total wait CBC's pick stands.

Pure: inputs are numbers, no clock except the solver's own time limit.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pulp

from tessera.core.policies.qlm.estimator import GroupCosts, QueuedGroup, start_times

# optimal / feasible: from the joint MILP (proven within the gap / not proven); window-optimal: the
# rolling-horizon MILP's optimum with the tails fixed (module docstring); heuristic: the warm-start
# order, feasible, and CBC found nothing better in time; edf-*: no feasible plan found (the fallback:
# EDF, as QLM's reference code, or the heuristic order where ``SolverSettings.fallback`` picks it;
# ``Plan.notes`` says which); trivial: nothing to solve.
PlanStatus = Literal[
    "optimal", "window-optimal", "feasible", "heuristic", "edf-timeout", "edf-infeasible", "trivial"
]
_MIN_CBC_S = 0.01  # smallest -sec handed to CBC
_WRITE_PER_BUILD = 3.0  # time left needed per second of PuLP row building (the write takes ~2-2.5x)
_CBC_SHARE = 0.9  # of the time left that CBC's own limit gets; the rest lets it write its solution


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One virtual queue (instance) as the MILP sees it."""

    name: str
    loaded_model: str | None  # model in GPU memory now (None: no swap needed for the first group)
    residual: float = 0.0  # R_g: drain of running work that cannot be evicted
    swap_s: float = 0.0  # S_g: model swap time (CHOICE: one constant per instance)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One request group: its model, slack, and its estimated costs on each VQ that can host it."""

    id: int
    model: str
    slack: float  # earliest deadline of its waiting members minus now
    costs: Mapping[str, GroupCosts]  # VQ name -> costs; a VQ missing here cannot host the model
    pinned: str | None = None  # started there: no migration (QLM §5)
    current: str | None = None  # VQ it sits in now (EDF fallback keeps it; warm start)
    priority: int = 0  # its class's priority, higher first: breaks ties of slack and drain

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
    phases: dict[str, float] = field(default_factory=dict)  # build_s, write_s, solve_s when CBC ran


@dataclass(frozen=True, slots=True)
class SolverSettings:
    """Knobs of the global scheduler (size control and solver settings: our choices)."""

    time_limit_s: float = 5.0  # QLM's 5 s solver budget (Fig. 20); bounds build + solve
    mip_gap: float = 0.01
    slots_factor: float = 1.25  # L = min(N_q, ceil(slots_factor * N / |G|) + 2); module docstring
    tail_aware: bool = True  # compare start + GroupCosts.slo_span with the slack (Eq. 11: start only)
    # Largest joint model (binaries x[g, q, r]) solved as one MILP; beyond it the rolling-horizon
    # MILP over the first ``window_groups`` groups of the heuristic plan (0: the heuristic plan).
    joint_max_binaries: int = 1000
    window_groups: int = 24
    # The order when no plan meets every SLO. "edf": EDF (QLM's fallback). "fewest-late" (CHOICE, the
    # default): the heuristic plan (a block per model, Smith's rule inside) when it leaves fewer groups
    # late than EDF, or as many with less total wait; else EDF. Under overload EDF serves the groups
    # already late first, so every later one misses too, and with several models it interleaves them,
    # paying a swap at each change. The heuristic meets more SLOs under overload at a longer tail: the
    # requests that miss anyway wait longer (figures: docs/bench.md, QLM).
    fallback: Literal["edf", "fewest-late"] = "fewest-late"

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError(f"solver time limit must be > 0 s, got {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise ValueError(f"mip_gap must be in [0, 1), got {self.mip_gap}")
        if self.slots_factor < 1:
            raise ValueError(f"slots_factor must be >= 1, got {self.slots_factor}")
        if self.joint_max_binaries < 1:
            raise ValueError(f"joint_max_binaries must be >= 1, got {self.joint_max_binaries}")
        if self.window_groups < 0:
            raise ValueError(
                f"window_groups must be >= 0 (0: no MILP above joint_max_binaries), got {self.window_groups}"
            )
        if self.fallback not in ("edf", "fewest-late"):
            raise ValueError(f"fallback must be 'edf' or 'fewest-late', got {self.fallback!r}")


def _queued(group: GroupSpec, vq: str) -> QueuedGroup:
    return QueuedGroup(group.model, group.costs[vq], group.slack)


def evaluate(
    order: Mapping[str, Sequence[int]],
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    tail_aware: bool = True,
) -> tuple[float, bool]:
    """Total group waiting time of an order and whether every group meets its SLO (the MILP's model)."""
    total, late = _wait_and_late(order, groups, queues, tail_aware)
    return total, late == 0


def _wait_and_late(
    order: Mapping[str, Sequence[int]],
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    tail_aware: bool,
) -> tuple[float, int]:
    """Total group waiting time of an order and how many groups it leaves past their SLO."""
    by_id = {g.id: g for g in groups}
    total, late = 0.0, 0
    for q in queues:
        seq = [_queued(by_id[gid], q.name) for gid in order.get(q.name, [])]
        starts = start_times(seq, q.loaded_model, q.residual, q.swap_s)
        total += sum(starts)
        for group, start in zip(seq, starts, strict=True):
            if start + (group.costs.slo_span if tail_aware else 0.0) > group.slack + 1e-6:
                late += 1
    return total, late


def edf_plan(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], status: PlanStatus) -> Plan:
    """EDF fallback (QLM §9; as QLM's reference code): each group stays on its VQ (pinned, else
    current, else the first that can host it) and every VQ is sorted by slack ascending (equal
    slack: the higher class priority first)."""
    order: dict[str, list[int]] = {q.name: [] for q in queues}
    for g in sorted(groups, key=lambda g: (g.slack, -g.priority, g.id)):
        vq = g.pinned or g.current or next(q.name for q in queues if q.name in g.costs)
        order[vq].append(g.id)
    return Plan(order=order, status=status)


def heuristic_plan(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], tail_aware: bool = True) -> Plan:
    """A good feasible-leaning plan: the solver's incumbent and the EDF fallback's competitor.

    Assignment: pinned groups stay; the others, shortest drain first, go to the VQ where they
    would end soonest, counting a swap (S plus a drain before it) when the VQ has no group of
    their model yet and does not hold it loaded (list scheduling, optimal for total wait on
    identical VQs without deadlines or swaps). Order per VQ: one block per model, the loaded
    model first, then by the block's tightest slack; inside a block Smith's backward rule
    (optimal for one machine, total completion time under deadlines): repeatedly put last the
    longest group that may finish last. For one model this is exactly Smith's rule.
    """
    members: dict[str, list[GroupSpec]] = {q.name: [] for q in queues}
    load = {q.name: q.residual for q in queues}
    models = {q.name: {q.loaded_model} for q in queues}
    by_name = {q.name: q for q in queues}

    def place(g: GroupSpec, vq: str) -> None:
        members[vq].append(g)
        load[vq] += g.costs[vq].drain + _switch_cost(g, by_name[vq], models[vq])
        models[vq].add(g.model)

    free = []
    for g in groups:
        if g.pinned is not None:
            place(g, g.pinned)
        else:
            free.append(g)
    for g in sorted(free, key=lambda g: (min(c.drain for c in g.costs.values()), -g.priority, g.id)):
        vq = min(
            g.costs,
            key=lambda n: (load[n] + g.costs[n].drain + _switch_cost(g, by_name[n], models[n]), n),
        )
        place(g, vq)
    order = {q.name: _block_order(members[q.name], q, tail_aware) for q in queues}
    return Plan(order=order, status="trivial")


def _switch_cost(g: GroupSpec, q: QueueSpec, models: set[str | None]) -> float:
    """Swap time a new group of ``g``'s model adds to ``q`` (S + the max C - W drain), or 0."""
    if g.model in models or (q.loaded_model is None and models == {None}):
        return 0.0
    c = g.costs[q.name]
    return q.swap_s + c.beyond_drain


def _block_order(members: Sequence[GroupSpec], q: QueueSpec, tail_aware: bool) -> list[int]:
    """One block per model, Smith's rule inside each; the block order of least total wait among
    those that meet every SLO (or of least total wait if none does)."""

    def latest_end(g: GroupSpec) -> float:  # latest completion of g's drain that meets its SLO
        c = g.costs[q.name]
        return g.slack - (c.slo_span if tail_aware else 0.0) + c.drain

    blocks: dict[str, list[GroupSpec]] = {}
    for g in members:
        blocks.setdefault(g.model, []).append(g)
    # Every order of the model blocks (at most 4! = 24; beyond 4 models only the loaded model first,
    # then tightest slack first), Smith inside each; the first feasible of least total wait wins.
    by_slack = sorted(
        blocks,
        key=lambda m: (m != q.loaded_model, min(latest_end(g) - g.costs[q.name].drain for g in blocks[m]), m),
    )
    candidates = itertools.permutations(by_slack) if len(blocks) <= 4 else [tuple(by_slack)]
    by_id = {g.id: g for g in members}
    best: tuple[bool, float] | None = None
    best_order: list[int] = []
    for ordered in candidates:
        order = _smith_blocks(ordered, blocks, q, latest_end)
        total, ok = evaluate({q.name: order}, [by_id[i] for i in order], [q], tail_aware)
        if best is None or (not ok, total) < best:
            best, best_order = (not ok, total), order
    return best_order


def _smith_blocks(
    ordered: Sequence[str],
    blocks: Mapping[str, list[GroupSpec]],
    q: QueueSpec,
    latest_end: Callable[[GroupSpec], float],
) -> list[int]:
    """Group ids for model blocks in ``ordered`` order, Smith's backward rule inside each block."""
    order: list[int] = []
    t = q.residual
    prev: GroupSpec | None = None
    for model in ordered:
        if (q.loaded_model is not None and model != q.loaded_model) or prev is not None:
            c = prev.costs[q.name] if prev is not None else None
            t += q.swap_s + (c.beyond_drain if c is not None else 0.0)
        remaining = list(blocks[model])
        end = t + sum(g.costs[q.name].drain for g in remaining)
        t = end
        backward: list[GroupSpec] = []
        while remaining:
            fits = [g for g in remaining if latest_end(g) >= end - 1e-9]
            pick = max(
                fits or remaining, key=lambda g: (g.costs[q.name].drain, -latest_end(g), -g.priority, g.id)
            )
            remaining.remove(pick)
            backward.append(pick)
            end -= pick.costs[q.name].drain
        order += [g.id for g in reversed(backward)]
        prev = backward[0]
    return order


@dataclass(frozen=True, slots=True)
class _VQColumns:
    """Where one VQ's variables sit in the column vector."""

    name: str
    hosted: np.ndarray  # group indices this VQ can host
    x: np.ndarray  # x[a, r]: hosted group a in slot r (slot r has r groups behind it)
    t: np.ndarray  # t[r]: model switch right before slot r
    u: np.ndarray  # u[r]: the group ahead's completion beyond its drain, paid on a switch (E)
    wt: np.ndarray  # wt[r]: start of the group in slot r (F)
    boundary: tuple[int, int] | None  # (t_b, u_b): switch into the fixed tail behind the window


@dataclass(slots=True)
class _Model:
    """The MILP as coefficient triplets plus the maps back to groups and slots."""

    c: np.ndarray
    binary: np.ndarray  # bool per column
    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    lo: np.ndarray  # row bounds (lo == hi: equality)
    hi: np.ndarray
    vqs: list[_VQColumns]


@dataclass(frozen=True, slots=True)
class _Tail:
    """The fixed groups behind a VQ's window (rolling horizon, module docstring)."""

    count: int  # k: groups behind the window, each delayed by everything in it
    model: str  # model of the first tail group (a switch into it costs S + C - W)
    latest_start: float  # min over the tail of slack - slo_span - offset from the tail's first start


def _build(
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    settings: SolverSettings,
    tails: Mapping[str, _Tail] | None = None,
) -> _Model:
    """The tail-indexed slot model (module docstring) as coefficient triplets.

    Columns per VQ: x[a, r] (hosted group a in slot r, a-major), then t[r], u[r], wt[r], and with
    a fixed tail behind the VQ t_b, u_b. Slot r has r groups behind it; r + 1 is the slot ahead.
    """
    tails = tails or {}
    n_groups = len(groups)
    slots_cap = math.ceil(settings.slots_factor * n_groups / len(queues)) + 2
    rows_i: list[np.ndarray] = []
    cols_i: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lo: list[np.ndarray] = []
    hi: list[np.ndarray] = []
    c_parts: list[np.ndarray] = []
    bin_parts: list[np.ndarray] = []
    n_rows = n_groups  # rows 0..N-1: (A) each group in exactly one slot
    n_cols = 0
    vqs: list[_VQColumns] = []
    assign_cols: list[np.ndarray] = []
    assign_rows: list[np.ndarray] = []

    def add(
        r: np.ndarray | Sequence[int], c: np.ndarray | Sequence[int], v: np.ndarray | Sequence[float]
    ) -> None:
        cols = np.asarray(c, dtype=np.int64).ravel()
        rows_i.append(np.broadcast_to(np.asarray(r, dtype=np.int64).ravel(), cols.shape))
        cols_i.append(cols)
        vals.append(np.broadcast_to(np.asarray(v, dtype=float).ravel(), cols.shape))

    def new_rows(k: int, low: float | np.ndarray, high: float | np.ndarray) -> np.ndarray:
        nonlocal n_rows
        idx = np.arange(n_rows, n_rows + k)
        lo.append(np.broadcast_to(np.asarray(low, dtype=float), (k,)))
        hi.append(np.broadcast_to(np.asarray(high, dtype=float), (k,)))
        n_rows += k
        return idx

    for q in queues:
        hosted = np.array(
            [gi for gi, g in enumerate(groups) if q.name in g.costs and g.pinned in (None, q.name)], dtype=int
        )
        if hosted.size == 0:
            continue
        n_a = hosted.size
        n_l = min(n_a, slots_cap)
        cost = [groups[gi].costs[q.name] for gi in hosted]
        drain = np.array([c.drain for c in cost])
        cw = np.array([c.beyond_drain for c in cost])
        span = np.array([c.slo_span if settings.tail_aware else 0.0 for c in cost])
        slack = np.array([groups[gi].slack for gi in hosted])
        model_of = [groups[gi].model for gi in hosted]
        max_cw = float(cw.max())
        big = q.residual + drain.sum() + n_a * (q.swap_s + max_cw) + float(span.max())
        tail_q = tails.get(q.name)
        k = tail_q.count if tail_q is not None else 0
        base = n_cols
        x = base + np.arange(n_a * n_l).reshape(n_a, n_l)  # x[a, r]
        t = base + n_a * n_l + np.arange(n_l)
        u = t + n_l
        wt = u + n_l
        n_cols = int(wt[-1]) + 1
        boundary = (n_cols, n_cols + 1) if k else None
        vqs.append(_VQColumns(q.name, hosted, x, t, u, wt, boundary))
        slot = np.arange(n_l)
        c_parts += [
            # (I): a drain delays the r behind it in the model and the k of a fixed tail
            (drain[:, None] * (slot[None, :] + k) + q.residual).ravel(),
            (slot + 1 + k) * q.swap_s,  # a swap into slot r delays r + 1 groups (+ the tail)
            (slot + 1 + k).astype(float),  # so does the drain before it
            np.zeros(n_l),
        ]
        bin_parts += [np.ones(n_a * n_l, bool), np.ones(n_l, bool), np.zeros(2 * n_l, bool)]
        if boundary is not None:
            n_cols += 2
            c_parts.append(np.array([k * q.swap_s, float(k)]))
            bin_parts.append(np.array([True, False]))
        assign_cols.append(x.ravel())
        assign_rows.append(np.repeat(hosted, n_l))
        ones = np.ones(n_a)
        # (B) at most one group per slot; no gaps: occ[r + 1] <= occ[r].
        rb = new_rows(n_l, -np.inf, 1.0)
        add(np.tile(rb, n_a), x, np.tile(ones[:, None], (1, n_l)))
        if n_l > 1:
            rg = new_rows(n_l - 1, -np.inf, 0.0)
            add(np.tile(rg, n_a), x[:, 1:], np.ones((n_a, n_l - 1)))
            add(np.tile(rg, n_a), x[:, :-1], -np.ones((n_a, n_l - 1)))
        # (D) switch into slot r from the group ahead (slot r + 1) or, at the head, the loaded model.
        for m in sorted(set(model_of)):
            is_m = np.array([mo == m for mo in model_of], dtype=float)
            head_free = float(q.loaded_model is None or q.loaded_model == m)  # no switch at the head
            rd = new_rows(n_l, 0.0, np.inf)
            add(rd, t, np.ones(n_l))
            add(np.tile(rd, n_a), x, np.tile((head_free - is_m)[:, None], (1, n_l)))
            if n_l > 1:
                add(np.tile(rd[:-1], n_a), x[:, 1:], np.tile((is_m - head_free)[:, None], (1, n_l - 1)))
        if n_l > 1:
            # (E) u[r] >= (C - W of the group ahead) - max_cw (1 - t[r]).
            re = new_rows(n_l - 1, -max_cw, np.inf)
            add(re, u[:-1], np.ones(n_l - 1))
            add(re, t[:-1], np.full(n_l - 1, -max_cw))
            add(np.tile(re, n_a), x[:, 1:], np.tile(-cw[:, None], (1, n_l - 1)))
        # (F) wt[r] = wt[r + 1] + W(slot r + 1) + S t[r] + u[r]; the head slot starts at R.
        rf = new_rows(n_l, np.r_[np.zeros(n_l - 1), q.residual], np.r_[np.zeros(n_l - 1), q.residual])
        add(rf, wt, np.ones(n_l))
        add(rf, t, np.full(n_l, -q.swap_s))
        add(rf, u, -np.ones(n_l))
        if n_l > 1:
            add(rf[:-1], wt[1:], -np.ones(n_l - 1))
            add(np.tile(rf[:-1], n_a), x[:, 1:], np.tile(-drain[:, None], (1, n_l - 1)))
        # (G, H) an occupied slot meets its group's SLO: wt + span - slack <= big (1 - occ).
        rh = new_rows(n_l, -np.inf, big)
        add(rh, wt, np.ones(n_l))
        add(np.tile(rh, n_a), x, np.tile((span - slack + big)[:, None], (1, n_l)))
        if boundary is not None and tail_q is not None:
            # The fixed tail starts at e = wt[0] + W(slot 0) + S t_b + u_b (slot 0 is the window's
            # last group; an empty window leaves wt[0] = R) and every tail group meets its SLO.
            t_b, u_b = boundary
            off = np.array([mo != tail_q.model for mo in model_of], dtype=float)
            from_loaded = float(q.loaded_model is not None and q.loaded_model != tail_q.model)
            # (D) t_b >= from_loaded (1 - occ[0]) + sum over other-model groups of x[a, 0]
            rdb = new_rows(1, from_loaded, np.inf)
            add(rdb, [t_b], [1.0])
            add(np.repeat(rdb, n_a), x[:, 0], from_loaded - off)
            # (E) u_b >= (C - W of slot 0) - max_cw (1 - t_b)
            reb = new_rows(1, -max_cw, np.inf)
            add(reb, [u_b, t_b], [1.0, -max_cw])
            add(np.repeat(reb, n_a), x[:, 0], -cw)
            # (H) e <= the tail's latest start
            rhb = new_rows(1, -np.inf, tail_q.latest_start)
            add(rhb, [wt[0], t_b, u_b], [1.0, q.swap_s, 1.0])
            add(np.repeat(rhb, n_a), x[:, 0], drain)
    cols = np.concatenate(assign_cols)
    add(np.concatenate(assign_rows), cols, np.ones(cols.size))
    lo.insert(0, np.ones(n_groups))
    hi.insert(0, np.ones(n_groups))
    return _Model(
        c=np.concatenate(c_parts),
        binary=np.concatenate(bin_parts),
        rows=np.concatenate(rows_i),
        cols=np.concatenate(cols_i),
        vals=np.concatenate(vals),
        lo=np.concatenate(lo),
        hi=np.concatenate(hi),
        vqs=vqs,
    )


def bundled_cbc(**options: object) -> pulp.PULP_CBC_CMD:
    """PuLP's command for the CBC binary bundled with PuLP (quiet), with ``options`` such as
    ``timeLimit``. PuLP 3.3 deprecates this class in favour of a separately installed CBC; we want
    the bundled binary (nothing else to install), so that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, **options)


def _run_cbc(
    prob: pulp.LpProblem, mip_gap: float, warm_start: bool, deadline: float, phases: dict[str, float]
) -> tuple[int, int] | None:
    """Solve ``prob`` with PuLP's bundled CBC binary; PuLP writes the MPS (and MIP-start) file and
    reads the solution back. Returns PuLP's (status, sol_status), or None when CBC was still
    running at ``deadline`` (it overran its own limit) and was killed.

    This is PuLP's ``COIN_CMD.solve_CBC`` with a wall-clock stop: PuLP waits on CBC without a
    timeout, and CBC checks its ``-sec`` limit only between search steps (we measured 1.7 s over
    a 5 s limit at 40 groups). CBC gets ``_CBC_SHARE`` of the time left after the write, so it
    normally stops by itself with its incumbent.
    """
    cbc = bundled_cbc(warmStart=warm_start)
    with tempfile.TemporaryDirectory(prefix="qlm-cbc-") as tmp:
        mps, mst, sol = (os.path.join(tmp, f"model.{ext}") for ext in ("mps", "mst", "sol"))
        started = time.perf_counter()
        variables, var_names, row_names, _ = prob.writeMPS(mps, rename=1)
        if warm_start:
            cbc.writesol(mst, prob, variables, var_names, row_names)
        phases["write_s"] = time.perf_counter() - started
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        args = [cbc.path, mps] + (["-mips", mst] if warm_start else [])
        args += [
            "-sec",
            f"{max(_CBC_SHARE * left, _MIN_CBC_S):.3f}",
            "-ratio",
            f"{mip_gap}",
            "-timeMode",
            "elapsed",
        ]
        args += ["-solve", "-printingOptions", "all", "-solution", sol]
        started = time.perf_counter()
        try:
            subprocess.run(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True, timeout=left
            )
        except subprocess.TimeoutExpired:
            return None
        finally:
            phases["solve_s"] = time.perf_counter() - started
        status, values, _, _, _, sol_status = cbc.readsol_MPS(sol, prob, variables, var_names, row_names)
    prob.assignVarsVals(values)
    return status, sol_status


def _to_pulp(model: _Model, deadline: float) -> tuple[pulp.LpProblem, list[pulp.LpVariable]] | None:
    """The triplets as a PuLP problem: one pass over the nonzeros, rows from sorted slices.
    None when the clock passes ``deadline`` first (a model too big for the time limit)."""
    prob = pulp.LpProblem("qlm", pulp.LpMinimize)
    variables = [
        prob.add_variable(f"v{j}", 0, 1, pulp.LpBinary) if is_bin else prob.add_variable(f"v{j}", 0)
        for j, is_bin in enumerate(model.binary.tolist())
    ]
    nz = np.flatnonzero(model.c)
    prob.setObjective(
        pulp.LpAffineExpression(
            [(variables[j], v) for j, v in zip(nz.tolist(), model.c[nz].tolist(), strict=True)]
        )
    )
    order = np.argsort(model.rows, kind="stable")
    row_vars = [variables[j] for j in model.cols[order].tolist()]
    row_vals = model.vals[order].tolist()
    bounds = np.searchsorted(model.rows[order], np.arange(model.lo.size + 1)).tolist()
    for i, (low, high) in enumerate(zip(model.lo.tolist(), model.hi.tolist(), strict=True)):
        if i % 64 == 0 and time.perf_counter() > deadline:
            return None
        start, end = bounds[i], bounds[i + 1]
        expr = pulp.LpAffineExpression(list(zip(row_vars[start:end], row_vals[start:end], strict=True)))
        if low == high:
            sense, rhs = pulp.LpConstraintEQ, low
        elif math.isinf(low):
            sense, rhs = pulp.LpConstraintLE, high
        else:  # no row has two finite bounds that differ (see _build)
            sense, rhs = pulp.LpConstraintGE, low
        prob.addConstraint(pulp.LpConstraint(expr, sense, rhs=rhs), f"r{i}")
    return prob, variables


def _start_values(
    model: _Model,
    order: Mapping[str, Sequence[int]],
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    tails: Mapping[str, _Tail],
) -> np.ndarray | None:
    """Column values of ``order`` (the MIP start), or None if it does not fit the model's slots."""
    values = np.zeros(model.c.size)
    index = {g.id: gi for gi, g in enumerate(groups)}
    by_name = {q.name: q for q in queues}
    for cols in model.vqs:
        q = by_name[cols.name]
        ids = list(order.get(cols.name, []))
        n_l = cols.t.size
        if len(ids) > n_l:
            return None
        row_of = {gi: a for a, gi in enumerate(cols.hosted.tolist())}
        start = q.residual
        prev: GroupSpec | None = None
        for pos, gid in enumerate(ids):
            g = groups[index[gid]]
            r = len(ids) - 1 - pos  # groups behind it
            switch = (prev is not None and g.model != prev.model) or (
                prev is None and q.loaded_model is not None and g.model != q.loaded_model
            )
            if prev is not None:
                start += prev.costs[q.name].drain
            if switch:
                u = prev.costs[q.name].beyond_drain if prev is not None else 0.0
                start += q.swap_s + u
                values[cols.t[r]], values[cols.u[r]] = 1.0, u
            values[cols.x[row_of[index[gid]], r]] = 1.0
            values[cols.wt[r]] = start
            prev = g
        values[cols.wt[len(ids) :]] = q.residual  # empty slots ahead of the head: wt = R
        if cols.boundary is not None:
            before = prev.model if prev is not None else q.loaded_model
            if before is not None and before != tails[cols.name].model:
                values[cols.boundary[0]] = 1.0
                if prev is not None:
                    values[cols.boundary[1]] = prev.costs[q.name].beyond_drain
    return values


def solve(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], settings: SolverSettings) -> Plan:
    """Order and assign ``groups`` over ``queues`` minimising total waiting time with every SLO met.

    Up to ``joint_max_binaries`` the joint MILP; above it the rolling-horizon MILP over the
    ``window_groups`` head groups of the heuristic plan with the rest fixed behind them (module
    docstring). The time limit bounds everything: the heuristic, the model build, PuLP's file
    and CBC (which gets the time left). The heuristic plan is CBC's MIP start; the returned plan
    is CBC's when it is at least as good as the heuristic's feasible plan, else the heuristic's;
    the fallback when neither is feasible (EDF, or the heuristic plan under ``SolverSettings.fallback``;
    ``edf-infeasible`` when CBC proved the joint model infeasible, ``edf-timeout`` otherwise).
    ``Plan.phases`` holds the seconds spent building, writing, solving.
    """
    started = time.perf_counter()
    names = [q.name for q in queues]
    if len(set(names)) != len(names):
        raise ValueError(f"virtual queue names must be unique: {names}")
    for g in groups:
        unknown = set(g.costs) - set(names)
        if unknown:
            raise ValueError(f"group {g.id} has costs for unknown virtual queues {sorted(unknown)}")
        if g.pinned is not None and g.pinned not in names:
            raise ValueError(f"group {g.id} is pinned to {g.pinned!r}, which is not a virtual queue")
    if not groups:
        return Plan(order={n: [] for n in names}, status="trivial", objective=0.0)

    warm = heuristic_plan(groups, queues, settings.tail_aware)
    warm_total, warm_ok = evaluate(warm.order, groups, queues, settings.tail_aware)
    if len(queues) == 1 and len({g.model for g in groups}) == 1:
        # One VQ, one model: 1|deadlines|sum C_j, which Smith's backward rule solves exactly
        # (it finds a feasible order iff one exists), so no MILP is needed.
        if warm_ok:
            return Plan(warm.order, "optimal", warm_total, time.perf_counter() - started, ["smith"])
        note = "Smith's rule: no feasible order"
        return _fallback(groups, queues, "edf-infeasible", started, note, settings, warm)
    phases: dict[str, float] = {}

    def best_of_incumbents(note: str) -> Plan:
        if warm_ok:
            return Plan(warm.order, "heuristic", warm_total, time.perf_counter() - started, [note], phases)
        plan = _fallback(groups, queues, "edf-timeout", started, note, settings, warm)
        plan.phases = phases
        return plan

    joint = _binaries(groups, queues, settings) <= settings.joint_max_binaries
    if not joint and settings.window_groups == 0:
        return best_of_incumbents(f"above joint_max_binaries={settings.joint_max_binaries}: no MILP")
    window, tail_order, tails = (
        (list(groups), {}, {}) if joint else _window(warm.order, groups, queues, settings)
    )
    in_window = {g.id for g in window}
    head_order = {n: [gid for gid in warm.order[n] if gid in in_window] for n in names}
    model = _build(window, queues, settings, tails)
    to_pulp_started = time.perf_counter()
    built = _to_pulp(model, started + settings.time_limit_s)
    if built is None:
        phases["build_s"] = time.perf_counter() - started
        return best_of_incumbents("time limit spent building the model")
    prob, variables = built
    start = _start_values(model, head_order, window, queues, tails) if warm_ok else None
    if start is not None:
        for var, value in zip(variables, start.tolist(), strict=True):
            var.setInitialValue(value)
    phases["build_s"] = time.perf_counter() - started
    # PuLP's MPS write cannot be interrupted; it takes 2-2.5x as long as building the PuLP rows.
    if settings.time_limit_s - phases["build_s"] < _WRITE_PER_BUILD * (time.perf_counter() - to_pulp_started):
        return best_of_incumbents("time limit too short to write the model for CBC")
    solved = _run_cbc(prob, settings.mip_gap, start is not None, started + settings.time_limit_s, phases)
    scope = "joint" if joint else f"window of {len(window)} head groups"
    if solved is None:
        return best_of_incumbents(f"CBC ({scope}) stopped at the time limit")
    cbc_status, sol_status = solved
    if sol_status == pulp.LpSolutionInfeasible or cbc_status == pulp.LpStatusInfeasible:
        if warm_ok or not joint:  # infeasible within L slots (or this window), not proven for all
            return best_of_incumbents(f"CBC: {scope} MILP infeasible")
        plan = _fallback(groups, queues, "edf-infeasible", started, "CBC: infeasible", settings, warm)
        plan.phases = phases
        return plan
    if sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return best_of_incumbents(f"CBC ({scope}): {pulp.LpSolution[sol_status]}")
    values = np.array([v.varValue or 0.0 for v in variables])
    order = {n: list(tail_order.get(n, [])) for n in names}
    for cols in model.vqs:
        a_idx, r_idx = np.nonzero(values[cols.x] > 0.5)
        head = sorted(zip(a_idx.tolist(), r_idx.tolist(), strict=True), key=lambda e: -e[1])
        order[cols.name] = [window[cols.hosted[a]].id for a, _ in head] + order[cols.name]
    total, ok = evaluate(order, groups, queues, settings.tail_aware)
    if warm_ok and (not ok or warm_total < total - 1e-6):
        return best_of_incumbents(f"heuristic plan better than the {scope} MILP incumbent")
    proven = sol_status == pulp.LpSolutionOptimal
    if proven:
        status: PlanStatus = "optimal" if joint else "window-optimal"
    elif warm_ok and total >= warm_total - 1e-6:
        status = "heuristic"  # CBC's incumbent is the MIP start: it found nothing better in time
    else:
        status = "feasible"
    note = f"CBC {scope}: {pulp.LpSolution[sol_status]}"
    return Plan(order, status, total, time.perf_counter() - started, [note], phases)


def _window(
    order: Mapping[str, Sequence[int]],
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    settings: SolverSettings,
) -> tuple[list[GroupSpec], dict[str, list[int]], dict[str, _Tail]]:
    """Split ``order`` into a window of ``window_groups`` groups (those that miss their SLO in
    ``order``, tightest slack first, then those that start first) and the fixed tail of each VQ
    (the rest, in ``order``): the window's groups, the tail orders and their summaries."""
    by_id = {g.id: g for g in groups}
    entries, late = [], []
    for q in queues:
        ids = list(order.get(q.name, []))
        starts = start_times([_queued(by_id[i], q.name) for i in ids], q.loaded_model, q.residual, q.swap_s)
        for pos, (gid, start) in enumerate(zip(ids, starts, strict=True)):
            entries.append((start, pos, q.name, gid))
            g = by_id[gid]
            if start + (g.costs[q.name].slo_span if settings.tail_aware else 0.0) > g.slack + 1e-6:
                late.append((g.slack, -g.priority, gid))
    head = [gid for *_, gid in sorted(late)[: settings.window_groups]]
    chosen = set(head)
    for *_, gid in sorted(entries):
        if len(head) >= settings.window_groups:
            break
        if gid not in chosen:
            head.append(gid)
            chosen.add(gid)
    tail_order: dict[str, list[int]] = {}
    tails: dict[str, _Tail] = {}
    for q in queues:
        rest = [gid for gid in order.get(q.name, []) if gid not in chosen]
        if not rest:
            continue
        seq = [_queued(by_id[i], q.name) for i in rest]
        offsets = start_times(seq, seq[0].model, 0.0, q.swap_s)  # from the tail's first start
        latest = min(
            g.slack - (g.costs.slo_span if settings.tail_aware else 0.0) - off
            for g, off in zip(seq, offsets, strict=True)
        )
        tail_order[q.name] = rest
        tails[q.name] = _Tail(len(rest), seq[0].model, latest)
    return [g for g in groups if g.id in chosen], tail_order, tails


def _binaries(groups: Sequence[GroupSpec], queues: Sequence[QueueSpec], settings: SolverSettings) -> int:
    """Number of x[g, q, r] binaries of the joint model (what ``_build`` would create)."""
    cap = math.ceil(settings.slots_factor * len(groups) / len(queues)) + 2
    total = 0
    for q in queues:
        hosted = sum(1 for g in groups if q.name in g.costs and g.pinned in (None, q.name))
        total += hosted * min(hosted, cap)
    return total


def _fallback(
    groups: Sequence[GroupSpec],
    queues: Sequence[QueueSpec],
    status: PlanStatus,
    started: float,
    note: str,
    settings: SolverSettings,
    warm: Plan,
) -> Plan:
    """The plan when no order meets every SLO: EDF, or the heuristic plan ``warm`` under
    ``settings.fallback`` (``SolverSettings``)."""
    plan = edf_plan(groups, queues, status)
    plan.notes.append(note)
    if settings.fallback == "fewest-late":
        edf_wait, edf_late = _wait_and_late(plan.order, groups, queues, settings.tail_aware)
        warm_wait, warm_late = _wait_and_late(warm.order, groups, queues, settings.tail_aware)
        if (warm_late, warm_wait) < (edf_late, edf_wait):
            plan = Plan(order=warm.order, status=status, notes=plan.notes)
            plan.notes.append(f"heuristic order: {warm_late} groups late where EDF leaves {edf_late}")
    plan.solve_s = time.perf_counter() - started
    return plan
