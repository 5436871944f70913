"""Compact record of when each output token of a request was delivered.

The simulator advances runs of decode iterations in closed form, so token
delivery times come in runs whose spacing grows linearly (the step time grows
with the batch's context by a fixed amount per iteration). A run stores
``(t_first, count, interval, growth)``: token k of the run (k = 0..count-1) is
delivered at ``t_first + k*interval + growth*k*(k-1)/2``. Real engines append
runs of one token each. Memory and cost grow with runs (events), not tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenTimeline:
    """Delivery times of a request's output tokens, stored as arithmetic runs."""

    t_first: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    intervals: list[float] = field(default_factory=list)
    growths: list[float] = field(default_factory=list)
    total: int = 0

    def append_run(self, t_first: float, count: int, interval: float = 0.0, growth: float = 0.0) -> None:
        """Record ``count`` tokens, the first at ``t_first``, spaced ``interval`` growing by ``growth``."""
        if count <= 0:
            return
        if self.counts and t_first < self.last_time() - 1e-12:
            raise ValueError(f"token run starts at {t_first} before the last token at {self.last_time()}")
        self.t_first.append(t_first)
        self.counts.append(count)
        self.intervals.append(interval)
        self.growths.append(growth)
        self.total += count

    def append(self, t: float) -> None:
        """Record one token delivered at time ``t``."""
        self.append_run(t, 1)

    def _run_time(self, run: int, k: int) -> float:
        return self.t_first[run] + k * self.intervals[run] + self.growths[run] * k * (k - 1) / 2

    def first_time(self) -> float | None:
        """Delivery time of the first token, or None before any token."""
        return self.t_first[0] if self.counts else None

    def last_time(self) -> float:
        """Delivery time of the latest token (raises if there is none)."""
        if not self.counts:
            raise ValueError("no token delivered yet")
        return self._run_time(len(self.counts) - 1, self.counts[-1] - 1)

    def time_of(self, index: int) -> float:
        """Delivery time of token ``index`` (0-based)."""
        if not 0 <= index < self.total:
            raise IndexError(f"token {index} of {self.total}")
        for run, count in enumerate(self.counts):
            if index < count:
                return self._run_time(run, index)
            index -= count
        raise AssertionError("unreachable")

    def times(self) -> np.ndarray:
        """All delivery times as a float array (O(tokens); for metrics at the end, not hot paths)."""
        parts = []
        for run, count in enumerate(self.counts):
            k = np.arange(count, dtype=float)
            parts.append(self.t_first[run] + k * self.intervals[run] + self.growths[run] * k * (k - 1) / 2)
        return np.concatenate(parts) if parts else np.empty(0)

    def runs(self) -> list[tuple[float, int, float, float]]:
        """The runs as ``(t_first, count, interval, growth)`` tuples."""
        return list(zip(self.t_first, self.counts, self.intervals, self.growths, strict=True))
