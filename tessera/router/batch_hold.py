"""The router's batch hold: Chiron's global queue for batch work, on the live path.

A batch request to a model whose pool autoscales with Chiron (its workers' ``scheduling.autoscale``)
is not routed on arrival: it waits here, earliest deadline first (the core's ``GlobalQueue``), and is
released to an instance as one has room (the core's ``batch_pulls``: batch instances first, then
mixed ones, each up to its ``batch_room`` of its polled batch size, its KV and what it holds;
interactive ones only once a request has waited ``orphan_wait_s`` with no batch or mixed instance of
the model ready or starting: ``interactive_lends``). So a
bulk that arrives before its batch instances exist waits for them instead of filling the queues of
the interactive and mixed instances there at the time, and the global autoscaler sees it: the held
requests per class are exported (``tessera_router_batch_held_requests``) and read as batch queue, as a
worker's queue is. The simulator's Chiron controller releases its global queue with the same two
functions.

The hold is released whenever room may have appeared: a request of the model ended, a poll round
refreshed the instances and their batch sizes, or a request joined the hold. A released request is
counted against its instance (reserved) until it is sent there, so one release never hands the same
room out twice. A client that leaves while held leaves the hold. ``max_held`` bounds what one model
may hold; past it a batch request is refused with 429 and Retry-After, never dropped unanswered.

What the live router still does otherwise than the simulator: interactive requests are routed on
arrival (``least-wait`` over the class's roles), never held, so mixed instances lend their room to
batch work even while interactive requests wait in a worker's queue.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.api.openai_errors import ApiError
from tessera.core.chiron import ORPHAN_WAIT_S, GlobalQueue, PullCandidate, batch_pulls, interactive_lends
from tessera.core.request import Request, ServiceClass
from tessera.core.routing import InstanceLoad

MAX_HELD = 10_000  # batch requests one model may hold (each is an open client connection)
RETRY_AFTER_S = 30  # what a refused batch client is told to wait: a batch instance starts in minutes
UNKNOWN_KV = 2**62  # an instance without a profile: its batch size alone bounds its room
GROUP_S = 1.0  # deadline bucket of the queue's groups (only the order matters here)


@dataclass(slots=True)
class _ModelHold:
    """One model's held requests and the release each waits for."""

    queue: GlobalQueue = field(default_factory=lambda: GlobalQueue(GROUP_S))
    waiters: dict[Request, asyncio.Future[str]] = field(default_factory=dict)


class BatchHold:
    """Held batch requests per model, released to instances with room."""

    def __init__(self, max_held: int = MAX_HELD, orphan_wait_s: float = ORPHAN_WAIT_S) -> None:
        if max_held < 1:
            raise ValueError(f"--batch-hold-max must be at least 1, got {max_held}")
        if not 0 <= orphan_wait_s < float("inf"):
            raise ValueError(
                f"--batch-orphan-wait must be a finite number of seconds >= 0, got {orphan_wait_s}"
            )
        self.max_held = max_held
        self.orphan_wait_s = orphan_wait_s
        self.models: dict[str, _ModelHold] = {}
        self.reserved: dict[tuple[str, str], int] = {}  # (instance, model) -> released, not yet sent
        self._ids = itertools.count()

    def held(self) -> dict[str, dict[str, int]]:
        """Held requests by model and class name."""
        out: dict[str, dict[str, int]] = {}
        for model, hold in self.models.items():
            for req in hold.waiters:
                per = out.setdefault(model, {})
                per[req.service_class.name] = per.get(req.service_class.name, 0) + 1
        return out

    async def wait(
        self,
        model: str,
        service_class: ServiceClass,
        now: float,
        loads: Iterable[InstanceLoad],
        mean_context: float,
        coming: Sequence[str] = (),
    ) -> str:
        """Hold a batch request until an instance has room for it; the instance's name. The caller sends
        the request there at once (``sent``): until then it counts as reserved on that instance.
        ApiError 429 when the model already holds ``max_held``."""
        hold = self.models.setdefault(model, _ModelHold())
        if len(hold.waiters) >= self.max_held:
            raise ApiError(
                429,
                f"{len(hold.waiters)} batch requests for {model!r} are already waiting for an instance (the "
                f"router's limit); retry in {RETRY_AFTER_S} s",
                code="batch_hold_full",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        req = Request(f"held-{next(self._ids)}", now, 0, 0, model=model, service_class=service_class)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        hold.waiters[req] = future
        hold.queue.push(req)
        self.release(model, loads, mean_context, now, coming)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.sent(future.result(), model)  # released, then its client left
            elif hold.queue.drop(req):
                del hold.waiters[req]
            raise

    def end(self, model: str, error: ApiError | None) -> None:
        """Stop holding ``model``'s requests: each is answered ``error``, or, without one, released to
        no instance in particular (its route chooses)."""
        hold = self.models.pop(model, None)
        for future in hold.waiters.values() if hold is not None else ():
            if future.done():  # cancelled: its client left, and its task has not run yet
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result("")

    def sent(self, instance: str, model: str) -> None:
        """A released request went to ``instance`` (or will not go at all): its reservation ends. A
        request released to no instance in particular (``end``) has none."""
        if not instance:
            return
        key = (instance, model)
        self.reserved[key] -= 1
        if not self.reserved[key]:
            del self.reserved[key]

    def release(
        self,
        model: str,
        loads: Iterable[InstanceLoad],
        mean_context: float,
        now: float,
        coming: Sequence[str] = (),
    ) -> int:
        """Hand held requests of ``model`` to the ready instances of ``loads`` with room; how many.
        ``coming``: the roles of the model's instances that are planned and not yet in ``loads`` (a
        cluster's starting pods, which discovery does not list): they take nothing, but a batch or mixed
        one among them keeps the interactive instances from lending their room."""
        hold = self.models.get(model)
        if hold is None or not hold.queue.batch:
            return 0
        candidates = [
            PullCandidate(
                x.instance,
                x.role,
                x.batch_size,
                x.profile.kv_capacity_tokens if x.profile is not None else UNKNOWN_KV,
                x.outstanding + self.reserved.get((x.instance, model), 0),
                ready=x.healthy,
            )
            for x in sorted(loads, key=lambda x: x.instance)
            if x.model == model
        ]
        candidates += [PullCandidate(f"(starting {role})", role, 0, 0, 0, ready=False) for role in coming]
        released = 0
        lend = interactive_lends(candidates, hold.queue, now, self.orphan_wait_s)
        for name, n in batch_pulls(candidates, len(hold.queue.batch), False, mean_context, lend):
            for req in hold.queue.take_batch(n):
                hold.waiters.pop(req).set_result(name)
                self.reserved[(name, model)] = self.reserved.get((name, model), 0) + 1
                released += 1
        return released


class HeldCollector(Collector):
    """The batch hold for Prometheus, read at scrape time: held requests per model and class (what the
    operator's autoscaler reads as batch queue besides the workers' own queues)."""

    def __init__(self, hold: BatchHold) -> None:
        self.hold = hold

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "tessera_router_batch_held_requests",
            "Batch requests the router holds until an instance has room (Chiron's global queue).",
            labels=["model", "class"],
        )
        for model, per_class in sorted(self.hold.held().items()):
            for name, n in sorted(per_class.items()):
                held.add_metric([model, name], float(n))
        yield held
