"""The simulator's side of cluster autoscaling: clock-driven adapters around the core mechanisms.

Chiron (``tessera.core.chiron``): ``HoldingRouter`` routes an arriving interactive request with the
core's ``chiron_pick`` and holds everything else in the core's ``GlobalQueue``; ``ChironController``
measures the simulated instances into a ``MetricsSnapshot`` every ``T_eval`` (and at once while
interactive requests wait) for the core's ``evaluate_group``, turns the decided counts into instance
actions, and every tick dispatches the global queue. The instances run the core's ``ChironPolicy``.

The utilization-threshold baseline (``tessera.core.planners.threshold``): ``ThresholdController``
with a least-loaded router on arrival or a global FCFS queue its instances pull from.

Both controllers record the instance counts and batch sizes over time (``Timeline``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.core.baselines import EDF, FCFS
from tessera.core.chiron import (
    PREFILL_BACKLOG_S,
    ArrivalMeter,
    ChironLocal,
    ChironPolicy,
    GlobalQueue,
    GroupMemory,
    PullCandidate,
    RunningStats,
    batch_pulls,
    chiron_pick,
    chiron_place,
    evaluate_group,
    interactive_lends,
)
from tessera.core.planners.threshold import ThresholdSettings, threshold_decide
from tessera.core.planners.types import ChironSettings, MetricsSnapshot, RoleCounts, assign_roles
from tessera.core.policy import Policy
from tessera.core.request import Request
from tessera.sim.cluster import (
    AddInstance,
    ClusterAction,
    ClusterController,
    ClusterRouter,
    ClusterView,
    Dispatch,
    DrainInstance,
    RemoveInstance,
    SetRole,
)
from tessera.sim.engine import SimInstance

TIMELINE_STEP_S = 10.0


def queue_of(inst: SimInstance) -> ChironPolicy:
    """The Chiron policy of an instance of a Chiron cluster."""
    policy = inst.policy
    assert isinstance(policy, ChironPolicy)
    return policy


class InstanceTarget:
    """A simulated instance as the core's dispatch reads it (``DispatchTarget``), read live."""

    __slots__ = ("inst",)

    def __init__(self, inst: SimInstance) -> None:
        self.inst = inst

    @property
    def role(self) -> str:
        """The instance's role."""
        return self.inst.role

    @property
    def outstanding(self) -> int:
        """Requests routed there and not finished."""
        return self.inst.outstanding

    @property
    def queue(self) -> ChironPolicy:
        """Its Chiron policy."""
        return queue_of(self.inst)

    @property
    def admissible_kv_tokens(self) -> int:
        """Free KV tokens above the admission watermark."""
        inst = self.inst
        reserve = int(inst.config.watermark * inst.capacity_blocks) * inst.block
        return (inst.capacity_blocks - inst.used_blocks) * inst.block - reserve

    @property
    def prefill_budget_tokens(self) -> int:
        """The engine's per-iteration token budget."""
        return self.inst.config.budget

    def prefill_s(self, tokens: int) -> float:
        """Prefill time of ``tokens`` on this instance's profile."""
        return self.inst.profile.prefill(tokens)


def _active(view: ClusterView) -> list[SimInstance]:
    return [i for i in view.instances if not i.draining]


def _pick(req: Request, serving: Sequence[SimInstance], backlog_s: float) -> SimInstance | None:
    target = chiron_pick(req, [InstanceTarget(i) for i in serving], backlog_s)
    return None if target is None else target.inst


@dataclass(slots=True)
class Timeline:
    """Instance counts over time and scaling actions (both autoscalers record the same way)."""

    points: list[list[float]] = field(default_factory=list)  # [t, interactive, mixed, batch]
    batch_sizes: list[list[float | None]] = field(default_factory=list)  # [t, mean BS of each role]
    actions: int = 0
    scale_ups: int = 0
    reasons: list[str] = field(default_factory=list)
    _next: float = 0.0

    def record(self, view: ClusterView) -> None:
        """Sample the alive instances every TIMELINE_STEP_S."""
        if view.now + 1e-9 < self._next:
            return
        self._next = view.now + TIMELINE_STEP_S
        counts: dict[str, list[int]] = {"interactive": [], "mixed": [], "batch": []}
        for inst in view.instances:
            role = inst.role if inst.role in counts else "interactive"
            policy = inst.policy
            counts[role].append(policy.batch_size() if isinstance(policy, ChironPolicy) else inst.max_batch)
        t = round(view.now, 3)
        self.points.append([t, *(len(v) for v in counts.values())])
        self.batch_sizes.append([t, *(round(float(np.mean(v)), 1) if v else None for v in counts.values())])

    def metrics(self) -> dict[str, Any]:
        """Mean and peak instances, scaling actions, hysteresis (actions per scale-up), the samples and
        the first 200 reasons."""
        totals = [p[1] + p[2] + p[3] for p in self.points]
        return {
            "mean_instances": float(np.mean(totals)) if totals else None,
            "peak_instances": max(totals) if totals else None,
            "scaling_actions": self.actions,
            "scale_ups": self.scale_ups,
            "hysteresis": self.actions / self.scale_ups if self.scale_ups else None,
            "instances_over_time": self.points,
            "batch_size_over_time": self.batch_sizes,
            "scaling_reasons": self.reasons[:200],
        }


class HoldingRouter(ClusterRouter):
    """Chiron's routing: interactive requests to an instance with room (``chiron_pick``); the rest,
    and interactive requests without one, wait in the global queue."""

    name = "global-queue"

    def __init__(
        self, queue: GlobalQueue, backlog_s: float = PREFILL_BACKLOG_S, meter: ArrivalMeter | None = None
    ) -> None:
        self.queue = queue
        self.backlog_s = backlog_s
        self.meter = meter  # counts interactive arrivals for load forecasting

    def route(self, req: Request, view: ClusterView) -> SimInstance | None:
        """An instance for interactive requests with room now; otherwise hold it."""
        inst = None
        if req.service_class.kind != "batch":
            if self.meter is not None:
                self.meter.record(view.now)
            inst = _pick(req, [i for i in _active(view) if i.ready_at <= view.now], self.backlog_s)
        if inst is None:
            self.queue.push(req)
        return inst


class PullRouter(ClusterRouter):
    """Every request waits in one global queue; the controller's instances pull it."""

    name = "global-fcfs"

    def __init__(self, queue: GlobalQueue) -> None:
        self.queue = queue

    def route(self, req: Request, view: ClusterView) -> SimInstance | None:
        """Hold ``req``."""
        self.queue.push(req)
        return None


class LeastLoadedRouter(ClusterRouter):
    """Every request on arrival to the least-loaded instance (ready first; a starting one only when
    none is ready)."""

    name = "least-loaded"

    def route(self, req: Request, view: ClusterView) -> SimInstance | None:
        """The least-loaded instance."""
        cands = _active(view)
        ready = [i for i in cands if i.ready_at <= view.now] or cands
        return min(ready, key=lambda i: i.outstanding)


class ChironController(ClusterController):
    """Dispatches the global queue every ``interval_s`` and evaluates the group every T_eval."""

    def __init__(
        self,
        settings: ChironSettings,
        queue: GlobalQueue,
        stats: RunningStats,
        *,
        interval_s: float,
        exec_margin_s: float,
        mean_context: float,
        backlog_s: float = PREFILL_BACKLOG_S,
        meter: ArrivalMeter | None = None,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.meter = meter  # the interactive arrival rate, with load forecasting
        self.stats = stats
        self.interval_s = interval_s
        self.exec_margin_s = exec_margin_s
        self.mean_context = mean_context
        self.backlog_s = backlog_s
        self.memory = GroupMemory()
        self.timeline = Timeline()
        self._tokens_seen: dict[str, int] = {}  # instance -> its batch tokens at the previous evaluation
        self._last_eval: float | None = None
        self._batch_since: float | None = None

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Scaling (every T_eval) and dispatch (every tick)."""
        actions: list[ClusterAction] = []
        # An interactive request waiting in the global queue triggers an evaluation at once.
        if self.memory.due(self.settings, view.now) or self.queue.interactive:
            actions += self._scale(view)
        gone = {a.name for a in actions if isinstance(a, DrainInstance | RemoveInstance)}
        actions += self._dispatch(view, removed=gone)
        self.timeline.record(view)
        return actions

    def _dispatch(self, view: ClusterView, removed: set[str]) -> list[ClusterAction]:
        actions: list[ClusterAction] = []
        live = [i for i in _active(view) if i.ready_at <= view.now and i.name not in removed]
        pending_int = self.queue.interactive
        # The dispatches take effect after this tick: chiron_place counts the ones placed before.
        placed: dict[str, int] = {}
        for req, target in chiron_place(pending_int, [InstanceTarget(i) for i in live], self.backlog_s):
            pending_int.popleft()
            placed[target.inst.name] = placed.get(target.inst.name, 0) + 1
            actions.append(Dispatch(req, target.inst.name))
        candidates = [
            PullCandidate(
                i.name,
                i.role,
                queue_of(i).batch_size(),
                i.profile.kv_capacity_tokens,
                i.outstanding + placed.get(i.name, 0),
                ready=i.ready_at <= view.now,
            )
            for i in _active(view)
            if i.name not in removed
        ]
        lend = interactive_lends(candidates, self.queue, view.now)
        for name, n in batch_pulls(
            candidates, len(self.queue.batch), bool(pending_int), self.mean_context, lend
        ):
            actions += [Dispatch(req, name) for req in self.queue.take_batch(n)]
        return actions

    def _batch_rates(self, view: ClusterView, ready_batch: int) -> tuple[float | None, float | None]:
        """(Θ_now, Θ_B): batch-token throughput of the cluster and per batch instance since the
        previous evaluation (instances retired meanwhile drop out of the window)."""
        total = on_batch = 0
        seen = {}
        for inst in view.instances:
            now_tokens = queue_of(inst).batch_tokens
            seen[inst.name] = now_tokens
            delta = now_tokens - self._tokens_seen.get(inst.name, 0)
            total += delta
            if inst.role == "batch":
                on_batch += delta
        self._tokens_seen = seen
        prev, self._last_eval = self._last_eval, view.now
        if prev is None or view.now <= prev:
            return None, None
        dt = view.now - prev
        per = on_batch / dt / ready_batch if ready_batch and on_batch > 0 else None
        # Until batch work has run for a whole window the rate says nothing (prefill, not decode).
        measured = self._batch_since is not None and self._batch_since <= prev
        return (total / dt if measured else None), per

    def snapshot(self, view: ClusterView) -> MetricsSnapshot:
        """What the global autoscaler measures of the simulated instances now."""
        now = view.now
        insts = _active(view)
        ready = [i for i in insts if i.ready_at <= now]
        pending = [i for i in insts if i.ready_at > now]

        def counts(xs: list[SimInstance]) -> RoleCounts:
            return RoleCounts(
                interactive=sum(1 for i in xs if i.role == "interactive"),
                mixed=sum(1 for i in xs if i.role == "mixed"),
                batch=sum(1 for i in xs if i.role == "batch"),
            )

        ready_counts, pending_counts = counts(ready), counts(pending)
        batch_running = sum(queue_of(i).batch for i in view.instances)
        if (batch_running or self.queue.batch) and self._batch_since is None:
            self._batch_since = now
        elif not batch_running and not self.queue.batch:
            self._batch_since = None
        rate_now, per_instance = self._batch_rates(view, ready_counts.batch)
        if rate_now is None and (batch_running or self.queue.batch):
            # Not measured yet: batch instances plus mixed ones without interactive work, at the Θ_B seed.
            spare = sum(1 for i in ready if i.role == "mixed" and not queue_of(i).interactive)
            theta_b = self.memory.state.instance_tokens_per_s or self.settings.default_instance_tokens_per_s
            rate_now = (ready_counts.batch + spare) * theta_b
        return MetricsSnapshot(
            ready=ready_counts,
            pending=pending_counts,
            instances_with_interactive=sum(
                1 for i in insts if i.role != "batch" and queue_of(i).interactive > 0
            ),
            interactive_queued=len(self.queue.interactive),
            batch_queue=self.queue.batch_groups(self.exec_margin_s),
            batch_running=batch_running,
            batch_tokens_per_s=rate_now,
            batch_instance_tokens_per_s=per_instance,
            mean_output_tokens=self.stats.mean,
            std_output_tokens=self.stats.std,
            interactive_arrival_rps=self.meter.rate(now) if self.meter is not None else None,
        )

    def _scale(self, view: ClusterView) -> list[ClusterAction]:
        step = evaluate_group(self.snapshot(view), self.memory, self.settings, view.now)
        self.memory = step.memory
        assert step.decision is not None  # the simulator always measures
        self.timeline.reasons += [f"{view.now:.0f}s {r}" for r in step.decision.reasons]
        return self._apply(step.decision.desired, _active(view))

    def _apply(self, desired: RoleCounts, insts: list[SimInstance]) -> list[ClusterAction]:
        """Actions moving the live instances to ``desired`` as a cluster's StatefulSet does (``assign_roles``;
        the live instances in creation order are the ordinals, since only the highest leave): an instance
        below the new total takes its ordinal's role (re-labelled, no cold start), a larger total starts
        instances, a smaller one removes the highest ordinals (those with interactive work drain; batch
        work returns to the queue)."""
        roles = assign_roles(desired, [inst.role for inst in insts])
        actions: list[ClusterAction] = [
            SetRole(inst.name, role) for inst, role in zip(insts, roles, strict=False) if inst.role != role
        ]
        starts = [AddInstance(role=role) for role in roles[len(insts) :]]
        for inst in insts[len(roles) :]:
            leave = DrainInstance if queue_of(inst).interactive else RemoveInstance
            actions.append(leave(inst.name))
        if starts:
            self.timeline.scale_ups += 1
        if actions or starts:
            self.timeline.actions += 1
        return actions + starts


class ThresholdController(ClusterController):
    """The baseline: ``threshold_decide`` on mean KV-token utilization; optional pull dispatch."""

    def __init__(
        self,
        settings: ThresholdSettings,
        queue: GlobalQueue | None,
        *,
        interval_s: float,
        static_batch: int,
        demand: bool = False,
        priority: bool = False,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.interval_s = interval_s
        self.static_batch = static_batch
        self.demand = demand
        self.priority = priority
        self.timeline = Timeline()
        self._next_eval = 0.0

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Scale by the utilization rule; pull held requests (FCFS) when dispatching by pull."""
        actions: list[ClusterAction] = []
        insts = _active(view)
        ready = [i for i in insts if i.ready_at <= view.now]
        if view.now >= self._next_eval and ready:
            util = self._utilization(ready, view)
            d = threshold_decide(min(1.0, util), len(insts), self.settings, view.now, self._next_eval)
            self._next_eval = d.next_eval
            if d.desired > len(insts):
                actions.append(AddInstance(role="default", max_batch=self.static_batch))
                self.timeline.scale_ups += 1
            elif d.desired < len(insts):
                victim = min(insts, key=lambda i: (i.ready_at <= view.now, i.outstanding))
                actions.append(DrainInstance(victim.name))
            if d.desired != len(insts):
                self.timeline.actions += 1
                self.timeline.reasons.append(f"{view.now:.0f}s {d.reason}: {len(insts)} -> {d.desired}")
        if self.queue is not None:
            gone = {a.name for a in actions if isinstance(a, DrainInstance)}
            live = sorted(
                (i for i in ready if i.name not in gone), key=lambda i: i.outstanding
            )  # least loaded first
            actions += self._pull(live)
        self.timeline.record(view)
        return actions

    def _utilization(self, ready: list[SimInstance], view: ClusterView) -> float:
        """KV-token utilization of the ready instances taken together (Llumnix's average load sums the
        instances' blocks before dividing). With ``demand`` the prompts of requests waiting (on the
        instances or in the global queue) count too, as Llumnix's scaling load does, so a backlog reads
        as load even when the static batch size caps the KV in use. Capped at 1.

        A mean of per-instance values each capped at 1 would stop the scaler early: a backlog stuck on
        the first instances reads 1.0 there, and the new, empty instances pull the mean under the band."""
        used = sum(i.used_blocks * i.block for i in ready)
        cap = sum(i.capacity_blocks * i.block for i in ready)
        if self.demand:
            used += sum(r.prompt_tokens for i in ready for r in i.assigned if not r.kv_resident)
            used += sum(r.prompt_tokens for r in view.held)
        return min(1.0, used / cap)

    def _pull(self, live: list[SimInstance]) -> list[ClusterAction]:
        """FCFS over the whole held queue (interactive and batch alike, by arrival); with
        ``priority`` every held interactive request goes before any batch one."""
        assert self.queue is not None
        actions: list[ClusterAction] = []
        q = self.queue
        for inst in live:
            # vLLM takes up to max_num_seqs; KV sorts out the rest.
            room = self.static_batch - inst.outstanding
            while room > 0 and (q.interactive or q.batch):
                if q.batch and (
                    not q.interactive or (not self.priority and q.batch[0][1] < q.interactive[0].arrival)
                ):
                    req = q.pop_batch()
                else:
                    req = q.interactive.popleft()
                actions.append(Dispatch(req, inst.name))
                room -= 1
        return actions


def chiron_cluster(
    settings: ChironSettings,
    stats: RunningStats,
    new_local: Callable[[], ChironLocal],
    *,
    group_s: float,
    interval_s: float,
    exec_margin_s: float,
    mean_context: float,
    backlog_s: float = PREFILL_BACKLOG_S,
) -> tuple[HoldingRouter, ChironController, Callable[[], Policy]]:
    """Chiron over one global queue (batch groups ``group_s`` wide): its router, its controller
    (dispatch every ``interval_s``) and the instances' policy (``ChironPolicy`` around EDF, with a
    fresh ``new_local()``); finished batch requests feed ``stats`` (μ_o, σ_o)."""
    queue = GlobalQueue(group_s=group_s)
    meter = ArrivalMeter(settings.forecast_window_s) if settings.forecast_window_s > 0 else None

    def finished(req: Request) -> None:
        if req.service_class.kind == "batch":
            stats.add(req.generated)

    controller = ChironController(
        settings,
        queue,
        stats,
        interval_s=interval_s,
        exec_margin_s=exec_margin_s,
        mean_context=mean_context,
        backlog_s=backlog_s,
        meter=meter,
    )
    return (
        HoldingRouter(queue, backlog_s, meter),
        controller,
        lambda: ChironPolicy(EDF(), new_local(), on_finish=finished),
    )


def threshold_cluster(
    settings: ThresholdSettings, *, dispatch: str, interval_s: float, static_batch: int, demand: bool
) -> tuple[ClusterRouter, ThresholdController, Callable[[], Policy]]:
    """The threshold baseline with FCFS instances: ``dispatch`` ``arrival`` (least-loaded router,
    scaling every ``settings.interval_s``), ``pull`` (one global FCFS queue, pulled every
    ``interval_s``) or ``pull-priority`` (interactive requests first)."""
    queue = GlobalQueue(group_s=1.0) if dispatch != "arrival" else None
    controller = ThresholdController(
        settings,
        queue,
        interval_s=interval_s if queue is not None else settings.interval_s,
        static_batch=static_batch,
        demand=demand,
        priority=dispatch == "pull-priority",
    )
    router: ClusterRouter = PullRouter(queue) if queue is not None else LeastLoadedRouter()
    return router, controller, FCFS


__all__ = [
    "ChironController",
    "HoldingRouter",
    "InstanceTarget",
    "LeastLoadedRouter",
    "PullRouter",
    "ThresholdController",
    "Timeline",
    "chiron_cluster",
    "queue_of",
    "threshold_cluster",
]
