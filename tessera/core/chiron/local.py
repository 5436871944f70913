"""Chiron's local autoscaler: the batch size of one engine from backpressure, and the policy wrapper
that runs it around any scheduling policy (the worker and the simulator use the same wrapper).

``ChironLocal`` is Algorithm 1 of the Chiron paper, evaluated at changes of the running set::

    LBP = ITL / ITL_SLO;  TBP = Thr_prev / Thr_curr;  BP = max(LBP, TBP)
    BP < 1: BS = BS * (1 - alpha + alpha / BP)   else: BS = BS / 2

with these fixes of ours, which make it stable:

- evaluate only after ``min_iterations`` decode iterations AND ``min_interval_s`` since the last
  update; ITL and throughput are measured over that window;
- TBP applies only right after an increase: ``Thr(window before the increase) / Thr(window after)``;
  otherwise BP = LBP (without this, a halving lowers throughput, TBP > 1 halves again, and the batch
  collapses to 1);
- not batch-bound (running < BS through the whole window): decreases allowed, increases not;
- increases round up (at least +1), decreases round down (at least 1), within [min, max];
- one remembered BS per ITL-SLO level (interactive / batch); when the smallest ITL SLO of the
  running requests changes, switch to that level's BS at once.

``ChironPolicy`` wraps an inner policy: the inner policy orders the queue, ``ChironLocal`` owns the
batch size, and interactive requests that find the batch full evict batch requests: the lowest class
priority (``ServiceClass.priority``) first, and among equal priorities the latest in the inner order.

Pure logic: the caller passes time and token counts in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.request import Phase, Request, ServiceClass

# Default ITL SLOs of a class that names none (the worker configuration's defaults too).
INTERACTIVE_ITL_S = 0.2
BATCH_ITL_S = 2.0


@dataclass(slots=True)
class ChironLocal:
    """Batch-size controller of one engine instance."""

    min_batch: int
    max_batch: int
    initial: int
    alpha: float = 0.5
    min_iterations: int = 20
    min_interval_s: float = 0.5
    _bs: dict[float, int] = field(default_factory=dict)  # ITL SLO level -> remembered batch size
    _slo: float | None = None
    _window_start: float | None = None
    _window_tokens: int = 0
    _window_gap_sum: float = 0.0
    _window_gaps: int = 0
    _window_iterations: int = 0
    _window_saturated: bool = False  # running reached BS at some point of the window
    _thr_before_increase: float | None = None  # throughput of the window before the last increase
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, new BS) at each change

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"batch bounds [{self.min_batch}, {self.max_batch}] are not ordered and >= 1")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha {self.alpha} must be in (0, 1]")
        self.initial = min(max(self.initial, self.min_batch), self.max_batch)

    def batch_size(self) -> int:
        """The current batch size (of the current ITL-SLO level)."""
        if self._slo is None:
            return self.initial
        return self._bs.get(self._slo, self.initial)

    def set_bounds(self, min_batch: int, max_batch: int) -> None:
        """New bounds (configuration reload); remembered sizes are clamped into them."""
        if not 1 <= min_batch <= max_batch:
            raise ValueError(f"batch bounds [{min_batch}, {max_batch}] are not ordered and >= 1")
        self.min_batch, self.max_batch = min_batch, max_batch
        self.initial = min(max(self.initial, min_batch), max_batch)
        for slo, bs in self._bs.items():
            self._bs[slo] = min(max(bs, min_batch), max_batch)

    def observe(
        self, now: float, *, tokens: int, gap_sum: float, gaps: int, iterations: int, running: int
    ) -> None:
        """Account output produced since the last call: ``tokens`` tokens whose inter-token gaps sum
        to ``gap_sum`` over ``gaps`` gaps, ``iterations`` decode iterations, ``running`` in flight."""
        if self._window_start is None:
            self._window_start = now
        self._window_tokens += tokens
        self._window_gap_sum += gap_sum
        self._window_gaps += gaps
        self._window_iterations += iterations
        self.note_running(running)

    def note_running(self, running: int) -> None:
        """``running`` requests are (or are about to be) in flight: a full batch saturates the window."""
        if running >= self.batch_size():
            self._window_saturated = True

    def update(self, now: float, itl_slo_s: float | None) -> int:
        """Called at a change of the running set; returns the batch size from now on.

        ``itl_slo_s`` is the smallest ITL SLO among running requests (None: nothing running, keep
        the current level).
        """
        if itl_slo_s is not None and itl_slo_s != self._slo:
            self._slo = itl_slo_s
            self._bs.setdefault(itl_slo_s, self.initial)
            self._reset_window(now)
            self._thr_before_increase = None
            return self.batch_size()
        if self._slo is None or self._window_start is None:
            return self.batch_size()
        elapsed = now - self._window_start
        if self._window_iterations < self.min_iterations or elapsed < self.min_interval_s:
            return self.batch_size()
        itl = self._window_gap_sum / self._window_gaps if self._window_gaps else 0.0
        throughput = self._window_tokens / elapsed if elapsed > 0 else 0.0
        lbp = itl / self._slo
        bp = lbp
        if self._thr_before_increase is not None and throughput > 0:
            bp = max(lbp, self._thr_before_increase / throughput)
        bs = self.batch_size()
        if bp < 1 and self._window_saturated:
            grown = bs * (1 - self.alpha + self.alpha / bp) if bp > 0 else float(self.max_batch)
            new = min(self.max_batch, max(bs + 1, math.ceil(grown)))
        elif bp >= 1:
            new = max(self.min_batch, max(1, math.floor(bs / 2)))
        else:
            new = bs  # load-limited window: no evidence that a larger batch is needed
        self._thr_before_increase = throughput if new > bs else None
        if new != bs:
            self._bs[self._slo] = new
            self.history.append((now, new))
        self._reset_window(now)
        return new

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._window_tokens = 0
        self._window_gap_sum = 0.0
        self._window_gaps = 0
        self._window_iterations = 0
        self._window_saturated = False


class ChironPolicy(Policy):
    """Chiron's local autoscaler around any inner policy: the inner policy orders, ``local`` sizes.

    At every decision point (a change of the running set) the wrapper feeds ``local`` the tokens
    and inter-token gaps produced since the previous one and the engine iterations in between
    (``InstanceView.iteration``), then asks it for the batch size of the current ITL-SLO level: the
    smallest ITL SLO among the running requests and the interactive requests held here (queued
    interactive work already asks for the interactive level). The inner policy decides under that
    batch size. When interactive requests are held next to batch ones, the inner policy may admit
    the interactive ones beyond the batch size and the latest admitted batch requests are evicted
    down to it (preempted with ``preempt_mode="swap"``), so interactive work never waits behind a
    full batch.

    It also keeps what a cluster-level dispatcher reads of the instance: the interactive and batch
    requests held here, the prompt tokens of interactive requests not started yet, and the batch
    output tokens produced here; ``on_finish`` is called with every request that finishes.
    """

    def __init__(
        self,
        inner: Policy,
        local: ChironLocal,
        *,
        interactive_itl_s: float = INTERACTIVE_ITL_S,
        batch_itl_s: float = BATCH_ITL_S,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        self.inner = inner
        # The wrapper reports the policy it wraps (metrics, logs, the oracle check of benchmarks).
        self.name = inner.name
        self.oracle = inner.oracle
        self.local = local
        self.interactive_itl_s = interactive_itl_s
        self.batch_itl_s = batch_itl_s
        self.on_finish = on_finish
        self.interactive = 0  # interactive requests held here (queued or running)
        self.batch = 0
        self.batch_tokens = 0  # batch output tokens produced here so far (as last observed)
        self._int_waiting: dict[Request, None] = {}  # interactive requests here not yet started
        self._int_levels: Counter[float] = Counter()  # ITL SLO of each held interactive request
        self._levels: Counter[float] = Counter()  # ITL SLO of each held request, batch ones too
        self._seen: dict[Request, tuple[int, float]] = {}  # running request -> (tokens, last token time)
        self._iteration: int | None = None  # the engine's iteration count at the previous decision

    def itl_slo(self, cls: ServiceClass) -> float:
        """The ITL SLO ``cls`` asks of the batch size (its own, else the default of its kind)."""
        if cls.itl_slo_s is not None:
            return cls.itl_slo_s
        return self.batch_itl_s if cls.kind == "batch" else self.interactive_itl_s

    def batch_size(self) -> int:
        """The local autoscaler's current batch size."""
        return self.local.batch_size()

    def add(self, req: Request, now: float) -> None:
        """Queue a request."""
        level = self.itl_slo(req.service_class)
        self._levels[level] += 1
        if req.service_class.kind == "batch":
            self.batch += 1
        else:
            self.interactive += 1
            self._int_waiting[req] = None
            self._int_levels[level] += 1
        self.inner.add(req, now)

    def remove(self, req: Request, now: float) -> None:
        """A request finished (or left with its instance)."""
        level = self.itl_slo(req.service_class)
        _drop(self._levels, level)
        if req.service_class.kind == "batch":
            self.batch -= 1
        else:
            self.interactive -= 1
            self._int_waiting.pop(req, None)
            _drop(self._int_levels, level)
        self.inner.remove(req, now)
        # The tokens since the last decision belong to the current window: without them a request
        # that finishes between two decisions (at batch size 1, every one) would leave no trace of
        # its ITL or throughput, and the batch size could never grow.
        tokens, gap_sum = self._account(req)
        self._seen.pop(req, None)
        if tokens:
            self.local.observe(now, tokens=tokens, gap_sum=gap_sum, gaps=tokens, iterations=0, running=0)
        if self.on_finish is not None and req.phase is Phase.FINISHED:
            self.on_finish(req)

    def __len__(self) -> int:
        return len(self.inner)

    def observe(self, view: InstanceView) -> None:
        """The inner policy takes in the engine's progress (under the local batch size)."""
        self.inner.observe(replace(view, max_batch=min(view.max_batch, self.batch_size())))

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """The inner policy's work ahead of a decision, if it has any."""
        return self.inner.prepare(replace(view, max_batch=min(view.max_batch, self.batch_size())))

    def waiting_interactive_tokens(self) -> int:
        """Prompt tokens of the interactive requests held here that have not started yet."""
        for req in [r for r in self._int_waiting if r.first_scheduled_at is not None]:
            del self._int_waiting[req]
        return sum(r.prompt_tokens for r in self._int_waiting)

    def _account(self, req: Request) -> tuple[int, float]:
        """Tokens and gap time ``req`` added since it was last seen (0, 0 when new)."""
        total = req.generated
        prev = self._seen.get(req)
        if total == 0:
            return 0, 0.0
        last = req.tokens.last_time()
        self._seen[req] = (total, last)
        if prev is None:  # first sighting: count from its first token, which closes no gap
            first = req.tokens.first_time()
            prev = (1, last if first is None else first)
        tokens = total - prev[0]
        if tokens > 0 and req.service_class.kind == "batch":
            self.batch_tokens += tokens
        return tokens, last - prev[1] if tokens > 0 else 0.0

    def schedule(self, view: InstanceView) -> Decision:
        """The inner decision under the local batch size; interactive work evicts batch work."""
        d = self._decide(view)
        # A decision that fills the batch saturates the window, even when no later decision sees it
        # full: the worker decides at changes of the running set, so at batch size 1 every decision
        # comes after a finish, with nothing running.
        self.local.note_running(len(d.run))
        return d

    def _decide(self, view: InstanceView) -> Decision:
        tokens = 0
        gap_sum = 0.0
        for req in view.running:
            n, g = self._account(req)
            tokens += n
            gap_sum += g
        # Every token after a request's first observed one closes one inter-token gap.
        self.local.observe(
            view.now,
            tokens=tokens,
            gap_sum=gap_sum,
            gaps=tokens,
            iterations=0 if self._iteration is None else view.iteration - self._iteration,
            running=len(view.running),
        )
        self._iteration = view.iteration
        slo = None
        if view.running:
            slo = min(self.itl_slo(r.service_class) for r in view.running)
            if self._int_levels:
                slo = min(slo, min(self._int_levels))
        elif self._levels:  # nothing runs yet: the level of the held requests about to run
            slo = min(self._levels)
        bs = min(view.max_batch, self.local.update(view.now, slo))
        if self.interactive == 0 or self.batch == 0:
            return self.inner.schedule(replace(view, max_batch=bs))
        # Room for queued interactive requests: let the inner order admit them, then evict batch
        # requests down to the cap, the lowest class priority first, then from the end of the batch.
        int_running = sum(1 for r in view.running if r.service_class.kind != "batch")
        extra = self.interactive - int_running
        d = self.inner.schedule(replace(view, max_batch=bs + extra))
        excess = len(d.run) - max(bs, sum(1 for r in d.run if r.service_class.kind != "batch"))
        if excess <= 0:
            return d
        batch = [
            (r.service_class.priority, -pos) for pos, r in enumerate(d.run) if r.service_class.kind == "batch"
        ]
        evicted = {-neg_pos for _, neg_pos in sorted(batch)[:excess]}
        keep = [r for pos, r in enumerate(d.run) if pos not in evicted]
        return Decision(run=keep, preempt_mode="swap", recheck_after_tokens=d.recheck_after_tokens)


def _drop(levels: Counter[float], level: float) -> None:
    """One request of ``level`` fewer (a level with none left goes)."""
    levels[level] -= 1
    if not levels[level]:
        del levels[level]
