"""Simulated cluster of SeaLLM sharing groups: the request dispatcher and plan roll-outs (SeaLLM §3, §4.3).

Every instance of a placement plan is a ``GroupEngine``. The dispatcher sends each request to the ready
instance hosting its service with the fewest outstanding (queued + running) requests, ties to the lowest
instance id (CHOICE). Instances are independent between dispatches, so only the hosts of a
request's service are advanced to its arrival before the choice (cost grows with events).

``apply(plan, at)`` rolls a new plan out with the least churn (CHOICE, docs/papers.md): instances whose
(services, TP) stay in the plan keep running with their queues and KV; other instances stop, and their
unfinished requests are re-dispatched keeping their generated tokens, budget and arrival (their KV is
recomputed where they land); new instances start after the switch stall ``W_group/p / BW_h2d + t_init``.
Pure: time is an argument, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tessera.control.group_sim import (
    GroupEngine,
    RequestOutcome,
    Scheduler,
    SimRequest,
    make_request,
    outcome,
)
from tessera.core.planners.types import HistoryRequest, PlacementPlan, PoolInput, ServiceInput
from tessera.core.policies.seallm import ServiceStats


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """Stall of a newly started group (CHOICE): weights per GPU over host-to-device bandwidth,
    plus engine initialisation. Pulls from storage are overlapped with serving (not charged)."""

    h2d_bytes_per_s: float = 20e9
    init_s: float = 5.0

    def __post_init__(self) -> None:
        if self.h2d_bytes_per_s <= 0 or self.init_s < 0:
            raise ValueError("switch cost needs h2d_bytes_per_s > 0 and init_s >= 0")

    def stall_s(self, services: Sequence[ServiceInput], tp: int) -> float:
        """Seconds a new group of ``services`` on ``tp`` GPUs is unavailable."""
        return sum(s.weights_bytes for s in services) / tp / self.h2d_bytes_per_s + self.init_s


@dataclass(frozen=True, slots=True)
class Churn:
    """What one roll-out did: instances kept, started and stopped, and requests migrated."""

    kept: int
    started: int
    stopped: int
    migrated: int


@dataclass(slots=True)
class Instance:
    """One running group instance."""

    index: int
    key: tuple[tuple[str, ...], int]
    engine: GroupEngine
    ready_at: float


class ClusterSim:
    """All instances of the plan in effect, fed by the dispatcher."""

    def __init__(
        self,
        pool: PoolInput,
        services: Sequence[ServiceInput],
        stats: dict[str, ServiceStats],
        scheduler: Scheduler,
        *,
        switch: SwitchCost | None = None,
        chunk: int = 8,
    ) -> None:
        self.pool = pool
        self.by_name = {s.name: s for s in services}
        missing = sorted(set(self.by_name) - set(stats))
        if missing:
            raise ValueError(f"no execution-time statistics for services {missing}")
        self.stats = stats
        self.scheduler: Scheduler = scheduler
        self.switch = switch or SwitchCost()
        self.chunk = chunk
        self.instances: list[Instance] = []
        self.hosts: dict[str, list[Instance]] = {}
        self.requests: list[SimRequest] = []
        self.migrated = 0
        self._next_index = 0
        self._preemptions_stopped = 0

    @property
    def preemptions(self) -> int:
        """KV preemptions (recompute) over every instance, including stopped ones."""
        return self._preemptions_stopped + sum(i.engine.preemptions for i in self.instances)

    @property
    def rejected(self) -> int:
        """Requests that no instance of their service could hold in KV (never served)."""
        return sum(r.rejected for r in self.requests)

    def apply(self, plan: PlacementPlan, at: float, *, stall: bool = True) -> Churn:
        """Roll ``plan`` out at time ``at`` with the least churn; ``stall=False`` starts new instances at
        once (the initial placement, made before serving starts)."""
        unknown = sorted({n for g in plan.groups for n in g.services} - set(self.by_name))
        if unknown:
            raise ValueError(f"plan places unknown services {unknown}")
        self.advance(at)
        want = {g.key: g.replicas.total for g in plan.groups}
        current: dict[tuple, list[Instance]] = {}
        for inst in self.instances:
            current.setdefault(inst.key, []).append(inst)
        keep: list[Instance] = []
        stop: list[Instance] = []
        for key, insts in current.items():
            insts.sort(key=lambda i: (-i.engine.outstanding, i.index))  # keep the busiest: fewest moves
            n = want.get(key, 0)
            keep += insts[:n]
            stop += insts[n:]
        started = 0
        for g in plan.groups:
            services = [self.by_name[n] for n in g.services]
            delay = self.switch.stall_s(services, g.tp) if stall else 0.0
            for _ in range(g.replicas.total - len(current.get(g.key, [])[: g.replicas.total])):
                engine = GroupEngine(
                    self.pool,
                    services,
                    g.tp,
                    stats=self.stats,
                    scheduler=self.scheduler,
                    start=at + delay,
                    chunk=self.chunk,
                )
                keep.append(Instance(self._next_index, g.key, engine, at + delay))
                self._next_index += 1
                started += 1
        moved = [r for inst in stop for r in inst.engine.evacuate()]
        self._preemptions_stopped += sum(i.engine.preemptions for i in stop)
        self.instances = sorted(keep, key=lambda i: i.index)
        self.hosts = {}
        for inst in self.instances:
            for n in inst.key[0]:
                self.hosts.setdefault(n, []).append(inst)
        unplaced = sorted({r.service for r in moved} - set(self.hosts))
        if unplaced:
            raise ValueError(f"plan hosts no instance of services {unplaced} that have requests in flight")
        for r in sorted(moved, key=lambda r: (r.arrival, r.seq)):
            self._dispatch(r, at)
        self.migrated += len(moved)
        return Churn(
            kept=len(self.instances) - started, started=started, stopped=len(stop), migrated=len(moved)
        )

    def _dispatch(self, r: SimRequest, now: float) -> None:
        hosts = self.hosts.get(r.service)
        if not hosts:
            raise ValueError(f"no instance hosts service {r.service!r}; every service must be placed")
        for inst in hosts:
            inst.engine.run_until(now)
        # Only instances whose KV pool can hold the request (hosts differ in TP and co-located
        # models); when none can, the chosen one rejects it.
        able = [i for i in hosts if i.engine.holds(r)] or hosts
        best = min(able, key=lambda i: (i.ready_at > now, i.engine.outstanding, i.index))
        best.engine.submit(r)

    def submit(self, service: str, request: HistoryRequest) -> SimRequest:
        """A new request arrives (arrivals must come in time order)."""
        r = make_request(self.by_name[service], request, len(self.requests))
        self.requests.append(r)
        self._dispatch(r, r.arrival)
        return r

    def advance(self, t: float) -> None:
        """Run every instance's decisions that start before ``t`` (``math.inf``: until all is served)."""
        for inst in self.instances:
            inst.engine.run_until(t)

    def outcomes(self, end: float, requests: Iterable[SimRequest] | None = None) -> list[RequestOutcome]:
        """Outcomes as seen at time ``end``: requests not finished by then are censored at ``end``."""
        out = []
        for r in self.requests if requests is None else requests:
            if r.finished is not None and r.finished > end:
                late = SimRequest(r.service, r.arrival, r.prompt, r.output, r.exec_ref, r.seq)
                out.append(outcome(late, self.stats[r.service], self.by_name[r.service].slo_scale, end))
            else:
                out.append(outcome(r, self.stats[r.service], self.by_name[r.service].slo_scale, end))
        return out


def serve(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    plan: PlacementPlan,
    requests: Sequence[tuple[str, HistoryRequest]],
    *,
    stats: dict[str, ServiceStats],
    scheduler: Scheduler,
    horizon: float = math.inf,
) -> tuple[list[RequestOutcome], ClusterSim]:
    """Serve ``requests`` on a fixed ``plan`` with the dispatcher; run until ``horizon`` (default: until
    every request has finished) and censor what is left then. Every request is counted."""
    sim = ClusterSim(pool, services, stats, scheduler)
    sim.apply(plan, 0.0, stall=False)
    for name, h in sorted(requests, key=lambda x: x[1].arrival):
        sim.submit(name, h)
    sim.advance(horizon)
    end = horizon if math.isfinite(horizon) else max((r.finished or 0.0 for r in sim.requests), default=0.0)
    return sim.outcomes(end), sim
