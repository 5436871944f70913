"""Local mode's global autoscaler: the operator's Chiron loop over local worker processes.

Every pool's ``autoscaling.intervalSeconds``, and at once while the router holds interactive work of
the group for want of room (as the simulator's Chiron controller does; the operator evaluates on the
interval only), each placement group (with autoscaling enabled) is evaluated as the operator evaluates
it: the same classes, deadlines and settings
(``group_scaling``, capped by ``--max-instances``), the same snapshot (``snapshot_from_results`` over
direct scrapes, ``tessera.local.scrape``: the workers' and the batch component's, whose lines not sent
yet count with their deadline, and what the in-process router holds) and the same step
(the core's ``evaluate_group``). A decision is carried out the way a StatefulSet carries it out:
ordinals keep their roles where they can (the core's ``assign_roles``), new ordinals start as new worker
processes (the router takes them once they answer ``/ready``), and the highest ordinals go. A leaving
worker first leaves the router's rotation and is stopped only when the requests the router sent it have
finished, so a scale-down loses no accepted request. A worker that died and waits for the supervisor's
restart is never scraped and counts as starting (a StatefulSet's pod in CrashLoopBackOff is not ready):
never as capacity that serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import httpx

from tessera.control.metrics_queries import snapshot_from_results
from tessera.control.pool_plan import GroupScaling, group_scaling
from tessera.core.chiron import GroupMemory, evaluate_group
from tessera.core.planners import ROLES, Role, RoleCounts
from tessera.core.routing import InstanceLoad
from tessera.local.control_plane import LocalGroup
from tessera.local.scrape import Counters, batch_results, results_from_scrapes
from tessera.local.supervisor import Supervisor, WorkerProcess
from tessera.router.app import RouterState

DRAIN_POLL_S = 0.2
HELD_CHECK_S = 0.5  # how often the loop looks for interactive work the router holds
SCRAPE_TIMEOUT_S = 2.0


@dataclass
class _Group:
    """One group's autoscaler memory."""

    local: LocalGroup
    scaling: GroupScaling  # classes, deadlines, settings: fixed, as local mode never re-places
    replicas: RoleCounts  # the counts its workers run now (within the local cap)
    memory: GroupMemory = field(default_factory=GroupMemory)
    counters: Counters = field(default_factory=dict)


def effective_counts(local: LocalGroup, counts: RoleCounts, current: Sequence[Role] = ()) -> RoleCounts:
    """``counts`` as local mode runs them from the running ordinals' roles ``current``: cut to the local
    cap, highest ordinals first."""
    roles = local.roles(counts, current)
    return RoleCounts(**{r: roles.count(r) for r in ROLES})


class LocalAutoscaler:
    """Runs the Chiron global autoscaler of every autoscaled group over the supervisor's workers."""

    def __init__(
        self,
        groups: tuple[LocalGroup, ...],
        supervisor: Supervisor,
        router: RouterState,
        *,
        report: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        drain_timeout_s: float = 600.0,
        paused: Collection[str] = (),
        batch_url: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``paused``: groups (by name, a live view) scaled to zero, which the autoscaler leaves alone.
        ``batch_url``: the batch component, whose backlog is scraped too; ``wall_clock``: Unix time, to
        put its deadlines on ``clock``."""
        self.groups = [
            _Group(
                g, group_scaling(g.desired, g.group, g.instance_cap), effective_counts(g, g.group.replicas)
            )
            for g in groups
            if g.desired.pool.spec.autoscaling.enabled
        ]
        self.supervisor = supervisor
        self.router = router
        self.report = report
        self.clock = clock
        self.drain_timeout_s = drain_timeout_s
        self.paused = paused
        self.batch_url = batch_url
        self.wall_clock = wall_clock
        self.actions: list[str] = []  # every scaling decision carried out, as reported
        self._drains: set[asyncio.Task[None]] = set()

    @property
    def period_s(self) -> float:
        """How often the loop looks: the shortest interval of the groups, and at least every
        ``HELD_CHECK_S`` for interactive work the router holds."""
        return min([HELD_CHECK_S, *(g.scaling.settings.eval_interval_s for g in self.groups)])

    async def run(self) -> None:
        """Evaluate every group when due, until cancelled."""
        if not self.groups:
            return
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            while True:
                await asyncio.sleep(self.period_s)
                try:
                    await self.step(client, self.clock())
                except Exception as exc:  # keep serving; the next evaluation tries again
                    self.report(f"autoscaler: evaluation failed, retrying next interval: {exc!r}")

    async def step(self, client: httpx.AsyncClient, now: float) -> None:
        """One pass: every group whose interval has passed, or whose interactive work the router holds
        for want of room (Chiron evaluates at once then), is measured, decided and resized."""
        held_by_model = self.router.hold.held()
        backlog: list[str | None] = []  # the batch component's /metrics, scraped once per pass when needed
        for g in self.groups:
            if g.local.group.name in self.paused:
                continue
            held: dict[str, int] = {}
            for model, per_class in held_by_model.items():
                if model in g.scaling.models:
                    for name, n in per_class.items():
                        held[name] = held.get(name, 0) + n
            waiting = any(g.scaling.kinds.get(name) == "interactive" for name in held)
            if not (waiting or g.memory.due(g.scaling.settings, now)):
                continue
            workers = self._workers(g)
            texts = await asyncio.gather(*(_scrape(client, w) for w in workers))
            scrapes = {w.instance.name: t for w, t in zip(workers, texts, strict=True)}
            results, g.counters = results_from_scrapes(scrapes, g.scaling.kinds, g.counters, now, held)
            if self.batch_url is not None:
                if not backlog:
                    backlog.append(await _get_metrics(client, self.batch_url))
                unix = self.wall_clock()
                results |= batch_results(backlog[0], g.scaling.models, g.scaling.kinds, unix, now)
            plan = replace(g.local.group, replicas=g.replicas, roles=tuple(w.instance.role for w in workers))
            snapshot = snapshot_from_results(results, plan, g.scaling.deadlines, now)
            step = evaluate_group(snapshot, g.memory, g.scaling.settings, now)
            g.memory = step.memory
            if step.decision is None:
                continue
            desired = effective_counts(g.local, step.decision.desired, plan.roles)
            if desired != g.replicas:
                name = g.local.group.name
                message = (
                    f"autoscaler: group {name}: {g.replicas.short()} -> {desired.short()}: {step.reason}"
                )
                self.actions.append(message)
                self.report(message)
                self._resize(g, desired)

    def _workers(self, g: _Group) -> list[WorkerProcess]:
        return sorted(
            (w for w in self.supervisor.workers if w.instance.group == g.local.group.name),
            key=lambda w: w.instance.ordinal,
        )

    def _resize(self, g: _Group, desired: RoleCounts) -> None:
        """Start, re-role and retire workers so that the group runs ``desired``."""
        workers = self._workers(g)
        roles = g.local.roles(desired, [w.instance.role for w in workers])
        for w in workers[: len(roles)]:
            if w.instance.role != roles[w.instance.ordinal]:
                w.instance = replace(w.instance, role=roles[w.instance.ordinal])
        for ordinal in range(len(workers), len(roles)):
            self.supervisor.launch(g.local.instance(ordinal, roles[ordinal]))
        leaving = workers[len(roles) :]
        for w in leaving:
            self.supervisor.workers.remove(w)  # out of the group now; stopped once drained
        g.replicas = desired
        loads = [x for x in self.router.loads.values() if x.instance in {w.instance.name for w in leaving}]
        self.router.update(self.supervisor.backends())
        for w in leaving:
            mine = [x for x in loads if x.instance == w.instance.name]
            task = asyncio.create_task(self._drain(w, mine), name=f"drain-{w.instance.name}")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

    async def _drain(self, worker: WorkerProcess, loads: list[InstanceLoad]) -> None:
        """Wait until the router has nothing outstanding on ``worker``, then stop it."""
        deadline = self.clock() + self.drain_timeout_s
        try:
            while any(x.outstanding > 0 for x in loads) and self.clock() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        finally:
            await asyncio.to_thread(self.supervisor.stop, [worker])

    async def close(self) -> None:
        """Stop the workers still draining (their requests get the worker's own grace period)."""
        for task in list(self._drains):
            task.cancel()
        for task in list(self._drains):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _scrape(client: httpx.AsyncClient, worker: WorkerProcess) -> str | None:
    """A worker's /metrics text; None when it does not answer (still starting, or gone) or is dead
    (reaped, waiting for its restart: whatever answers on its old port is not it)."""
    return None if worker.dead else await _get_metrics(client, worker.url)


async def _get_metrics(client: httpx.AsyncClient, url: str) -> str | None:
    """The /metrics text at ``url``; None when it does not answer."""
    try:
        response = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
