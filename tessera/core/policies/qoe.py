"""Andes: QoE-aware, token-level preemptive scheduling (Andes §4; docs/papers.md, "Andes").

At each scheduling quantum (every ``quantum_iterations`` decode iterations) the
policy checks its trigger: KV use above ``kv_watermark`` (memory-bound) or the
current batch generating slower than the most stringent reader needs
(compute-bound), with someone waiting. Untriggered it behaves like vLLM's FCFS.
Triggered it

1. estimates each ongoing request's QoE gain ``q_i(B) = Q_serve,i(B) - Q_wait,i``
   over the horizon ``horizon_s`` for every batch size B in ``[B_min, B_max]``
   (``tessera.core.qoe.gains``, closed form, vectorised over requests and B);
2. packs requests greedily by gain per unit of KV (Alg. 1; ``solver="greedy"``),
   keeping the B with the largest total gain (ties: fewer preemptions, larger B);
   ``solver="lqsf"`` packs by gain alone (the LQSF baseline), ``solver="dp"``
   solves each B exactly with the 3-D dynamic program (App. C; small cases only);
3. refines the decision against preemption/admission overhead (§4.3): admissions
   are taken in priority order, each evicting the fewest lowest-priority running
   requests that make room, and kept only while the admitted gain exceeds the QoE
   the stall costs the requests that keep running.

Every choice where the paper is silent is a constructor setting (docs/papers.md names the defaults).

Class priority (``ServiceClass.priority``, higher first) only breaks ties, never outweighs a gain:
untriggered, among equal arrival times (FCFS); triggered, the requests are lined up running first,
then waiting, each by class priority then arrival, and every stable sort of the greedy solver keeps that
order among equal gains per KV (gains, for ``lqsf``). So among equal-gain items the knapsack takes
the higher class first and drops the lower one, and the refiner evicts, among running requests of
equal gain per KV, the lower class first (then the later arrival).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field

from tessera.core.policy import Decision, InstanceView, Policy, PreemptMode
from tessera.core.profile import StepProfile
from tessera.core.qoe import ConsumptionTracker, QoEParams, gains, qoe_params
from tessera.core.registry import PolicySettings
from tessera.core.request import Request

Solver = Literal["greedy", "lqsf", "dp"]
Preemption = Literal["fastest", "recompute", "swap"]
KvUnits = Literal["tokens", "blocks"]
UntriggeredOrder = Literal["fcfs", "priority"]
TriggerLatency = Literal["observed", "profile"]
PreemptionCap = Literal["none", "refcode"]

# Andes' reference code's flat preemption overhead per context token: 3/90000 s.
REFCODE_UNIT_OVERHEAD_S = 3.0 / 90000.0

TIE_EPS = 1e-9  # objectives this close count as equal (CHOICE)


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


# ---- per-request state kept between decisions ----------------------------------------------------

_FLOAT_COLUMNS = (
    "arrival",
    "class_priority",
    "ideal_start",
    "speed",
    "prompt",
    "delivered",
    "last_consumption",
)
_BOOL_COLUMNS = ("resident", "swapped", "active")


class _Table:
    """Per-request QoE state as arrays indexed by slot, kept between decisions.

    A request's engine state (tokens, KV residence) changes only while it runs, or when it is
    admitted or preempted, so a decision refreshes only the requests running now, those running
    at the previous decision and those that decision proposed to run; waiting requests keep their
    rows. A decision costs O(running) Python work plus O(N) array work.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.reqs: list[Request | None] = [None] * capacity
        self.trackers: list[ConsumptionTracker | None] = [None] * capacity
        self.slot: dict[int, int] = {}  # id(request) -> row
        self.size = 0  # rows ever used; rows at or past it are empty
        self._free: list[int] = []
        self.arrival = np.zeros(capacity)
        self.class_priority = np.zeros(capacity)  # ServiceClass.priority: ties of the gain order
        self.ideal_start = np.zeros(capacity)
        self.speed = np.ones(capacity)
        self.prompt = np.zeros(capacity)
        self.delivered = np.zeros(capacity)
        self.last_consumption = np.full(capacity, -np.inf)
        self.resident = np.zeros(capacity, dtype=bool)
        self.swapped = np.zeros(capacity, dtype=bool)
        self.active = np.zeros(capacity, dtype=bool)

    def add(self, req: Request, params: QoEParams) -> None:
        """Give ``req`` a row."""
        if id(req) in self.slot:
            return
        if self._free:
            s = self._free.pop()
        else:
            if self.size == len(self.reqs):
                self._grow()
            s = self.size
            self.size += 1
        self.slot[id(req)] = s
        self.reqs[s] = req
        self.trackers[s] = ConsumptionTracker(params.reading_speed_tps)
        self.arrival[s] = req.arrival
        self.class_priority[s] = req.service_class.priority
        self.ideal_start[s] = params.ideal_start
        self.speed[s] = params.reading_speed_tps
        self.prompt[s] = req.prompt_tokens
        self.delivered[s] = 0.0
        self.last_consumption[s] = -np.inf
        self.active[s] = True
        self.refresh((req,))

    def remove(self, req: Request) -> None:
        """Free ``req``'s row."""
        s = self.slot.pop(id(req), None)
        if s is None:
            return
        self.reqs[s] = None
        self.trackers[s] = None
        self.active[s] = False
        self._free.append(s)

    def refresh(self, reqs: Iterable[Request]) -> None:
        """Read these requests' rows again (tokens delivered, consumption, KV residence); requests
        without a row are skipped."""
        rows, delivered, last, resident, swapped = [], [], [], [], []
        slot, trackers = self.slot, self.trackers
        for req in reqs:
            s = slot.get(id(req))
            if s is None:
                continue
            tracker = trackers[s]
            assert tracker is not None
            if req.generated != tracker.tokens:
                tracker.update(req.tokens)
            rows.append(s)
            delivered.append(tracker.tokens)
            last.append(tracker.last_consumption)
            resident.append(req.kv_resident)
            swapped.append(req.swapped)
        self.delivered[rows] = delivered
        self.last_consumption[rows] = last
        self.resident[rows] = resident
        self.swapped[rows] = swapped

    def _grow(self) -> None:
        old = len(self.reqs)
        self.reqs.extend([None] * old)
        self.trackers.extend([None] * old)
        for name in (*_FLOAT_COLUMNS, *_BOOL_COLUMNS):
            column = getattr(self, name)
            grown = np.zeros(2 * old, dtype=column.dtype)
            grown[:old] = column
            setattr(self, name, grown)


@dataclass(slots=True)
class _Ongoing:
    """Arrays over the ongoing requests of one decision, in tie-break order (running, then
    waiting; each by class priority, higher first, then arrival)."""

    rows: np.ndarray  # table rows
    running: np.ndarray  # bool
    weight: np.ndarray  # l_i in KV tokens
    context: np.ndarray  # P + n (tokens to re-prefill or swap)
    ideal_start: np.ndarray
    speed: np.ndarray
    delivered: np.ndarray
    last_consumption: np.ndarray
    resident: np.ndarray  # bool: KV on the instance
    swapped: np.ndarray  # bool: KV in host memory
    resume_cost: np.ndarray  # s to (re)start each request: prefill, swap-in, or 0 if resident

    def qoe_arrays(self, idx: np.ndarray | slice) -> tuple[np.ndarray, ...]:
        """The per-request arguments of ``gains`` for the requests ``idx``."""
        return self.ideal_start[idx], self.speed[idx], self.delivered[idx], self.last_consumption[idx]


@dataclass(slots=True)
class _Step:
    """One admission the refiner considers: the request, the running requests evicted to make
    room for it, the stall both cause (s), and the engine time the evictions waste (s: the
    victims' re-prefill, or their KV moved out and back in)."""

    admit: int
    victims: list[int]
    cost: float
    waste: float = 0.0


# ---- the policy ---------------------------------------------------------------------------------


class QoESettings(PolicySettings):
    """Settings of ``qoe``. The solver variants, refiner switches, trigger and cap choices and the batch
    grid are research ablations: constructor keywords the andes bench sets (``--set qoe.NAME=VALUE``)."""

    horizon_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=10.0, description="Horizon of the QoE gain estimate in seconds (Andes' Δt)."
    )
    kv_watermark: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.9, description="Fraction of the KV cache in use above which the solver runs (memory-bound)."
    )
    quantum_iterations: Annotated[int, Field(ge=1)] = Field(
        default=10, description="Decode iterations between scheduling decisions."
    )
    preemption: Preemption = Field(
        default="fastest",
        description="How to preempt: fastest of recompute and swap by profile, or one of them.",
    )
    kv_reserve: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.01,
        description="Fraction of the KV cache left out of the knapsack (vLLM's admission watermark).",
    )
    observe_window_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=2.0,
        description="Window in seconds over which the token latency the running requests get is measured.",
    )


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
        refiner_waste_loss: bool = True,
        gain_includes_prefill: bool = False,
        preemption: Preemption = "fastest",
        kv_units: KvUnits = "blocks",
        kv_reserve: float = 0.01,
        batch_grid_span: int = 64,
        batch_grid_points: int = 32,
        untriggered_order: UntriggeredOrder = "fcfs",
        trigger_needs_waiting: bool = True,
        trigger_latency: TriggerLatency = "observed",
        observe_window_s: float = 2.0,
        preemption_cap: PreemptionCap = "refcode",
    ) -> None:
        """Settings (our choices where Andes is silent; docs/papers.md, "Andes"):

        - ``horizon_s``: Δt of the gain estimate (§4.1 gives none; 10 s).
        - ``kv_watermark``: memory-bound trigger, fraction of KV in use (§4.2's example; 0.9).
        - ``quantum_iterations``: decode iterations between decisions (as the reference code; 10).
        - ``solver``: ``greedy`` (Alg. 1), ``lqsf`` (priority = gain, the LQSF baseline), ``dp`` (exact).
        - ``refiner``: apply the overhead-aware refiner (§4.3); ``refiner_cumulative`` charges each
          admission the loss on top of the overhead already accepted; ``refiner_count_victim_gain``
          also subtracts the victims' gains. ``refiner_waste_loss`` (a correction, on by
          default) also charges each admission the QoE the *waiting* requests lose because its
          preemptions add engine work (the victims' re-prefill, or their KV swapped out and in)
          that delays everyone queued: the paper sums the loss over all ongoing requests, which
          it defines as waiting and running (§4.1, §4.3); a formalisation over running requests keeps
          only the running ones, so a stall looked free whenever they all had buffers.
        - ``gain_includes_prefill``: delay a non-resident request's first new token by its restart cost.
        - ``preemption``: ``fastest`` of recompute and swap by profile (§4.3), or one of them.
          Swap is priced only while the instance's free swap space holds the victim; past that the
          engine recomputes, and so does the price (no stall now, a prefill on resume).
        - ``kv_units``: the knapsack weight ``l_i``: ``tokens`` ``P + n + 1``, or ``blocks`` (whole KV
          blocks, as the reference code). Default ``blocks``: l must match M, and the engines
          account KV (and so M) in whole blocks.
        - ``kv_reserve``: fraction of KV left out of M, vLLM's 1% admission watermark.
        - ``batch_grid_span``/``batch_grid_points``: above this B range, search a geometric grid.
        - ``untriggered_order``: ``fcfs`` (the paper) or ``priority`` (the reference code: waiting by q/l).
        - ``trigger_needs_waiting``: trigger only with someone waiting (CHOICE).
        - ``trigger_latency``: what the compute-bound trigger compares with ``1/max r``: ``observed``
          (paper §4.2: Andes "monitors token generation latency": the time per token the running
          requests actually got over the last ``observe_window_s``, prefill stalls included) or
          ``profile`` (``TGL(B_cur)`` from the step profile, which misses stalls).
        - ``preemption_cap``: ``refcode`` caps the preemptions of one decision at
          ``floor(slack_p10 / (3/90000 s · mean context))`` (the reference code's frequency control; none
          when the 10th-percentile slack ``T* + n/r - (t - arrival)`` is below one preemption's
          overhead), or ``none`` (the paper has no cap). Default ``refcode``. The
          waste charge (``refiner_waste_loss``) cuts the thrash without a cap (bursty, seed 0, rate
          2.125: 1,805 preemptions and avg QoE 0.645 before it, 727 and 0.707 with it) but does not
          end it: gains assume tokens every ``TGL(B)``, while in a surge this engine spends ~90% of
          its time prefilling, so freeing KV for newcomers (whose prefills are not waste) starves
          every stream's decoding. With the cap: 0-1 preemptions, avg QoE 0.86-0.88 (``tessera
          bench andes --set workload=bursty`` against ``--set qoe.preemption_cap=none``).
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
        _check_choice("trigger_latency", trigger_latency, ("observed", "profile"))
        _check_choice("preemption_cap", preemption_cap, ("none", "refcode"))
        if not 0 <= kv_reserve < 1:
            raise ValueError(f"kv_reserve must be in [0, 1), got {kv_reserve}")
        if batch_grid_span < 1 or batch_grid_points < 2:
            raise ValueError("batch_grid_span must be >= 1 and batch_grid_points >= 2")
        if not observe_window_s > 0:
            raise ValueError(f"observe_window_s must be > 0 seconds, got {observe_window_s}")
        self.horizon_s = float(horizon_s)
        self.kv_watermark = float(kv_watermark)
        self.quantum_iterations = int(quantum_iterations)
        self.solver: Solver = solver
        self.refiner = bool(refiner)
        self.refiner_cumulative = bool(refiner_cumulative)
        self.refiner_count_victim_gain = bool(refiner_count_victim_gain)
        self.refiner_waste_loss = bool(refiner_waste_loss)
        self.gain_includes_prefill = bool(gain_includes_prefill)
        self.preemption: Preemption = preemption
        self.kv_units: KvUnits = kv_units
        self.kv_reserve = float(kv_reserve)
        self.batch_grid_span = int(batch_grid_span)
        self.batch_grid_points = int(batch_grid_points)
        self.untriggered_order: UntriggeredOrder = untriggered_order
        self.trigger_needs_waiting = bool(trigger_needs_waiting)
        self.trigger_latency: TriggerLatency = trigger_latency
        self.observe_window_s = float(observe_window_s)
        self.preemption_cap: PreemptionCap = preemption_cap
        self._table = _Table()
        self._touched: dict[int, Request] = {}  # running or proposed at the last decision
        self._mark: tuple[float, dict[int, tuple[Request, int]]] | None = None  # latency window start
        self.observed_latency_s: float | None = None  # s per token the running requests last got
        self.decisions = 0  # schedule calls
        self.solves = 0  # triggered decisions (solver runs)

    # ---- queue bookkeeping -------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        """Track a new request."""
        self._table.add(req, qoe_params(req))

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._table.remove(req)

    def __len__(self) -> int:
        return len(self._table.slot)

    # ---- decisions ---------------------------------------------------------------------------
    def schedule(self, view: InstanceView) -> Decision:
        """Untriggered: FCFS. Triggered: greedy QoE-gain packing over B, then the refiner."""
        self.decisions += 1
        tab = self._table
        running = [r for r in view.running if id(r) in tab.slot]
        self._touched.update((id(r), r) for r in running)
        tab.refresh(self._touched.values())
        rows = np.fromiter((tab.slot[id(r)] for r in running), dtype=int, count=len(running))
        is_running = np.zeros(tab.size, dtype=bool)
        is_running[rows] = True
        waiting = tab.active[: tab.size] & ~is_running
        self._observe(view.now, running)
        if self._triggered(view, rows, is_running, waiting):
            self.solves += 1
            decision = self._solve(view, self._gather(view, rows, waiting))
        else:
            decision = self._fcfs(view, rows, waiting)
        self._touched = {id(r): r for r in (*running, *decision.run)}
        return decision

    def _observe(self, now: float, running: list[Request]) -> None:
        """Measure the time per token the requests running through the last window got."""
        mark = self._mark
        if mark is not None and now - mark[0] < self.observe_window_s:
            return
        if mark is not None:
            tokens, count = 0, 0
            for r in running:
                seen = mark[1].get(id(r))
                if seen is not None and seen[0] is r:
                    tokens += r.generated - seen[1]
                    count += 1
            if count:
                self.observed_latency_s = (now - mark[0]) * count / tokens if tokens else math.inf
        self._mark = (now, {id(r): (r, r.generated) for r in running})

    def _tgl(self, profile: StepProfile, batch: np.ndarray | int, mean_context: float) -> np.ndarray:
        """TGL(B): decode step time at batch B; the batch's context is taken as B·mean context
        (App. B: B and context are almost perfectly correlated)."""
        b = np.asarray(batch, dtype=float)
        return profile.decode_c0 + profile.decode_c1 * b + profile.decode_c2 * b * mean_context

    def _triggered(
        self, view: InstanceView, rows: np.ndarray, is_running: np.ndarray, waiting: np.ndarray
    ) -> bool:
        if self.trigger_needs_waiting and not waiting.any():
            return False
        if view.kv_used_tokens > self.kv_watermark * view.kv_capacity_tokens:
            return True
        if not rows.size:
            return False
        tab = self._table
        fastest_reader = float(tab.speed[: tab.size][is_running | waiting].max())
        if self.trigger_latency == "observed" and self.observed_latency_s is not None:
            latency = self.observed_latency_s
        else:
            context = int((tab.prompt[rows] + tab.delivered[rows]).sum())
            latency = view.profile.decode_step(int(rows.size), context)
        return latency > 1.0 / fastest_reader

    def _fcfs(self, view: InstanceView, rows: np.ndarray, waiting: np.ndarray) -> Decision:
        """vLLM's order: running keep their slots; swapped-out requests resume first, then arrivals
        (equal arrivals: the higher class first). The queue is proposed only up to the first request
        that cannot start now (KV, prefill budget): the engine stops there anyway."""
        tab = self._table
        run = [tab.reqs[s] for s in rows[np.lexsort((-tab.class_priority[rows], tab.arrival[rows]))]]
        slots = max(0, view.max_batch - rows.size)
        if not slots or not waiting.any():
            return Decision(run=run, recheck_after_tokens=self.quantum_iterations)  # type: ignore[arg-type]
        if self.untriggered_order == "priority":
            return self._solve(view, self._gather(view, rows, waiting), admit_only=True)
        w = np.flatnonzero(waiting)
        head = w[np.lexsort((-tab.class_priority[w], tab.arrival[w], ~tab.swapped[w]))[:slots]]
        need = np.where(tab.resident[head], 0.0, tab.prompt[head] + tab.delivered[head] + 1.0)
        count = int(np.searchsorted(np.cumsum(need), view.kv_free_tokens, side="right")) + 1
        if view.prefill_budget_tokens is not None:
            prefill = np.where(tab.swapped[head] | tab.resident[head], 0.0, need)
            count = min(count, int(np.searchsorted(np.cumsum(prefill), view.prefill_budget_tokens)) + 1)
        run += [tab.reqs[s] for s in head[:count]]
        return Decision(run=run, recheck_after_tokens=self.quantum_iterations)  # type: ignore[arg-type]

    def _gather(self, view: InstanceView, rows: np.ndarray, waiting: np.ndarray) -> _Ongoing:
        """The ongoing requests' arrays, running first, each group by class priority (higher first),
        then arrival."""
        tab = self._table
        r = rows[np.lexsort((tab.arrival[rows], -tab.class_priority[rows]))]
        w = np.flatnonzero(waiting)
        w = w[np.lexsort((tab.arrival[w], -tab.class_priority[w]))]
        idx = np.concatenate([r, w])
        prof = view.profile
        block = prof.block_size
        context = tab.prompt[idx] + tab.delivered[idx]
        # blocks: what the engine holds for the request's next step
        weight = (np.floor(context / block) + 1.0) * block if self.kv_units == "blocks" else context + 1.0
        resident, swapped = tab.resident[idx], tab.swapped[idx]
        prefill = prof.prefill_p0 + prof.prefill_p1 * context
        resume = np.where(resident, 0.0, np.where(swapped, prof.kv_swap_time(1) * context, prefill))
        is_running = np.zeros(idx.size, dtype=bool)
        is_running[: r.size] = True
        return _Ongoing(
            idx, is_running, weight, context, tab.ideal_start[idx], tab.speed[idx], tab.delivered[idx],
            tab.last_consumption[idx], resident, swapped, resume,
        )  # fmt: skip

    def _batch_sizes(
        self, view: InstanceView, st: _Ongoing, memory: float, mean_context: float
    ) -> np.ndarray:
        """Candidate B in [B_min, B_max] (§4.2 pruning)."""
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

    def _solve(self, view: InstanceView, st: _Ongoing, admit_only: bool = False) -> Decision:
        now = view.now
        reqs = self._table.reqs
        memory = view.kv_capacity_tokens * (1.0 - self.kv_reserve)
        basis = st.context[st.running] if st.running.any() else st.context
        mean_context = float(basis.mean())
        sizes = self._batch_sizes(view, st, memory, mean_context)
        step = self._tgl(view.profile, sizes, mean_context)
        delay = np.where(st.running, 0.0, st.resume_cost) if self.gain_includes_prefill else 0.0
        q = gains(now, self.horizon_s, step[:, None], *st.qoe_arrays(slice(None)), delay)
        priority = q if self.solver == "lqsf" else q / st.weight
        row, chosen = self._pack(q, priority, st, memory, sizes)
        batch, g = int(sizes[row]), float(step[row])
        running_idx = np.flatnonzero(st.running)
        if admit_only:  # reference code's untriggered variant: fill free slots by priority, preempt nobody
            order = [i for i in np.argsort(-priority[row], kind="stable") if not st.running[i]]
            slots = max(0, view.max_batch - running_idx.size)
            run = [reqs[st.rows[i]] for i in (*running_idx, *order[:slots])]
            return Decision(run=run, recheck_after_tokens=self.quantum_iterations)  # type: ignore[arg-type]
        mode = self._preempt_mode(view.profile, st)
        if self.refiner:
            admit, preempt = self._refine(view, st, q[row], priority[row], chosen, memory, batch, g, mode)
        else:
            admit = [int(i) for i in chosen if not st.running[i]]
            taken = set(chosen.tolist())
            preempt = [int(i) for i in running_idx if i not in taken]
        gone = set(preempt)
        keep = [int(i) for i in running_idx if i not in gone]
        members = sorted(keep + admit, key=lambda i: -priority[row][i])
        return Decision(
            run=[reqs[st.rows[i]] for i in members],  # type: ignore[misc]
            preempt_mode=mode if preempt else None,
            recheck_after_tokens=self.quantum_iterations,
        )

    def _pack(
        self, q: np.ndarray, priority: np.ndarray, st: _Ongoing, memory: float, sizes: np.ndarray
    ) -> tuple[int, np.ndarray]:
        """Best batch-size row and the request indices it serves (ties: fewer preemptions, larger B)."""
        n_running = int(st.running.sum())
        if self.solver == "dp":
            values, preemptions, selections = [], [], []
            for row, batch in enumerate(sizes):
                value, sel = exact_pack(q[row], st.weight, int(memory), int(batch))
                values.append(value)
                preemptions.append(n_running - int(st.running[sel].sum()))
                selections.append(sel)
            best = _best_row(np.array(values), np.array(preemptions), sizes)
            return best, selections[best]
        # Alg. 1 for every B at once: one stable sort per row, prefix sums for memory and value.
        n = st.weight.size
        order = np.argsort(-priority, axis=1, kind="stable")
        fits = (np.cumsum(st.weight[order], axis=1) <= memory) & (np.arange(n) < sizes[:, None])
        counts = np.where(fits.all(axis=1), n, np.argmin(fits, axis=1))
        rows = np.arange(sizes.size)
        last = np.maximum(counts - 1, 0)
        values = np.where(
            counts > 0, np.cumsum(np.take_along_axis(q, order, axis=1), axis=1)[rows, last], 0.0
        )
        kept = np.where(counts > 0, np.cumsum(st.running[order], axis=1)[rows, last], 0)
        best = _best_row(values, n_running - kept, sizes)
        return best, order[best, : counts[best]]

    def _preempt_mode(self, profile: StepProfile, st: _Ongoing) -> PreemptMode:
        """The cheaper of recompute (re-prefill on resume) and swap (out and in) for the running set."""
        if self.preemption != "fastest":
            return self.preemption
        ctx = st.context[st.running]
        if ctx.size == 0:
            return "recompute"
        recompute = ctx.size * profile.prefill_p0 + profile.prefill_p1 * float(ctx.sum())
        swap = 2.0 * profile.kv_swap_time(int(ctx.sum()))
        return "swap" if swap < recompute else "recompute"

    def _refine(
        self,
        view: InstanceView,
        st: _Ongoing,
        q: np.ndarray,
        priority: np.ndarray,
        chosen: np.ndarray,
        memory: float,
        batch: int,
        g: float,
        mode: PreemptMode,
    ) -> tuple[list[int], list[int]]:
        """Overhead-aware refiner (§4.3): keep admissions while their gain beats the stall's loss.

        "Making room" covers both KV and the chosen batch size B* (the greedy solution fits
        both); the paper names only memory, but without the slot condition a compute-bound
        decision could admit past B*. Admissions stop where the engine would stop this
        iteration (prefill budget), so no request is evicted for an admission that cannot
        happen now. The losses of all steps come from one vectorised ``gains`` call.
        """
        steps = self._refiner_steps(view, st, priority, chosen, memory, batch, mode)
        if not steps:
            return [], []
        k_steps = len(steps)
        running_idx = np.flatnonzero(st.running)
        admitted = np.array([s.admit for s in steps])
        members = np.concatenate([running_idx, admitted])
        # step at which each member stops being ongoing (victims) or starts (admissions)
        evicted_at = np.full(running_idx.size, k_steps)
        position = {int(j): p for p, j in enumerate(running_idx)}
        for k, s in enumerate(steps):
            for v in s.victims:
                evicted_at[position[v]] = k
        ks = np.arange(k_steps)[:, None]
        ongoing = np.concatenate([evicted_at[None, :] > ks, np.arange(k_steps)[None, :] < ks], axis=1)
        costs = np.array([s.cost for s in steps])
        arrays = st.qoe_arrays(members)
        if self.refiner_cumulative:
            spent = np.concatenate([[0.0], np.cumsum(costs)])
            lost = gains(view.now, spent[:, None], g, *arrays)
            stall = np.maximum(lost[1:] - lost[:-1], 0.0)
        else:
            stall = gains(view.now, costs[:, None], g, *arrays)
        loss = (stall * ongoing).sum(axis=1)
        if self.refiner_count_victim_gain:
            loss += np.array([float(q[s.victims].sum()) for s in steps])
        if self.refiner_waste_loss:
            loss += self._waste_loss(view.now, st, steps, admitted, g)
        ok = q[admitted] - loss > 0
        accepted = k_steps if ok.all() else int(np.argmin(ok))  # the first refusal cancels the rest
        return [s.admit for s in steps[:accepted]], [v for s in steps[:accepted] for v in s.victims]

    def _waste_loss(
        self, now: float, st: _Ongoing, steps: list[_Step], admitted: np.ndarray, g: float
    ) -> np.ndarray:
        """Per step, the QoE the waiting requests lose because the step's preemptions add engine
        work: each waiting request's gain over the horizon shrinks when its service starts later
        by the work wasted so far (cumulative, like the running requests' stall loss). A request
        this decision admits counts as waiting until its own step."""
        waste = np.array([s.waste for s in steps])
        if not waste.any():
            return np.zeros(waste.size)
        wait = np.flatnonzero(~st.running)
        admitted_at = np.full(wait.size, waste.size)
        admitted_at[np.searchsorted(wait, admitted)] = np.arange(admitted.size)
        spent = np.concatenate([[0.0], np.cumsum(waste)])
        shifted = gains(now, self.horizon_s, g, *st.qoe_arrays(wait), start_delay=spent[:, None])
        lost = np.maximum(shifted[:-1] - shifted[1:], 0.0)
        return (lost * (admitted_at[None, :] > np.arange(waste.size)[:, None])).sum(axis=1)

    def _refiner_steps(
        self,
        view: InstanceView,
        st: _Ongoing,
        priority: np.ndarray,
        chosen: np.ndarray,
        memory: float,
        batch: int,
        mode: PreemptMode,
    ) -> list[_Step]:
        """Admissions in priority order, each with the fewest lowest-priority running requests
        that make room for it, up to the first that cannot start now."""
        prof = view.profile
        selected = np.zeros(st.weight.size, dtype=bool)
        selected[chosen] = True
        admit = np.flatnonzero(selected & ~st.running)
        admit = admit[np.argsort(-priority[admit], kind="stable")]
        pool = np.flatnonzero(~selected & st.running)
        # lowest gain per KV first; among equal ones the later index: the lower class, then the later arrival
        pool = pool[np.lexsort((-pool, priority[pool]))]
        free = memory - float(st.weight[st.running].sum())
        size = int(st.running.sum())
        budget = view.prefill_budget_tokens
        prefill_tokens = 0.0
        swap_free = math.inf if view.swap_free_tokens is None else float(view.swap_free_tokens)
        cap = self._preemption_cap(view.now, st)
        next_victim = 0
        steps: list[_Step] = []
        for a in admit:
            a = int(a)
            victims: list[int] = []
            while (free < st.weight[a] or size - len(victims) + 1 > batch) and next_victim < pool.size:
                v = int(pool[next_victim])
                next_victim += 1
                victims.append(v)
                free += float(st.weight[v])
            if free < st.weight[a] or size - len(victims) + 1 > batch:
                break  # no room even after evicting every candidate: nothing more can be admitted
            if next_victim > cap:
                break  # the reference code's cap on preemptions per decision
            restart = not (st.resident[a] or st.swapped[a])
            if (
                restart
                and budget is not None
                and prefill_tokens > 0
                and prefill_tokens + st.context[a] > budget
            ):
                break  # the engine prefills no more this iteration (vLLM's max_num_batched_tokens)
            cost, waste = float(st.resume_cost[a]), 0.0
            for v in victims:
                # a swap stalls the batch while the KV moves out; once swap space is full the
                # engine recomputes instead: no stall now, a prefill when it resumes
                context = int(st.context[v])
                if mode == "swap" and st.delivered[v] > 0 and swap_free >= context:
                    swap_free -= context
                    cost += prof.kv_swap_time(context)
                    waste += 2.0 * prof.kv_swap_time(context)
                else:
                    waste += prof.prefill(context)
            steps.append(_Step(a, victims, cost, waste))
            free -= float(st.weight[a])
            size += 1 - len(victims)
            if restart:
                prefill_tokens += float(st.context[a])
        return steps

    def _preemption_cap(self, now: float, st: _Ongoing) -> float:
        """Most preemptions one decision may make (inf without a cap)."""
        if self.preemption_cap == "none":
            return math.inf
        slack = st.ideal_start + st.delivered / st.speed - now  # reference code: arrival + T* + n/r - t
        unit = REFCODE_UNIT_OVERHEAD_S * float(st.context.mean())
        return max(0.0, math.floor(float(np.percentile(slack, 10)) / unit))


def _best_row(values: np.ndarray, preemptions: np.ndarray, sizes: np.ndarray) -> int:
    """Row with the largest objective; within TIE_EPS of it, fewest preemptions, then largest B."""
    best = float(values.max())
    if best == -np.inf:
        return 0
    tied = np.flatnonzero(values >= best - TIE_EPS)
    return int(tied[np.lexsort((-sizes[tied], preemptions[tied]))[0]])


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
