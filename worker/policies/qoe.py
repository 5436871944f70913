"""Andes: QoE-aware, token-level preemptive scheduling (elis_andes_spec §B.5-B.7; paper §4).

At each scheduling quantum (every ``quantum_iterations`` decode iterations) the
policy checks its trigger: KV use above ``kv_watermark`` (memory-bound) or the
current batch generating slower than the most stringent reader needs
(compute-bound), with someone waiting. Untriggered it behaves like vLLM's FCFS.
Triggered it

1. estimates each ongoing request's QoE gain ``q_i(B) = Q_serve,i(B) - Q_wait,i``
   over the horizon ``horizon_s`` for every batch size B in ``[B_min, B_max]``
   (``tessera.worker.core.qoe.gains``, closed form, vectorised over requests and B);
2. packs requests greedily by gain per unit of KV (Alg. 1; ``solver="greedy"``),
   keeping the B with the largest total gain (ties: fewer preemptions, larger B);
   ``solver="lqsf"`` packs by gain alone (the LQSF baseline), ``solver="dp"``
   solves each B exactly with the 3-D dynamic program (App. C; small cases only);
3. refines the decision against preemption/admission overhead (§4.3): admissions
   are taken in priority order, each evicting the fewest lowest-priority running
   requests that make room, and kept only while the admitted gain exceeds the QoE
   the stall costs the requests that keep running.

Every CHOICE of the spec is a constructor setting with the spec's default.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from tessera.worker.core.policy import Decision, InstanceView, Policy, PreemptMode
from tessera.worker.core.profile import StepProfile
from tessera.worker.core.qoe import ConsumptionTracker, QoEParams, gains, qoe_params
from tessera.worker.core.request import Request

Solver = Literal["greedy", "lqsf", "dp"]
Preemption = Literal["fastest", "recompute", "swap"]
KvUnits = Literal["tokens", "blocks"]
UntriggeredOrder = Literal["fcfs", "priority"]

TIE_EPS = 1e-9  # objectives this close count as equal (spec §B.6)


# ---- packing (pure array functions) -------------------------------------------------------------


def greedy_pack(priority: np.ndarray, weight: np.ndarray, capacity: float, batch: int) -> np.ndarray:
    """Algorithm 1 for one batch size: take items by descending priority (stable: earlier index
    wins ties) while memory and the batch size allow, stopping at the first misfit.
    Returns the indices taken, in order."""
    order = np.argsort(-priority, kind="stable")
    fits = (np.cumsum(weight[order]) <= capacity) & (np.arange(order.size) < batch)
    count = order.size if fits.all() else int(np.argmin(fits))
    return order[:count]


def exact_pack(value: np.ndarray, weight: np.ndarray, capacity: int, batch: int) -> tuple[float, np.ndarray]:
    """Exact knapsack with exactly ``batch`` items (App. C, Alg. 2): ``dp[i][b][m]`` over items,
    item counts and integer memory. O(N·B·M); for small cases (comparison and tests).
    Returns (best value, indices taken); (-inf, empty) when no set of ``batch`` items fits."""
    n = value.size
    w = np.asarray(weight, dtype=int)
    dp = np.full((batch + 1, capacity + 1), -np.inf)
    dp[0, 0] = 0.0
    took = np.zeros((n, batch + 1, capacity + 1), dtype=bool)
    for i in range(n):
        if w[i] > capacity:
            continue
        cand = np.full_like(dp, -np.inf)
        cand[1:, w[i] :] = dp[:-1, : capacity + 1 - w[i]] + value[i]
        better = cand > dp
        took[i] = better
        dp = np.where(better, cand, dp)
    m = int(np.argmax(dp[batch]))
    best = float(dp[batch, m])
    if best == -np.inf:
        return best, np.empty(0, dtype=int)
    chosen, b = [], batch
    for i in range(n - 1, -1, -1):
        if took[i, b, m]:
            chosen.append(i)
            b, m = b - 1, m - w[i]
    return best, np.array(chosen[::-1], dtype=int)


# ---- the policy ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Ongoing:
    """Arrays over the ongoing requests of one decision, in tie-break order (running, then arrival)."""

    reqs: list[Request]
    running: np.ndarray  # bool
    weight: np.ndarray  # l_i in KV tokens
    context: np.ndarray  # P + n (tokens to re-prefill or swap)
    ideal_start: np.ndarray
    speed: np.ndarray
    delivered: np.ndarray
    last_consumption: np.ndarray
    resume_cost: np.ndarray  # s to (re)start each request: prefill, swap-in, or 0 if resident


class AndesQoE(Policy):
    """Andes' QoE-gain knapsack scheduler with batch-size search, refiner and selective trigger."""

    name: ClassVar[str] = "qoe"

    def __init__(
        self,
        horizon_s: float = 10.0,
        kv_watermark: float = 0.9,
        quantum_iterations: int = 10,
        solver: Solver = "greedy",
        refiner: bool = True,
        refiner_cumulative: bool = True,
        refiner_count_victim_gain: bool = False,
        gain_includes_prefill: bool = False,
        preemption: Preemption = "fastest",
        kv_units: KvUnits = "blocks",
        kv_reserve: float = 0.01,
        batch_grid_span: int = 64,
        batch_grid_points: int = 32,
        untriggered_order: UntriggeredOrder = "fcfs",
        trigger_needs_waiting: bool = True,
    ) -> None:
        """Settings (spec CHOICEs, defaults as the spec proposes):

        - ``horizon_s``: Δt of the gain estimate (§B.5; 10 s).
        - ``kv_watermark``: memory-bound trigger, fraction of KV in use (§B.6; 0.9).
        - ``quantum_iterations``: decode iterations between decisions (§B.12 #4; 10).
        - ``solver``: ``greedy`` (Alg. 1), ``lqsf`` (priority = gain, the LQSF baseline), ``dp`` (exact).
        - ``refiner``: apply the overhead-aware refiner (§B.7); ``refiner_cumulative`` charges each
          admission the loss on top of the overhead already accepted; ``refiner_count_victim_gain``
          also subtracts the victims' gains.
        - ``gain_includes_prefill``: delay a non-resident request's first new token by its restart cost.
        - ``preemption``: ``fastest`` of recompute and swap by profile (§B.12 #16), or one of them.
        - ``kv_units``: the knapsack weight ``l_i``: ``tokens`` ``P + n + 1``, or ``blocks`` (whole KV
          blocks, REF-CODE). Default ``blocks``: the spec requires l to match M, and the engines
          account KV (and so M) in whole blocks.
        - ``kv_reserve``: fraction of KV left out of M, vLLM's 1% admission watermark.
        - ``batch_grid_span``/``batch_grid_points``: above this B range, search a geometric grid.
        - ``untriggered_order``: ``fcfs`` (spec) or ``priority`` (REF-CODE: waiting by q/l).
        - ``trigger_needs_waiting``: trigger only with someone waiting (§B.6 CHOICE).
        """
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 seconds, got {horizon_s}")
        if not 0 < kv_watermark <= 1:
            raise ValueError(f"kv_watermark must be in (0, 1], got {kv_watermark}")
        if quantum_iterations < 1:
            raise ValueError(f"quantum_iterations must be >= 1, got {quantum_iterations}")
        _check_choice("solver", solver, ("greedy", "lqsf", "dp"))
        _check_choice("preemption", preemption, ("fastest", "recompute", "swap"))
        _check_choice("kv_units", kv_units, ("tokens", "blocks"))
        _check_choice("untriggered_order", untriggered_order, ("fcfs", "priority"))
        if not 0 <= kv_reserve < 1:
            raise ValueError(f"kv_reserve must be in [0, 1), got {kv_reserve}")
        if batch_grid_span < 1 or batch_grid_points < 2:
            raise ValueError("batch_grid_span must be >= 1 and batch_grid_points >= 2")
        self.horizon_s = float(horizon_s)
        self.kv_watermark = float(kv_watermark)
        self.quantum_iterations = int(quantum_iterations)
        self.solver: Solver = solver
        self.refiner = bool(refiner)
        self.refiner_cumulative = bool(refiner_cumulative)
        self.refiner_count_victim_gain = bool(refiner_count_victim_gain)
        self.gain_includes_prefill = bool(gain_includes_prefill)
        self.preemption: Preemption = preemption
        self.kv_units: KvUnits = kv_units
        self.kv_reserve = float(kv_reserve)
        self.batch_grid_span = int(batch_grid_span)
        self.batch_grid_points = int(batch_grid_points)
        self.untriggered_order: UntriggeredOrder = untriggered_order
        self.trigger_needs_waiting = bool(trigger_needs_waiting)
        self._reqs: dict[int, Request] = {}
        self._params: dict[int, QoEParams] = {}
        self._trackers: dict[int, ConsumptionTracker] = {}
        self.decisions = 0  # schedule calls
        self.solves = 0  # triggered decisions (solver runs)

    # ---- queue bookkeeping -------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Track a new request."""
        params = qoe_params(req)
        self._reqs[id(req)] = req
        self._params[id(req)] = params
        self._trackers[id(req)] = ConsumptionTracker(params.reading_speed_tps)

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._reqs.pop(id(req), None)
        self._params.pop(id(req), None)
        self._trackers.pop(id(req), None)

    def __len__(self) -> int:
        return len(self._reqs)

    # ---- decisions ---------------------------------------------------------------------------
    def schedule(self, view: InstanceView) -> Decision:
        """Untriggered: FCFS. Triggered: greedy QoE-gain packing over B, then the refiner."""
        self.decisions += 1
        running = [r for r in view.running if id(r) in self._reqs]
        running_ids = {id(r) for r in running}
        waiting = [r for r in self._reqs.values() if id(r) not in running_ids and not r.finished]
        if not self._triggered(view, running, waiting):
            return self._fcfs(view, running, waiting)
        self.solves += 1
        return self._solve(view, running, waiting)

    def _tgl(self, profile: StepProfile, batch: np.ndarray | int, mean_context: float) -> np.ndarray:
        """TGL(B): decode step time at batch B; the batch's context is taken as B·mean context
        (App. B: B and context are almost perfectly correlated)."""
        b = np.asarray(batch, dtype=float)
        return profile.decode_c0 + profile.decode_c1 * b + profile.decode_c2 * b * mean_context

    def _triggered(self, view: InstanceView, running: Sequence[Request], waiting: Sequence[Request]) -> bool:
        if self.trigger_needs_waiting and not waiting:
            return False
        if view.kv_used_tokens > self.kv_watermark * view.kv_capacity_tokens:
            return True
        if not running:
            return False
        fastest_reader = max(self._params[id(r)].reading_speed_tps for r in (*running, *waiting))
        context = sum(r.prompt_tokens + r.generated for r in running)
        return view.profile.decode_step(len(running), context) > 1.0 / fastest_reader

    def _fcfs(self, view: InstanceView, running: list[Request], waiting: list[Request]) -> Decision:
        """vLLM's order: running keep their slots; swapped-out requests resume first, then arrivals."""
        slots = max(0, view.max_batch - len(running))
        if self.untriggered_order == "priority" and waiting and slots:
            return self._solve(view, running, waiting, admit_only=True)
        head = heapq.nsmallest(slots, waiting, key=lambda r: (not r.swapped, r.arrival)) if slots else []
        run = sorted(running, key=lambda r: r.arrival) + head
        return Decision(run=run, recheck_after_tokens=self.quantum_iterations)

    def _arrays(self, view: InstanceView, running: list[Request], waiting: list[Request]) -> _Ongoing:
        reqs = sorted(running, key=lambda r: r.arrival) + sorted(waiting, key=lambda r: r.arrival)
        prof = view.profile
        block = prof.block_size
        n_req = len(reqs)
        context = np.fromiter((r.prompt_tokens + r.generated for r in reqs), dtype=float, count=n_req)
        # blocks: what the engine holds for the request's next step
        weight = (np.floor(context / block) + 1.0) * block if self.kv_units == "blocks" else context + 1.0
        trackers = self._trackers
        for r in reqs:
            tracker = trackers[id(r)]
            if r.generated != tracker.tokens:  # new tokens since the last look (engines keep both equal)
                tracker.update(r.tokens)
        params = [self._params[id(r)] for r in reqs]
        ideal = np.fromiter((p.ideal_start for p in params), dtype=float, count=n_req)
        speed = np.fromiter((p.reading_speed_tps for p in params), dtype=float, count=n_req)
        delivered = np.fromiter((trackers[id(r)].tokens for r in reqs), dtype=float, count=n_req)
        last = np.fromiter((trackers[id(r)].last_consumption for r in reqs), dtype=float, count=n_req)
        resident = np.fromiter((r.kv_resident for r in reqs), dtype=bool, count=n_req)
        swapped = np.fromiter((r.swapped for r in reqs), dtype=bool, count=n_req)
        prefill = prof.prefill_p0 + prof.prefill_p1 * context
        resume = np.where(resident, 0.0, np.where(swapped, prof.kv_swap_time(1) * context, prefill))
        is_running = np.zeros(n_req, dtype=bool)
        is_running[: len(running)] = True
        return _Ongoing(reqs, is_running, weight, context, ideal, speed, delivered, last, resume)

    def _batch_sizes(
        self, view: InstanceView, st: _Ongoing, memory: float, mean_context: float
    ) -> np.ndarray:
        """Candidate B in [B_min, B_max] (§B.6 pruning)."""
        fit = int(np.searchsorted(np.cumsum(np.sort(st.weight)), memory, side="right"))
        b_max = max(1, min(fit, view.max_batch))
        slope = view.profile.decode_c1 + view.profile.decode_c2 * mean_context
        budget = 1.0 / float(st.speed.max()) - view.profile.decode_c0
        b_min = b_max if slope <= 0 else math.floor(budget / slope)
        b_min = min(max(b_min, 1), b_max)
        if b_max - b_min <= self.batch_grid_span:
            return np.arange(b_min, b_max + 1)
        grid = np.round(np.geomspace(b_min, b_max, self.batch_grid_points)).astype(int)
        return np.unique(np.concatenate([grid, [b_min, b_max]]))

    def _solve(
        self, view: InstanceView, running: list[Request], waiting: list[Request], admit_only: bool = False
    ) -> Decision:
        now = view.now
        st = self._arrays(view, running, waiting)
        memory = view.kv_capacity_tokens * (1.0 - self.kv_reserve)
        basis = st.context[st.running] if st.running.any() else st.context
        mean_context = float(basis.mean())
        sizes = self._batch_sizes(view, st, memory, mean_context)
        step = self._tgl(view.profile, sizes, mean_context)
        delay = np.where(st.running, 0.0, st.resume_cost) if self.gain_includes_prefill else 0.0
        q = gains(now, self.horizon_s, step[:, None], st.ideal_start, st.speed, st.delivered,
                  st.last_consumption, delay)  # fmt: skip
        priority = q if self.solver == "lqsf" else q / st.weight
        row, chosen = self._pack(q, priority, st, memory, sizes)
        batch, g = int(sizes[row]), float(step[row])
        if admit_only:  # REF-CODE untriggered variant: fill free slots by priority, preempt nobody
            order = [i for i in np.argsort(-priority[row], kind="stable") if not st.running[i]]
            slots = max(0, view.max_batch - len(running))
            run = sorted(running, key=lambda r: r.arrival) + [st.reqs[i] for i in order[:slots]]
            return Decision(run=run, recheck_after_tokens=self.quantum_iterations)
        mode = self._preempt_mode(view.profile, st)
        if self.refiner:
            admit, preempt = self._refine(
                now, st, q[row], priority[row], chosen, memory, batch, g, mode, view
            )
        else:
            admit = [i for i in chosen if not st.running[i]]
            taken = set(chosen.tolist())
            preempt = [i for i in np.flatnonzero(st.running) if i not in taken]
        gone = set(preempt)
        keep = [i for i in np.flatnonzero(st.running) if i not in gone]
        members = sorted(keep + list(admit), key=lambda i: -priority[row][i])
        return Decision(
            run=[st.reqs[i] for i in members],
            preempt_mode=mode if preempt else None,
            recheck_after_tokens=self.quantum_iterations,
        )

    def _pack(
        self, q: np.ndarray, priority: np.ndarray, st: _Ongoing, memory: float, sizes: np.ndarray
    ) -> tuple[int, np.ndarray]:
        """Best batch-size row and the request indices it serves (ties: fewer preemptions, larger B)."""
        n_running = int(st.running.sum())
        best: tuple[float, int, int] | None = None
        best_row, best_sel = 0, np.empty(0, dtype=int)
        for row, batch in enumerate(sizes):
            if self.solver == "dp":
                value, sel = exact_pack(q[row], st.weight, int(memory), int(batch))
                if value == -np.inf:
                    continue
            else:
                sel = greedy_pack(priority[row], st.weight, memory, int(batch))
                value = float(q[row, sel].sum())
            preemptions = n_running - int(st.running[sel].sum())
            if (
                best is None
                or value > best[0] + TIE_EPS
                or (abs(value - best[0]) <= TIE_EPS and (preemptions, -batch) < (best[1], -best[2]))
            ):
                best = (value, preemptions, int(batch))
                best_row, best_sel = row, sel
        return best_row, best_sel

    def _preempt_mode(self, profile: StepProfile, st: _Ongoing) -> PreemptMode:
        """The cheaper of recompute (re-prefill on resume) and swap (out and in) for the running set."""
        if self.preemption != "fastest":
            return self.preemption
        ctx = st.context[st.running]
        if ctx.size == 0:
            return "recompute"
        recompute = float(sum(profile.prefill(int(c)) for c in ctx))
        swap = 2.0 * profile.kv_swap_time(int(ctx.sum()))
        return "swap" if swap < recompute else "recompute"

    def _refine(
        self,
        now: float,
        st: _Ongoing,
        q: np.ndarray,
        priority: np.ndarray,
        chosen: np.ndarray,
        memory: float,
        batch: int,
        g: float,
        mode: PreemptMode,
        view: InstanceView,
    ) -> tuple[list[int], list[int]]:
        """Overhead-aware refiner (§B.7): keep admissions while their gain beats the stall's loss.

        "Making room" covers both KV and the chosen batch size B* (the greedy solution fits
        both); the paper names only memory, but without the slot condition a compute-bound
        decision could admit past B*.
        """
        selected = np.zeros(len(st.reqs), dtype=bool)
        selected[chosen] = True
        admit = sorted(np.flatnonzero(selected & ~st.running), key=lambda i: -priority[i])
        pool = sorted(np.flatnonzero(~selected & st.running), key=lambda i: (priority[i], -i))
        free = memory - float(st.weight[st.running].sum())
        ongoing = st.running.copy()
        size = int(ongoing.sum())
        spent = 0.0  # overhead accepted so far (s)
        final_admit: list[int] = []
        final_preempt: list[int] = []
        for a in admit:
            victims: list[int] = []
            while (free < st.weight[a] or size - len(victims) + 1 > batch) and pool:
                v = pool.pop(0)
                victims.append(v)
                free += float(st.weight[v])
            if free < st.weight[a] or size - len(victims) + 1 > batch:
                break  # no room even after evicting every candidate: nothing more can be admitted
            cost = float(st.resume_cost[a]) + sum(
                self._preempt_cost(view.profile, st, v, mode) for v in victims
            )
            keep = ongoing.copy()
            keep[victims] = False
            loss = self._stall_loss(now, st, keep, spent, cost, g)
            if self.refiner_count_victim_gain:
                loss += float(q[victims].sum())
            if q[a] - loss > 0:
                final_admit.append(a)
                final_preempt.extend(victims)
                free -= float(st.weight[a])
                ongoing = keep
                ongoing[a] = True
                size = size - len(victims) + 1
                spent += cost
            else:
                break  # the system tolerates no more overhead: cancel the remaining decisions
        return final_admit, final_preempt

    @staticmethod
    def _preempt_cost(profile: StepProfile, st: _Ongoing, v: int, mode: PreemptMode) -> float:
        return profile.kv_swap_time(int(st.context[v])) if mode == "swap" else 0.0

    def _stall_loss(
        self, now: float, st: _Ongoing, keep: np.ndarray, spent: float, cost: float, g: float
    ) -> float:
        """QoE the ongoing requests lose to a stall of ``cost`` s: ``L_j(x)``, the gain of serving j
        for ``x`` s (0 when its pacer buffer covers the stall), summed."""
        if not keep.any() or cost <= 0:
            return 0.0
        args = (st.ideal_start[keep], st.speed[keep], st.delivered[keep], st.last_consumption[keep])
        after = gains(now, spent + cost, g, *args) if self.refiner_cumulative else gains(now, cost, g, *args)
        if not self.refiner_cumulative or spent <= 0:
            return float(after.sum())
        before = gains(now, spent, g, *args)
        return float(np.maximum(after - before, 0.0).sum())


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
