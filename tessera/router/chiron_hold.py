"""The router's Chiron dispatch: the global queue and the placement of the simulator's Chiron rows, on
the live path.

For a model whose pool autoscales with Chiron (its workers' ``scheduling.autoscale``), behind a router
given a ``ChironHold``:

- an interactive request goes where the core's ``chiron_pick`` sends it (an interactive instance with
  room, the most loaded first; then a mixed one; then a mixed one whose batch work it can evict), and
  waits here, first in first out, when no instance has room;
- a batch request always waits here, earliest deadline first, until an instance has room for it (the
  core's ``batch_pulls``: batch instances first, then mixed ones while no interactive request waits,
  each up to its ``batch_room``; interactive ones only once a request has waited ``orphan_wait_s``
  with no batch or mixed instance of the model ready or starting: ``interactive_lends``).

The queue is the core's ``GlobalQueue``, released with ``chiron_place`` then ``batch_pulls``, the
functions the simulator's Chiron controller calls. So a bulk that arrives before its batch instances
exist waits for them instead of filling the queues of the instances there at the time, an interactive
burst packs onto the fewest instances, and the global autoscaler sees what waits: the held requests per
class are exported (``tessera_router_chiron_held_requests``) and read as queued interactive work and
batch queue, as a worker's queues are.

The router reads an instance as the dispatch needs it from what it knows: the requests it has there by
kind, the instance's polled batch size, the prefill it sent there without a first token
(``PrefillQueue``), and its free KV: the engine's capacity less a mean request's context
(``mean_context``) per request there, and at most what the engine last reported free (polled every
``poll_interval_s``), where the simulator reads the engine's own blocks at once.

The hold is released whenever room may have appeared: a request of the model ended, a poll round
refreshed the instances and their batch sizes, or a request joined the hold. A released request is
counted against its instance (reserved) until it is sent there, so one release never hands the same
room out twice. A client that leaves while held leaves the hold. Nothing is held forever: ``max_held``
bounds what one model may hold and the class's ``queue.maxQueued`` (per instance, times the model's
instances) what one class may; past either a request is refused with 429 and Retry-After, and a held
request that no release took within its class's patience (``HoldBound``: ``queue.maxQueueTimeSeconds``,
else its deadline for a batch class and ``HOLD_TTFT_SLOS`` times its TTFT SLO for an interactive one) is
answered 503 with Retry-After, never left waiting. A request no instance could ever hold (larger than
every instance's context or KV cache) is refused before it reaches the hold (``RouterState.oversize``).

What the live system still does otherwise than the simulator: on a cluster a held interactive request
does not trigger a global evaluation at once (the operator reads the hold through Prometheus and
evaluates every ``autoscaling.intervalSeconds``; local mode's autoscaler does evaluate at once).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from math import isfinite

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.api.openai_errors import ApiError
from tessera.core.chiron import (
    ORPHAN_WAIT_S,
    PREFILL_BACKLOG_S,
    GlobalQueue,
    PullCandidate,
    batch_pulls,
    chiron_pick,
    chiron_place,
    interactive_lends,
)
from tessera.core.request import Request, ServiceClass
from tessera.core.routing import InstanceLoad

MAX_HELD = 10_000  # requests one model may hold (each is an open client connection)
RETRY_AFTER_S = 30  # what a refused client is told to wait: an instance starts in minutes
UNKNOWN_KV = 2**62  # an instance without a profile: its batch size alone bounds its room
GROUP_S = 1.0  # deadline bucket of the queue's groups (only the order matters here)
# Prompt tokens one engine iteration prefills, which the router does not know: the simulator's engine
# default without chunked prefill (a prompt that fits with what waits there starts next iteration).
PREFILL_BUDGET_TOKENS = 8192
# CHOICE: an interactive request whose class sets no queue time is held up to this many times its TTFT
# SLO: past the SLO it is late but a reader still waits a while, and a held interactive request mostly
# waits for an instance to start (the quickstart's chat: 20 s)
HOLD_TTFT_SLOS = 10
HOLD_S = 600.0  # a class with neither a queue time nor an SLO (the activator waits as long for a wake)


@dataclass(frozen=True, slots=True)
class HoldBound:
    """How long one class's request may be held, why, and how many of the class may be held per
    instance of the model (None: only ``max_held`` bounds them)."""

    patience_s: float
    reason: str
    max_queued: int | None = None
    by_slo: bool = True  # derived from the SLO: a request's own deadline, when it has one, replaces it


def hold_bound(
    service_class: ServiceClass, max_queue_time_s: float | None, max_queued: int | None
) -> HoldBound:
    """The hold's bound for a class: its ``queue.maxQueueTimeSeconds`` when set, else its SLO's
    (module docstring), and its ``queue.maxQueued``."""
    sc = service_class
    if max_queue_time_s is not None:
        return HoldBound(max_queue_time_s, "its class's queue.maxQueueTimeSeconds", max_queued, by_slo=False)
    if sc.kind == "batch" and sc.deadline_s is not None and isfinite(sc.deadline_s):
        return HoldBound(sc.deadline_s, "its class's deadline", max_queued)
    if sc.ttft_slo_s is not None and isfinite(sc.ttft_slo_s):
        why = f"{HOLD_TTFT_SLOS} times its class's TTFT SLO of {sc.ttft_slo_s:g} s"
        return HoldBound(HOLD_TTFT_SLOS * sc.ttft_slo_s, why, max_queued)
    return HoldBound(HOLD_S, "the router's longest hold", max_queued)


@dataclass(slots=True)
class _ModelHold:
    """One model's held requests and the release each waits for."""

    queue: GlobalQueue = field(default_factory=lambda: GlobalQueue(GROUP_S))
    waiters: dict[Request, asyncio.Future[str]] = field(default_factory=dict)


class _Counts:
    """An instance's requests by kind as Chiron's dispatch reads them (``DispatchQueue``)."""

    __slots__ = ("_batch", "_batch_size", "_interactive", "_waiting")

    def __init__(self, interactive: int, batch: int, batch_size: int, waiting: int) -> None:
        self._interactive, self._batch, self._batch_size, self._waiting = (
            interactive,
            batch,
            batch_size,
            waiting,
        )

    @property
    def interactive(self) -> int:
        return self._interactive

    @property
    def batch(self) -> int:
        return self._batch

    def batch_size(self) -> int:
        return self._batch_size

    def waiting_interactive_tokens(self) -> int:
        return self._waiting


class LoadTarget:
    """An instance as Chiron's dispatch reads it (``DispatchTarget``), from the router's view: what it
    sent there (and released to it, not yet sent), its polled batch size, the prefill it has ahead,
    and its free KV (module docstring)."""

    __slots__ = ("_kv", "kv_capacity", "load", "outstanding", "queue")

    def __init__(self, load: InstanceLoad, reserved: Sequence[int], mean_context: float, now: float) -> None:
        """``reserved``: the interactive and batch requests released to it and not yet sent."""
        self.load = load
        interactive, batch = load.interactive + reserved[0], load.outstanding - load.interactive + reserved[1]
        self.outstanding = interactive + batch
        waiting = load.prefill.left(now, load.profile)
        self.queue = _Counts(interactive, batch, load.batch_size, waiting)
        self.kv_capacity = capacity = load.engine_kv_capacity or (
            load.profile.kv_capacity_tokens if load.profile is not None else UNKNOWN_KV
        )
        kv = int(capacity - self.outstanding * mean_context)
        if load.engine_kv_used is not None:  # what the engine last reported free bounds the estimate
            kv = min(kv, capacity - load.engine_kv_used)
        self._kv = kv

    @property
    def role(self) -> str:
        return self.load.role

    @property
    def admissible_kv_tokens(self) -> int:
        return self._kv

    @property
    def prefill_budget_tokens(self) -> int:
        return PREFILL_BUDGET_TOKENS

    def prefill_s(self, tokens: int) -> float:
        return self.load.profile.prefill(tokens) if self.load.profile is not None else 0.0


class ChironHold:
    """Held requests per model, placed on instances with room (module docstring)."""

    def __init__(
        self,
        max_held: int = MAX_HELD,
        orphan_wait_s: float = ORPHAN_WAIT_S,
        backlog_s: float = PREFILL_BACKLOG_S,
    ) -> None:
        if max_held < 1:
            raise ValueError(f"--hold-max must be at least 1, got {max_held}")
        if not 0 <= orphan_wait_s < float("inf"):
            raise ValueError(
                f"--batch-orphan-wait must be a finite number of seconds >= 0, got {orphan_wait_s}"
            )
        self.max_held = max_held
        self.orphan_wait_s = orphan_wait_s
        self.backlog_s = backlog_s
        self.models: dict[str, _ModelHold] = {}
        # (instance, model) -> [interactive, batch] requests released there, not yet sent
        self.reserved: dict[tuple[str, str], list[int]] = {}
        self._ids = itertools.count()

    def waiting(self, model: str) -> bool:
        """Whether requests of ``model`` are held."""
        hold = self.models.get(model)
        return hold is not None and bool(hold.waiters)

    def held(self) -> dict[str, dict[str, int]]:
        """Held requests by model and class name."""
        out: dict[str, dict[str, int]] = {}
        for model, hold in self.models.items():
            for req in hold.waiters:
                per = out.setdefault(model, {})
                per[req.service_class.name] = per.get(req.service_class.name, 0) + 1
        return out

    def _targets(
        self, model: str, loads: Iterable[InstanceLoad], mean_context: float, now: float
    ) -> list[LoadTarget]:
        return [
            LoadTarget(x, self.reserved.get((x.instance, model), (0, 0)), mean_context, now)
            for x in sorted(loads, key=lambda x: x.instance)
            if x.model == model and x.healthy
        ]

    async def wait(
        self,
        model: str,
        service_class: ServiceClass,
        now: float,
        loads: Sequence[InstanceLoad],
        mean_context: float,
        coming: Sequence[str] = (),
        prompt_tokens: int = 0,
        bound: HoldBound | None = None,
        deadline: float | None = None,
    ) -> str:
        """The instance for a request of ``model``: at once for an interactive request with room
        somewhere, else once the hold releases it. The caller sends the request there at once
        (``sent``): until then it counts as reserved on that instance. ApiError 429 when the model
        already holds ``max_held`` or the class its ``bound.max_queued`` per instance; ApiError 503
        when no release took it within ``bound.patience_s`` (default: ``hold_bound`` of the class).
        ``deadline``: the request's own (a batch line's job expiry, on the clock of ``now``), which orders
        the batch queue in place of its class's, and bounds its hold in place of a bound from its SLO."""
        bound = bound or hold_bound(service_class, None, None)
        if deadline is not None and bound.by_slo:
            bound = HoldBound(max(0.0, deadline - now), "its own deadline", bound.max_queued)
        interactive = service_class.kind != "batch"
        req = Request(f"held-{next(self._ids)}", now, prompt_tokens, 0, model=model,
                      service_class=service_class, deadline=deadline)  # fmt: skip
        if interactive:
            target = chiron_pick(req, self._targets(model, loads, mean_context, now), self.backlog_s)
            if target is not None:
                self._reserve(target.load.instance, model, interactive)
                return target.load.instance
        hold = self.models.setdefault(model, _ModelHold())
        if len(hold.waiters) >= self.max_held:
            raise ApiError(
                429,
                f"{len(hold.waiters)} requests for {model!r} are already waiting for an instance with room "
                f"(the router's limit); retry in {RETRY_AFTER_S} s",
                code="hold_full",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        if bound.max_queued is not None:
            limit = bound.max_queued * max(1, sum(1 for x in loads if x.model == model))
            mine = sum(1 for r in hold.waiters if r.service_class.name == service_class.name)
            if mine >= limit:
                raise ApiError(
                    429,
                    f"{mine} requests of class {service_class.name!r} for {model!r} are already waiting for "
                    f"an instance with room (its queue.maxQueued per instance); retry in {RETRY_AFTER_S} s",
                    code="hold_full",
                    headers={"retry-after": str(RETRY_AFTER_S)},
                )
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        hold.waiters[req] = future
        hold.queue.push(req)
        self.release(model, loads, mean_context, now, coming)
        try:
            # asyncio.wait leaves the future alone on a timeout or a cancellation: what it holds then
            # (released, answered, or neither) decides below
            done, _ = await asyncio.wait({future}, timeout=bound.patience_s)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.sent(future.result(), model, service_class.kind)  # released, then its client left
            elif self._drop(hold, req):
                hold.waiters.pop(req, None)  # a release may have taken it already (``_resolve``)
            future.cancel()
            raise
        if not done:
            if self._drop(hold, req):
                hold.waiters.pop(req, None)
            future.cancel()
            raise ApiError(
                503,
                f"no instance of {model!r} had room for this {service_class.name!r} request within "
                f"{bound.patience_s:g} s ({bound.reason}); retry in {RETRY_AFTER_S} s",
                code="hold_timeout",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        return future.result()

    @staticmethod
    def _drop(hold: _ModelHold, req: Request) -> bool:
        if req.service_class.kind == "batch":
            return hold.queue.drop(req)
        try:
            hold.queue.interactive.remove(req)
        except ValueError:
            return False
        return True

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

    def _reserve(self, instance: str, model: str, interactive: bool) -> None:
        counts = self.reserved.setdefault((instance, model), [0, 0])
        counts[0 if interactive else 1] += 1

    def sent(self, instance: str, model: str, kind: str) -> None:
        """A released request of ``kind`` went to ``instance`` (or will not go at all): its reservation
        ends. A request released to no instance in particular (``end``) has none."""
        if not instance:
            return
        key = (instance, model)
        self.reserved[key][0 if kind != "batch" else 1] -= 1
        if not any(self.reserved[key]):
            del self.reserved[key]

    def release(
        self,
        model: str,
        loads: Sequence[InstanceLoad],
        mean_context: float,
        now: float,
        coming: Sequence[str] = (),
    ) -> int:
        """Place held requests of ``model`` on the ready instances of ``loads`` with room, interactive
        ones first (``chiron_place``), then batch ones (``batch_pulls``); how many. ``coming``: the roles
        of the model's instances that are planned and not yet in ``loads`` (a cluster's starting pods,
        which discovery does not list): they take nothing, but a batch or mixed one among them keeps
        the interactive instances from lending their room to batch work."""
        if not self.waiting(model):
            return 0
        hold = self.models[model]
        released = 0
        queue = hold.queue
        if queue.interactive:
            targets = self._targets(model, loads, mean_context, now)
            for req, target in chiron_place(queue.interactive, targets, self.backlog_s):
                queue.interactive.popleft()
                released += self._resolve(hold, req, target.load.instance, model)
        if not queue.batch:
            return released
        candidates = [
            PullCandidate(
                t.load.instance,
                t.role,
                t.load.batch_size,
                t.kv_capacity,
                t.outstanding,
            )
            for t in self._targets(model, loads, mean_context, now)
        ]
        candidates += [PullCandidate(f"(starting {role})", role, 0, 0, 0, ready=False) for role in coming]
        lend = interactive_lends(candidates, queue, now, self.orphan_wait_s)
        for name, n in batch_pulls(candidates, len(queue.batch), bool(queue.interactive), mean_context, lend):
            for req in queue.take_batch(n):
                released += self._resolve(hold, req, name, model)
        return released

    def _resolve(self, hold: _ModelHold, req: Request, instance: str, model: str) -> bool:
        """Hand ``req`` to ``instance``; False when its client has left meanwhile (its task cancelled,
        and not yet run to take it out of the queue)."""
        future = hold.waiters.pop(req)
        if future.done():
            return False
        future.set_result(instance)
        self._reserve(instance, model, req.service_class.kind != "batch")
        return True


class HeldCollector(Collector):
    """The hold for Prometheus, read at scrape time: held requests per model and class (what the
    operator's autoscaler reads as queued interactive work and batch queue besides the workers' own
    queues)."""

    def __init__(self, hold: ChironHold) -> None:
        self.hold = hold

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "tessera_router_chiron_held_requests",
            "Requests the router holds until an instance has room (Chiron's global queue).",
            labels=["model", "class"],
        )
        for model, per_class in sorted(self.hold.held().items()):
            for name, n in sorted(per_class.items()):
                held.add_metric([model, name], float(n))
        yield held
