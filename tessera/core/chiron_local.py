"""Chiron's local autoscaler: the batch size of one engine from backpressure (qlm_chiron_spec B4).

Algorithm 1 of the paper, evaluated at changes of the running set::

    LBP = ITL / ITL_SLO;  TBP = Thr_prev / Thr_curr;  BP = max(LBP, TBP)
    BP < 1: BS = BS * (1 - alpha + alpha / BP)   else: BS = BS / 2

with the spec's fixes [C] that make it stable:

- evaluate only after ``min_iterations`` decode iterations AND ``min_interval_s`` since the last
  update; ITL and throughput are measured over that window;
- TBP applies only right after an increase: ``Thr(window before the increase) / Thr(window after)``;
  otherwise BP = LBP (without this, a halving lowers throughput, TBP > 1 halves again, and the batch
  collapses to 1);
- not batch-bound (running < BS through the whole window): decreases allowed, increases not;
- increases round up (at least +1), decreases round down (at least 1), within [min, max];
- one remembered BS per ITL-SLO level (interactive / batch); when the smallest ITL SLO of the
  running requests changes, switch to that level's BS at once.

Pure logic: the caller passes time and token counts in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
