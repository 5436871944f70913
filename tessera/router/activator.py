"""The activator: puts idle units to sleep and holds the requests for a sleeping one until it is awake.

A unit (``tessera.core.activation``: the instances of one placement group) whose models received no
request for the idle time of their ``scaleToZero`` policy, with nothing in flight or held, is put to
sleep through the ``Actuator`` (local mode stops its worker processes). A request for a model whose unit
is not ``Ready`` is held in the model's bounded queue (full: 429) and, if the unit is ``Cold``, its
wake-up starts at once. When the wake-up succeeds the held requests go on in release order (class
priority, then arrival); a request still held at its deadline (the policy's ``holdSeconds``, else its
class's TTFT SLO) gets 503 with Retry-After, while the wake-up goes on for the next requests. A failing
wake-up is tried again with backoff; when every try failed, the held requests get 503 naming the
reason and the unit stays ``Cold`` (the next request tries again).

A request that arrives while its unit is being put to sleep is held: the sleep, once begun, finishes,
and the held request then wakes the unit at once. Idle time counts from the last request's arrival;
a unit with requests in flight never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.api.openai_errors import ApiError
from tessera.core.activation import (
    Backoff,
    HoldQueue,
    IdlePolicy,
    UnitState,
    hold_deadline,
    retry_after_s,
    should_sleep,
    unit_idle_after,
)

TICK_S = 1.0
log = logging.getLogger(__name__)


class Actuator(Protocol):
    """What puts a unit to sleep and wakes it (local mode: worker processes stopped and started)."""

    async def sleep(self, unit: str) -> None:
        """Put ``unit`` to sleep; returns once nothing of it runs."""

    async def wake(self, unit: str) -> None:
        """Wake ``unit``; returns once its instances are ready in the router, raises with the reason."""


class WakeFailed(Exception):
    """Every try of a wake-up failed; the message is the last reason."""


@dataclass(eq=False, slots=True)
class _Held:
    """One held request: resolved with None when released, or with the failure of the wake-up."""

    done: asyncio.Future[None]


@dataclass(slots=True)
class _Unit:
    name: str
    models: tuple[str, ...]
    after_s: float | None
    state: UnitState = UnitState.READY
    last_activity: float = 0.0
    wake_started: float | None = None
    last_wake_s: float | None = None  # duration of the last successful wake-up
    failures: int = 0  # failed tries of the wake-up under way, or of the last one
    last_error: str | None = None
    sleeps: int = 0
    wakes: int = 0
    followed: bool = False  # put to sleep by another component (``Activator.follow``)
    task: asyncio.Task[None] | None = field(default=None, repr=False)


def _went_cold(unit: _Unit) -> None:
    """A ready unit that another component put to sleep is Cold (and counts the sleep); any other state
    stays (a wake-up under way goes on)."""
    if unit.state is UnitState.READY:
        unit.state = UnitState.COLD
        unit.sleeps += 1


class Activator:
    """Idle units to sleep, held requests, wake-ups with retries (see the module docstring)."""

    def __init__(
        self,
        units: Mapping[str, tuple[str, ...]],
        policies: Mapping[str, IdlePolicy | None],
        actuator: Actuator,
        outstanding: Callable[[str], int],
        *,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
    ) -> None:
        """``units``: unit -> its models; ``policies``: model -> its idle policy (None: always on);
        ``outstanding``: model -> requests the router has in flight for it."""
        self.actuator = actuator
        self.outstanding = outstanding
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.tick_s = tick_s
        self.policies = dict(policies)
        now = clock()
        self.units = {
            name: _Unit(name, models, unit_idle_after([policies.get(m) for m in models]), last_activity=now)
            for name, models in units.items()
        }
        self.unit_of = {m: u for u in self.units.values() for m in u.models}
        self.queues: dict[str, HoldQueue[_Held]] = {
            m: HoldQueue(p.max_held if p is not None else 1) for m, p in self.policies.items()
        }

    async def admit(self, model: str, ttft_slo_s: float | None, priority: int) -> None:
        """Return when ``model`` may be served: at once when its unit is ready, else once it has woken.
        ApiError 429 when the model's hold queue is full, 503 with Retry-After at the deadline or when
        the wake-up failed."""
        unit = self.unit_of.get(model)
        now = self.clock()
        if unit is None:
            return
        unit.last_activity = now
        if unit.state is UnitState.READY:
            return
        policy = self.policies.get(model)
        queue = self.queues[model]
        held = _Held(asyncio.get_running_loop().create_future())
        if not queue.admit(held, priority, now):
            raise ApiError(429, f"the model {model!r} is {unit.state.lower()} and already holds {len(queue)} "
                           "requests waiting for it to wake; retry later", code="activator_queue_full",
                           headers={"Retry-After": str(self._retry_after(unit, now))})  # fmt: skip
        if unit.state is UnitState.COLD:
            self._start_wake(unit)
        deadline = hold_deadline(now, policy.hold_s if policy else None, ttft_slo_s)
        try:
            await asyncio.wait_for(asyncio.shield(held.done), max(0.0, deadline - now))
        except TimeoutError:
            waited = self.clock() - now
            message = (
                f"the model {model!r} is {unit.state.lower()}: not ready after {waited:.1f} s of waiting; "
                "the wake-up goes on, retry after the Retry-After seconds"
            )
            retry = {"Retry-After": str(self._retry_after(unit, self.clock()))}
            raise ApiError(503, message, code="model_waking", headers=retry) from None
        except WakeFailed as exc:
            retry = {"Retry-After": str(max(1, round(self.backoff.base_s)))}
            message = f"the model {model!r} could not be woken: {exc}; retry later"
            raise ApiError(503, message, code="wake_failed", headers=retry) from None
        finally:
            queue.remove(held)

    def _retry_after(self, unit: _Unit, now: float) -> int:
        # Not waking yet (asleep, or going to sleep): the whole wake-up is still ahead.
        started = unit.wake_started if unit.state is UnitState.WAKING else now
        return retry_after_s(now, started, unit.last_wake_s)

    def _start_wake(self, unit: _Unit) -> None:
        unit.state = UnitState.WAKING
        unit.wake_started = self.clock()
        unit.task = asyncio.create_task(self._wake(unit), name=f"wake-{unit.name}")

    async def _wake(self, unit: _Unit) -> None:
        unit.failures = 0
        while True:
            try:
                await self.actuator.wake(unit.name)
                break
            except Exception as exc:  # any reason: retried, then reported to the held requests
                unit.failures += 1
                # Clients see the first line; the rest (a worker's log tail) goes to the router's log.
                unit.last_error = f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"
                delay = self.backoff.delay(unit.failures)
                log.warning("wake-up of %s failed (try %d): %s: %s", unit.name, unit.failures,
                            type(exc).__name__, exc)  # fmt: skip
                if delay is None:
                    unit.state = UnitState.COLD
                    reason = f"the wake-up failed {unit.failures} times; last: {unit.last_error}"
                    self._finish(unit, WakeFailed(reason))
                    return
                await asyncio.sleep(delay)
        unit.state = UnitState.READY
        unit.wakes += 1
        assert unit.wake_started is not None
        unit.last_wake_s = self.clock() - unit.wake_started
        unit.last_activity = self.clock()
        self._finish(unit, None)

    def _finish(self, unit: _Unit, error: Exception | None) -> None:
        """Release (or fail) the unit's held requests, in release order."""
        for model in unit.models:
            queue = self.queues.get(model)
            for held in queue.release() if queue is not None else ():
                if held.done.done():
                    continue
                if error is None:
                    held.done.set_result(None)
                else:
                    held.done.set_exception(error)

    async def _sleep(self, unit: _Unit) -> None:
        try:
            await self.actuator.sleep(unit.name)
        except Exception as exc:  # a unit half put to sleep is woken whole by the next request
            log.warning("sleep of %s failed: %s", unit.name, exc)
            unit.last_error = f"sleep failed: {type(exc).__name__}: {exc}"
        unit.state = UnitState.COLD
        unit.sleeps += 1
        if any(len(self.queues[m]) for m in unit.models if m in self.queues):
            self._start_wake(unit)  # requests arrived while it went to sleep: wake it at once

    def tick(self) -> None:
        """Put the units that have been idle long enough to sleep."""
        now = self.clock()
        for unit in self.units.values():
            outstanding = sum(self.outstanding(m) for m in unit.models)
            held = sum(len(self.queues[m]) for m in unit.models if m in self.queues)
            if should_sleep(unit.state, unit.last_activity, outstanding, held, unit.after_s, now):
                unit.state = UnitState.SLEEPING  # from now on its requests are held
                unit.task = asyncio.create_task(self._sleep(unit), name=f"sleep-{unit.name}")

    async def run(self) -> None:
        """Tick until cancelled; cancels a sleep or wake-up under way when cancelled."""
        try:
            while True:
                self.tick()
                await asyncio.sleep(self.tick_s)
        finally:
            for unit in self.units.values():
                if unit.task is not None and not unit.task.done():
                    unit.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await unit.task

    def follow(
        self,
        units: Mapping[str, tuple[str, ...]],
        policies: Mapping[str, IdlePolicy],
        cold: set[str],
        serving: set[str],
    ) -> None:
        """Follow units that another component puts to sleep (the operator, on a cluster): ``units`` are
        all of them now, with their models' ``policies``; ``cold`` those scaled to zero, ``serving``
        those with a ready instance. These units never sleep here (no idle time). A ready unit that is
        cold now is Cold (its next request wakes it); a cold one that serves again (woken for another
        router) is Ready. A unit no longer listed is dropped, and its held requests go on (its models
        are served elsewhere, or answer 404)."""
        for name, models in units.items():
            unit = self.units.get(name)
            if unit is None:
                unit = self.units[name] = _Unit(name, models, None, last_activity=self.clock(), followed=True)
            unit.models = models
            if name in cold:
                _went_cold(unit)
            elif unit.state is UnitState.COLD and name in serving:
                unit.state = UnitState.READY
        for name in [n for n in self.units if n not in units]:
            gone = self.units.pop(name)
            if gone.task is not None and not gone.task.done():
                gone.task.cancel()
            self._finish(gone, None)
        for model, policy in policies.items():
            self.queues.setdefault(model, HoldQueue(policy.max_held)).capacity = policy.max_held
            self.policies[model] = policy
        self.unit_of = {m: u for u in self.units.values() for m in u.models}

    def lost_instances(self, model: str) -> bool:
        """A request found no instance of ``model``, whose unit is ready: when the unit is followed (its
        group is being scaled to zero, and discovery has not said so yet), it is Cold from now on, and
        True (the request may be held); False otherwise."""
        unit = self.unit_of.get(model)
        if unit is None or not unit.followed:
            return False
        _went_cold(unit)
        return True

    def state_of(self, model: str) -> UnitState:
        """The state of ``model``'s unit (Ready for a model without one)."""
        unit = self.unit_of.get(model)
        return unit.state if unit is not None else UnitState.READY

    def status(self) -> dict[str, Any]:
        """What ``/router/status`` shows: per unit its state, models, held requests, idle time, wake-ups."""
        now = self.clock()
        return {
            unit.name: {
                "state": unit.state.value,
                "models": list(unit.models),
                "afterSeconds": unit.after_s,
                "idleSeconds": round(now - unit.last_activity, 3),
                "held": {m: len(self.queues[m]) for m in unit.models if m in self.queues},
                "sleeps": unit.sleeps,
                "wakes": unit.wakes,
                "lastWakeSeconds": unit.last_wake_s,
                "failedTries": unit.failures,
                "lastError": unit.last_error,
            }
            for unit in self.units.values()
        }


class ActivationCollector(Collector):
    """The activator's view for Prometheus, read at scrape time: each unit's state (1 for the current
    one), its sleeps and wake-ups, and the requests held per model (the demand a cold unit has)."""

    def __init__(self, activator: Activator) -> None:
        self.activator = activator

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        what = "1 for the unit's current scale-to-zero state (Ready, Sleeping, Cold, Waking)."
        state = GaugeMetricFamily("tessera_router_unit_state", what, labels=["unit", "state"])
        held = GaugeMetricFamily(
            "tessera_router_held_requests", "Requests held while the model's unit wakes.", labels=["model"]
        )
        sleeps = CounterMetricFamily("tessera_router_unit_sleeps", "Times the unit was put to sleep.",
                                     labels=["unit"])  # fmt: skip
        wakes = CounterMetricFamily("tessera_router_unit_wakes", "Wake-ups of the unit that succeeded.",
                                    labels=["unit"])  # fmt: skip
        for unit in self.activator.units.values():
            for value in UnitState:
                state.add_metric([unit.name, value.value], 1.0 if unit.state is value else 0.0)
            sleeps.add_metric([unit.name], float(unit.sleeps))
            wakes.add_metric([unit.name], float(unit.wakes))
            for model in unit.models:
                held.add_metric([model], float(len(self.activator.queues[model])))
        yield from (state, held, sleeps, wakes)
