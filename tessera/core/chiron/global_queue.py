"""Chiron's global queue: the requests a cluster holds back from its instances.

Interactive requests that find no instance with room wait here first in, first out, ahead of any
batch work; batch requests wait in deadline order (EDF over deadline groups, first come first served
inside one; a request routed back keeps its place by deadline and arrival). Among equal deadlines
the higher class priority (``ServiceClass.priority``) goes first, before arrival. The batch autoscaler
reads the queue as deadline groups; batch and mixed instances pull from it up to their room
(``batch_pulls``: the simulator's controller and the live router's Chiron dispatch release it the same way).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.core.planners.types import BatchGroup
from tessera.core.request import Request

# Seconds a held batch request waits with no batch or mixed instance in sight before interactive
# instances lend it their room (``interactive_lends``): longer than an autoscaler evaluation and an
# instance's start, so that Chiron's batch instances, once decided, take the work.
ORPHAN_WAIT_S = 60.0


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

    def drop(self, req: Request) -> bool:
        """Take a held batch request out of the queue (its client left); False when it is not held."""
        i = next((k for k, e in enumerate(self.batch) if e[-1] is req), None)
        if i is None:
            return False
        entry = self.batch[i]
        last = self.batch.pop()
        if i < len(self.batch):
            self.batch[i] = last
            heapq.heapify(self.batch)
        bucket = int(entry[0] // self.group_s)
        self.groups[bucket] -= 1
        if not self.groups[bucket]:
            del self.groups[bucket]
        return True

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


@dataclass(frozen=True, slots=True)
class PullCandidate:
    """An instance as batch dispatch sees it."""

    name: str
    role: str  # "interactive", "mixed" or "batch"
    batch_size: int  # its local autoscaler's batch size
    kv_capacity_tokens: int
    outstanding: int  # requests there (or on their way) that have not ended
    ready: bool = True  # serving; a starting instance takes nothing yet, but counts as coming


def batch_pulls(
    candidates: Sequence[PullCandidate],
    waiting: int,
    interactive_waiting: bool,
    mean_context: float,
    lend_interactive: bool = False,
) -> list[tuple[str, int]]:
    """How many of the ``waiting`` held batch requests each ready instance takes now, by name: batch
    instances first, then mixed ones (they lend only spare capacity: none while interactive work
    waits for an instance), in the order given, each up to its ``batch_room``. Interactive instances
    take batch work only with ``lend_interactive`` (``interactive_lends``), and to their room too, so a
    bulk never fills their queues."""
    order = [c for c in candidates if c.role == "batch"]
    if not interactive_waiting:
        order += [c for c in candidates if c.role == "mixed"]
        if lend_interactive:
            order += [c for c in candidates if c.role == "interactive"]
    out: list[tuple[str, int]] = []
    for c in order:
        if waiting <= 0:
            break
        if not c.ready:
            continue
        n = min(waiting, batch_room(c.batch_size, c.kv_capacity_tokens, c.outstanding, mean_context))
        if n > 0:
            out.append((c.name, n))
            waiting -= n
    return out


def interactive_lends(
    candidates: Sequence[PullCandidate], queue: GlobalQueue, now: float, orphan_wait_s: float = ORPHAN_WAIT_S
) -> bool:
    """Whether interactive instances take held batch work now: only when no batch or mixed instance is
    there, ready or starting, and the longest-held batch request has waited ``orphan_wait_s`` (CHOICE:
    serve rather than hold for ever). Chiron holds batch work until the autoscaler's batch instances
    start; a group whose instance cap is all interactive, or one no autoscaler resizes, never gets one."""
    if not queue.batch or any(c.role in ("batch", "mixed") for c in candidates):
        return False
    return now - min(entry[2] for entry in queue.batch) >= orphan_wait_s
