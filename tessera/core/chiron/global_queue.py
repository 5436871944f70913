"""Chiron's global queue: the requests a cluster holds back from its instances.

Interactive requests that find no instance with room wait here first in, first out, ahead of any
batch work; batch requests wait in deadline order (EDF over deadline groups, first come first served
inside one; a request routed back keeps its place by deadline and arrival). Among equal deadlines
the higher class priority (``ServiceClass.priority``) goes first, before arrival. The batch autoscaler
reads the queue as deadline groups; batch and mixed instances pull from it up to their room.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from tessera.core.planners.types import BatchGroup
from tessera.core.request import Request


@dataclass(slots=True)
class RunningStats:
    """Online mean and standard deviation (Welford) of finished batch requests' output lengths: the
    μ_o, σ_o of the batch autoscaler's waiting-time estimate."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def seeded(cls, n: int, mean: float, std: float) -> RunningStats:
        """Stats that start as ``n`` prior observations of ``mean`` and ``std`` (offline profiling)."""
        return cls(n, mean, std**2 * n)

    def add(self, x: float) -> None:
        """Add one observation."""
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        """Population standard deviation."""
        return math.sqrt(self.m2 / self.n) if self.n > 1 else 0.0


@dataclass(slots=True)
class GlobalQueue:
    """Requests held back: interactive first (FIFO), batch by deadline (see the module docstring)."""

    group_s: float  # deadline bucket width of a batch group (1% of the batch deadline in Chiron)
    interactive: deque[Request] = field(default_factory=deque)
    batch: list[tuple[float, int, float, int, Request]] = field(default_factory=list)
    groups: dict[int, int] = field(default_factory=dict)  # deadline bucket -> queued count
    _seq: itertools.count = field(default_factory=itertools.count)

    def push(self, req: Request) -> None:
        """Hold a request."""
        if req.service_class.kind != "batch":
            self.interactive.append(req)
            return
        deadline = req.slo_deadline
        heapq.heappush(self.batch, (deadline, -req.service_class.priority, req.arrival, next(self._seq), req))
        bucket = int(deadline // self.group_s)
        self.groups[bucket] = self.groups.get(bucket, 0) + 1

    def pop_batch(self) -> Request:
        """The next batch request (earliest deadline)."""
        deadline, *_, req = heapq.heappop(self.batch)
        bucket = int(deadline // self.group_s)
        self.groups[bucket] -= 1
        if not self.groups[bucket]:
            del self.groups[bucket]
        return req

    def take_batch(self, room: int) -> list[Request]:
        """Up to ``room`` batch requests, earliest deadline first."""
        return [self.pop_batch() for _ in range(min(max(0, room), len(self.batch)))]

    def batch_groups(self, margin_s: float) -> tuple[BatchGroup, ...]:
        """Queued batch groups with their deadlines (bucket start, less ``margin_s`` for execution)."""
        return tuple(
            BatchGroup(count=c, deadline=b * self.group_s - margin_s) for b, c in sorted(self.groups.items())
        )


def batch_room(batch_size: int, kv_capacity_tokens: int, outstanding: int, mean_context: float) -> int:
    """Batch requests an instance may still pull: up to its batch size and to the requests of
    ``mean_context`` tokens its KV cache holds at once, less those it holds already."""
    kv_slots = max(1, int(kv_capacity_tokens / max(1.0, mean_context)))
    return min(batch_size, kv_slots) - outstanding
