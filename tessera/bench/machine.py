"""What the machine did while a real-engine benchmark ran: load average and stalls.

On a shared VM the host can stop a guest's processes for a second or more while vLLM keeps the cores
busy (measured here: a process sleeping 10 ms at a time saw 0.3-1.4 s gaps during one vLLM stream, and
none when idle). A stall inside a timed burst moves that burst's TTFT and throughput by more than the
effects being measured, so real-engine benchmarks report the stalls of each measured span next to
its figures.

``MachineWatch`` is a context manager with one daemon thread: it sleeps ``tick_s`` at a time and
counts every oversleep of at least ``stall_s`` as a stall (the bench process itself was not run),
and samples the 1-minute load average every ``load_every_s``. ``span()`` marks the start of a
measured span; ``stalls(mark)`` summarises the stalls since.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stalls:
    """Stalls within one measured span."""

    count: int
    longest_s: float
    total_s: float

    def describe(self) -> str:
        """``"none"`` or ``"N, longest X s, Y s in all"``."""
        if not self.count:
            return "none"
        return f"{self.count}, longest {self.longest_s:.2f} s, {self.total_s:.2f} s in all"


class MachineWatch:
    """Stalls and load average while the block runs (see the module docstring)."""

    def __init__(self, tick_s: float = 0.01, stall_s: float = 0.1, load_every_s: float = 1.0) -> None:
        if not 0 < tick_s < stall_s:
            raise ValueError(f"need 0 < tick_s < stall_s, got tick_s={tick_s}, stall_s={stall_s}")
        self.tick_s = tick_s
        self.stall_s = stall_s
        self.load_every_s = load_every_s
        self._stalls: list[float] = []  # oversleep of each stall, in the order seen
        self._loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="machine-watch", daemon=True)

    def __enter__(self) -> MachineWatch:
        self._loads.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._loads.append(os.getloadavg()[0])

    def _watch(self) -> None:
        last = next_load = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            over = now - last - self.tick_s
            if over >= self.stall_s:
                self._stalls.append(over)
            if now >= next_load:
                self._loads.append(os.getloadavg()[0])
                next_load = now + self.load_every_s
            last = now

    def span(self) -> int:
        """A mark for ``stalls``: the stalls seen so far are not counted."""
        return len(self._stalls)

    def stalls(self, mark: int = 0) -> Stalls:
        """Stalls seen since ``mark`` (default: since the watch started)."""
        seen = self._stalls[mark:]
        return Stalls(len(seen), max(seen, default=0.0), sum(seen))

    def load_range(self) -> tuple[float, float]:
        """(lowest, highest) 1-minute load average sampled so far."""
        return min(self._loads), max(self._loads)

    def describe_load(self) -> str:
        """``"load average (1 min) A-B on N CPUs"``."""
        low, high = self.load_range()
        return f"load average (1 min) {low:.1f}-{high:.1f} on {os.cpu_count()} CPUs"
