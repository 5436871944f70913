"""QLM request groups and virtual queues (QLM §4, Alg. 1; docs/papers.md, "QLM: request groups ...").

A request group holds requests of one model and one SLO class, FCFS inside. The
paper's Algorithm 1 (k-means, then halve oversize clusters) never removes the
split cluster and does not recurse; we use the equivalent form: hard
keys ``(model, slo_class)`` and contiguous FCFS chunks of at most
``n_max = delta_rg * avg_batch_size`` requests. An arrival joins the newest *open*
group of its key (open: below ``n_max`` and none of its requests started).

A virtual queue (VQ) is the ordered list of groups one instance serves; the
instance pulls from its head group (the first group with unstarted requests).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tessera.core.request import Request


@dataclass(frozen=True, slots=True)
class GroupKey:
    """What makes requests interchangeable for the RWT estimator: model and SLO class."""

    model: str
    slo_class: str


def group_key(req: Request) -> GroupKey:
    """The group key of a request."""
    return GroupKey(req.model, req.service_class.name)


class RequestGroup:
    """Requests of one key, FCFS. Tracks which members wait (unstarted or evicted) and which run."""

    def __init__(self, gid: int, key: GroupKey, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"group size limit must be >= 1, got {limit}")
        self.id = gid
        self.key = key
        self.limit = limit
        self.members: list[Request] = []  # every request ever added, arrival order
        self._pending: list[tuple[float, int, Request]] = []  # waiting members, FCFS (arrival, seq)
        self._seq: dict[int, int] = {}
        self.running: dict[int, Request] = {}
        self.started = False  # some member ran: the group is pinned to its instance (no migration)
        self.unfinished = 0

    def __repr__(self) -> str:
        return f"RequestGroup({self.id}, {self.key.model}/{self.key.slo_class}, n={len(self.members)})"

    @property
    def model(self) -> str:
        """Model every member of the group needs."""
        return self.key.model

    @property
    def is_open(self) -> bool:
        """Whether a new arrival of the same key may join this group."""
        return not self.started and len(self.members) < self.limit

    @property
    def done(self) -> bool:
        """All members finished or cancelled: the group leaves its VQ."""
        return self.unfinished == 0

    @property
    def n_pending(self) -> int:
        """Members waiting to be pulled (never run, or evicted)."""
        return len(self._pending)

    def pending(self) -> Iterator[Request]:
        """Waiting members in FCFS order."""
        return (entry[2] for entry in self._pending)

    def head(self) -> Request | None:
        """The next member to pull (FCFS), or None."""
        return self._pending[0][2] if self._pending else None

    def add(self, req: Request) -> None:
        """A new member (arrivals come in time order, so it goes last)."""
        self._seq[id(req)] = len(self.members)
        self.members.append(req)
        self.unfinished += 1
        bisect.insort(self._pending, (req.arrival, self._seq[id(req)], req), key=lambda e: e[:2])

    def mark_running(self, req: Request) -> None:
        """``req`` entered the batch."""
        for pos, entry in enumerate(self._pending):
            if entry[2] is req:
                del self._pending[pos]
                break
        self.running[id(req)] = req
        self.started = True

    def mark_waiting(self, req: Request) -> None:
        """``req`` left the batch unfinished (evicted or preempted): it waits again at its FCFS place."""
        if self.running.pop(id(req), None) is None:
            return
        bisect.insort(self._pending, (req.arrival, self._seq[id(req)], req), key=lambda e: e[:2])

    def remove(self, req: Request) -> None:
        """``req`` finished or was cancelled."""
        if id(req) not in self._seq:
            raise KeyError(f"request {req.id} is not in group {self.id}")
        if self.running.pop(id(req), None) is None:
            before = len(self._pending)
            self._pending = [e for e in self._pending if e[2] is not req]
            if len(self._pending) == before:
                return  # already removed
        self.unfinished -= 1

    @property
    def priority(self) -> int:
        """Class priority of the group's requests (one class per group; higher first)."""
        return self.members[0].service_class.priority if self.members else 0

    @property
    def slo_at_completion(self) -> bool:
        """Whether the group's deadlines are completion deadlines (one class per group)."""
        return bool(self.members) and self.members[0].service_class.slo_at_completion

    def deadline(self) -> float:
        """Earliest SLO deadline among waiting members (+inf if none wait)."""
        return min((r.slo_deadline for r in self.pending()), default=float("inf"))

    def max_tokens(self) -> int:
        """Largest client cap among waiting members (the O_max of Eq. 4 before the context cap)."""
        return max((r.max_tokens for r in self.pending()), default=0)


SizeLimit = Callable[[GroupKey], int]


class Grouper:
    """Assigns arrivals to request groups (hard keys, FCFS chunks, open groups).

    ``size_limit(key)`` gives ``n_max`` for a key; it is asked when a group is
    created, so it can follow the estimator's online view of the batch size.
    """

    def __init__(self, size_limit: SizeLimit) -> None:
        self._size_limit = size_limit
        self._ids = itertools.count()
        self._newest: dict[GroupKey, RequestGroup] = {}
        self.of: dict[int, RequestGroup] = {}  # id(request) -> its group

    def add(self, req: Request) -> tuple[RequestGroup, bool]:
        """Put ``req`` in a group; returns the group and whether it is new."""
        key = group_key(req)
        group = self._newest.get(key)
        created = group is None or not group.is_open
        if created:
            group = RequestGroup(next(self._ids), key, self._size_limit(key))
            self._newest[key] = group
        group.add(req)
        self.of[id(req)] = group
        return group, created

    def open_group(self, key: GroupKey) -> RequestGroup | None:
        """The group an arrival of ``key`` would join now, if any."""
        group = self._newest.get(key)
        return group if group is not None and group.is_open else None

    def forget(self, req: Request) -> RequestGroup | None:
        """Drop ``req`` from its group (finished or cancelled); returns the group."""
        group = self.of.pop(id(req), None)
        if group is not None:
            group.remove(req)
            if group.done and self._newest.get(group.key) is group:
                del self._newest[group.key]
        return group


class VirtualQueue:
    """Ordered request groups of one instance; the order is the execution order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.groups: list[RequestGroup] = []

    def __iter__(self) -> Iterator[RequestGroup]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def append(self, group: RequestGroup) -> None:
        """Add a group at the tail."""
        self.groups.append(group)

    def insert_after_model(self, group: RequestGroup) -> None:
        """Add a group right after the last group of its model with waiting requests (at the tail when
        there is none), so that it runs before the VQ swaps away from its model."""
        for i in range(len(self.groups) - 1, -1, -1):  # from the tail: stops at the last such group
            g = self.groups[i]
            if g.n_pending and g.model == group.model:
                self.groups.insert(i + 1, group)
                return
        self.groups.append(group)

    def replace(self, groups: Iterable[RequestGroup]) -> None:
        """Install a new order (from the global scheduler)."""
        self.groups = list(groups)

    def drop_done(self) -> None:
        """Dequeue groups whose requests all completed."""
        self.groups = [g for g in self.groups if not g.done]

    def head_group(self) -> RequestGroup | None:
        """First group that still has waiting (unstarted or evicted) requests."""
        return next((g for g in self.groups if g.n_pending), None)

    def pending_requests(self) -> int:
        """Waiting requests over all groups."""
        return sum(g.n_pending for g in self.groups)
