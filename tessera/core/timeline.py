"""Compact record of when each output token of a request was delivered.

The simulator advances runs of decode iterations in closed form, so token
delivery times come in runs whose spacing grows linearly (the step time grows
with the batch's context by a fixed amount per iteration). A run stores
``(t_first, count, interval, growth)``: token k of the run (k = 0..count-1) is
delivered at ``t_first + k*interval + growth*k*(k-1)/2``. Real engines append
runs of one token each. Memory and cost grow with runs (events), not tokens.

Every request in a simulated batch receives the same decode runs, so an engine
records each run once in a shared ``RunLog`` and *attaches* the timelines of its
decoding requests to it; a timeline copies the runs it missed (a C-speed slice)
whenever it is read or detached. Readers never see the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RunLog:
    """Token runs shared by every request decoding in one engine instance (append-only)."""

    t_first: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    intervals: list[float] = field(default_factory=list)
    growths: list[float] = field(default_factory=list)
    cum_tokens: list[int] = field(default_factory=lambda: [0])  # tokens before run i

    def append_run(self, t_first: float, count: int, interval: float, growth: float) -> None:
        """Record one run of ``count`` decode iterations that every attached request took part in."""
        self.t_first.append(t_first)
        self.counts.append(count)
        self.intervals.append(interval)
        self.growths.append(growth)
        self.cum_tokens.append(self.cum_tokens[-1] + count)

    def __len__(self) -> int:
        return len(self.counts)


@dataclass(slots=True)
class TokenTimeline:
    """Delivery times of a request's output tokens, stored as arithmetic runs."""

    t_first: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    intervals: list[float] = field(default_factory=list)
    growths: list[float] = field(default_factory=list)
    _total: int = 0
    _src: RunLog | None = None  # shared engine log this timeline follows while decoding
    _src_pos: int = 0  # first run of _src not copied yet

    @property
    def total(self) -> int:
        """Number of tokens delivered so far."""
        self._sync()
        return self._total

    def attach(self, log: RunLog) -> None:
        """Follow ``log``: runs appended to it from now on belong to this timeline too."""
        self._sync()
        self._src = log
        self._src_pos = len(log)

    def detach(self) -> None:
        """Stop following the shared log (after copying what it holds for this timeline)."""
        self._sync()
        self._src = None

    def _sync(self) -> None:
        src = self._src
        if src is None:
            return
        end = len(src.counts)
        start = self._src_pos
        if start == end:
            return
        self.t_first.extend(src.t_first[start:end])
        self.counts.extend(src.counts[start:end])
        self.intervals.extend(src.intervals[start:end])
        self.growths.extend(src.growths[start:end])
        self._total += src.cum_tokens[end] - src.cum_tokens[start]
        self._src_pos = end

    def append_run(self, t_first: float, count: int, interval: float = 0.0, growth: float = 0.0) -> None:
        """Record ``count`` tokens, the first at ``t_first``, spaced ``interval`` growing by ``growth``."""
        if count <= 0:
            return
        self._sync()
        if self.counts and t_first < self.last_time() - 1e-9:
            raise ValueError(f"token run starts at {t_first} before the last token at {self.last_time()}")
        self.t_first.append(t_first)
        self.counts.append(count)
        self.intervals.append(interval)
        self.growths.append(growth)
        self._total += count

    def append(self, t: float) -> None:
        """Record one token delivered at time ``t``."""
        self.append_run(t, 1)

    def _run_time(self, run: int, k: int) -> float:
        return self.t_first[run] + k * self.intervals[run] + self.growths[run] * k * (k - 1) / 2

    def first_time(self) -> float | None:
        """Delivery time of the first token, or None before any token."""
        self._sync()
        return self.t_first[0] if self.counts else None

    def last_time(self) -> float:
        """Delivery time of the latest token (raises if there is none)."""
        self._sync()
        if not self.counts:
            raise ValueError("no token delivered yet")
        return self._run_time(len(self.counts) - 1, self.counts[-1] - 1)

    def times(self) -> np.ndarray:
        """All delivery times as a float array (O(tokens); for metrics at the end, not hot paths)."""
        self._sync()
        if not self.counts:
            return np.empty(0)
        counts = np.asarray(self.counts)
        run_of = np.repeat(np.arange(len(counts)), counts)  # one vectorised pass, not one per run
        k = np.arange(self._total, dtype=float) - np.repeat(np.cumsum(counts) - counts, counts)
        t0 = np.asarray(self.t_first)[run_of]
        return (
            t0 + k * np.asarray(self.intervals)[run_of] + np.asarray(self.growths)[run_of] * k * (k - 1) / 2
        )

    def runs(self) -> list[tuple[float, int, float, float]]:
        """The runs as ``(t_first, count, interval, growth)`` tuples."""
        self._sync()
        return list(zip(self.t_first, self.counts, self.intervals, self.growths, strict=True))
