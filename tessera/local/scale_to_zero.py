"""Local mode's scale to zero: a placement group whose services are idle is stopped (Cold) and started again
on the first request the router's activator holds for it.

Sleeping here means the group's worker processes stop: the sim engine's sleep is reachable only through
the worker's model swapping between two sleep-capable models of one pod, and vLLM 0.32 on CPU has no
sleep mode, so a stopped process is the one sleep every local engine has. A wake-up is therefore a cold
start (a new worker process, and with ``--engine vllm`` a new vLLM server), measured by the activator
(``lastWakeSeconds`` in ``/router/status``).

A group sleeps only when every service on it has ``spec.scaleToZero``, after the longest of their idle
times (``tessera.core.activation.unit_idle_after``); a service sharing its group with an always-on one
stays on, and the plan says so.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tessera.core.activation import IdlePolicy, unit_idle_after
from tessera.local.control_plane import LocalGroup, LocalInstance
from tessera.local.supervisor import Supervisor, WorkerStartError
from tessera.router.app import RouterState


@dataclass(frozen=True, slots=True)
class IdleUnits:
    """The groups that may sleep, their models' idle policies, and the policies that cannot apply."""

    units: dict[str, tuple[str, ...]]  # group -> its models
    policies: dict[str, IdlePolicy | None]  # model -> its policy (None: always on)
    problems: tuple[str, ...]


def idle_units(groups: tuple[LocalGroup, ...]) -> IdleUnits:
    """Which of ``groups`` may sleep (every service on it has ``scaleToZero``), from their services."""
    units: dict[str, tuple[str, ...]] = {}
    policies: dict[str, IdlePolicy | None] = {}
    problems: list[str] = []
    for g in groups:
        services = [g.desired.services[s] for s in g.group.services]
        mine: dict[str, IdlePolicy | None] = {}
        for svc in services:
            spec = svc.spec.scale_to_zero
            mine[svc.spec.model.name] = None if spec is None else spec.policy()
        if unit_idle_after(list(mine.values())) is not None:
            units[g.group.name] = tuple(mine)
            policies.update(mine)
        elif any(p is not None for p in mine.values()):
            always = ", ".join(s.name for s in services if s.spec.scale_to_zero is None)
            problems.append(f"group {g.group.name}: scaleToZero is ignored: it shares instances with "
                            f"{always}, which has none (set it on every service of the group)")  # fmt: skip
    return IdleUnits(units, policies, tuple(problems))


@dataclass
class LocalActuator:
    """Stops and starts the worker processes of a group for the router's activator."""

    groups: tuple[LocalGroup, ...]
    supervisor: Supervisor
    router: RouterState
    ready_timeout_s: float = 120.0
    asleep: set[str] = field(default_factory=set)  # groups stopped (the autoscaler leaves them alone)
    _parked: dict[str, list[LocalInstance]] = field(default_factory=dict)

    def _group(self, unit: str) -> LocalGroup:
        return next(g for g in self.groups if g.group.name == unit)

    def _refresh_router(self) -> None:
        self.router.update(self.supervisor.backends())

    async def sleep(self, unit: str) -> None:
        """Take the group's instances out of the router (its models stay listed), then stop them."""
        group = self._group(unit)
        workers = [w for w in self.supervisor.workers if w.instance.group == unit]
        self._parked[unit] = [w.instance for w in workers]
        self.asleep.add(unit)
        for model in group.config.models:
            self.router.dormant[model.name] = group.config
        self.supervisor.workers = [w for w in self.supervisor.workers if w not in workers]
        self._refresh_router()
        await asyncio.to_thread(self.supervisor.stop, workers)

    async def wake(self, unit: str) -> None:
        """Start the group's instances again; returns once the first is ready and in the router (the
        others join the rotation when the router's poll sees them ready). WorkerStartError (with a
        worker's log tail) when none starts."""
        group = self._group(unit)
        started = [self.supervisor.launch(i) for i in self._parked[unit]]
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            first = await asyncio.to_thread(self.supervisor.wait_first_ready, started, deadline)
        except WorkerStartError:
            await asyncio.to_thread(self.supervisor.stop, started)
            raise
        for model in group.config.models:
            self.router.dormant.pop(model.name, None)
        self._refresh_router()
        self.router.set_health(first.instance.name, True)
        self.asleep.discard(unit)
        self._parked.pop(unit, None)
