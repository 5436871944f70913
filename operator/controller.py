"""The reconcile pass of one ServingPool: read the pool, decide (pure), apply, report.

The handlers give each pass the bodies of the pool's services and of the classes they name (from kopf's
indexes) and run the passes of one pool one at a time (its daemon), so nothing here lists Tessera
objects or locks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from tessera.api.serving_pool import SCALING_HISTORY_LENGTH, ReplacementInterval
from tessera.control.children import (
    GROUP_LABEL,
    desired_children,
    pool_labels,
    scale_to_zero_models,
)
from tessera.control.inputs import interval_metrics
from tessera.control.metrics_queries import ModelLoad
from tessera.control.pool_plan import (
    PoolDesired,
    Problem,
    Retiring,
    desired_pool,
    group_scaling,
    inputs_fingerprint,
    retiring_groups,
)
from tessera.control.scale_to_zero import (
    GroupSleep,
    SleepStep,
    asleep_loads,
    not_awake,
    step_sleep,
    wake_request,
)
from tessera.core.activation import UnitState, unit_idle_after
from tessera.core.chiron import GroupMemory, evaluate_group
from tessera.core.planners import (
    AutoscalerState,
    GroupPlan,
    IntervalSettings,
    MetricsSnapshot,
    PlacementPlan,
)
from tessera.core.planners.replacement import shift_check_due, shifted_loads
from tessera.operator import status as st
from tessera.operator.kube import Kube, OwnershipError, rejection
from tessera.operator.reconcile import DONE, claim, plan_actions

log = logging.getLogger(__name__)

# Longest history placement reads (CHOICE: re-placement intervals may reach a week; SeaLLM replays the
# history through its simulator, whose cost grows with it).
MAX_HISTORY_S = 1800.0
# How often a pool whose old groups wait for their successors to become ready looks again (CHOICE: the
# operator does not watch StatefulSets; pods take tens of seconds to minutes to become ready).
HANDOVER_POLL_S = 5.0
# How often a pool with scale-to-zero groups looks at their idleness, at wake requests and at a waking
# group's pods (CHOICE: a wake request waits at most this long, against a cold start of tens of seconds
# at least; an idleness check is a few Prometheus queries per group).
SLEEP_POLL_S = 2.0
# Event of a re-placement brought forward by a load shift (``shifted_loads``).
LOAD_SHIFT = "LoadShift"


class MetricsSource(st.StatusMetrics, Protocol):
    """Where the global autoscaler, placement and the status read measurements (Prometheus in production)."""

    def snapshot(
        self,
        namespace: str,
        pool: str,
        group: GroupPlan,
        kinds: Mapping[str, str],
        deadlines: Mapping[str, float],
        now: float,
        models: Sequence[str] = (),
    ) -> MetricsSnapshot | None:
        """The group's measurements now (``kinds``: class name -> interactive/batch; ``deadlines``:
        batch class name -> deadline seconds; ``models``: the group's models, whose batch requests the
        router holds count as queued work); None when there are none."""
        ...

    def loads(self, namespace: str, pool: str, window_s: float) -> dict[str, ModelLoad] | None:
        """Each served model's load over the last ``window_s`` seconds, by model name; None if unknown."""
        ...

    def idle(self, namespace: str, pool: str, group: str, window_s: float) -> bool | None:
        """Whether a group's workers saw no request over the last ``window_s`` seconds; None if unknown."""
        ...


def _state_from_history(history: list[dict[str, Any]], group: str) -> AutoscalerState:
    last_up: dict[str, float] = {}
    last_any: float | None = None
    for entry in history:
        if entry.get("group") != group:
            continue
        when = st.parse_time(entry.get("time"))
        if when is None:
            continue
        last_any = when if last_any is None else max(last_any, when)
        if entry.get("toReplicas", 0) > entry.get("fromReplicas", 0):
            role = entry.get("role", "")
            last_up[role] = max(last_up.get(role, when), when)
    return AutoscalerState(last_scale_up=last_up, last_scaling=last_any)


class Controller:
    """Reconciles pools, services and classes of a cluster through a ``Kube`` adapter."""

    def __init__(
        self,
        kube: Kube,
        emit: st.EventSink,
        metrics: MetricsSource | None = None,
        resync_seconds: float = 60.0,
    ) -> None:
        self.kube = kube
        self.resync_seconds = resync_seconds
        self.emit = emit
        self.metrics = metrics
        self.reporter = st.StatusReporter(kube, emit, metrics)
        self._scalers: dict[tuple[str, str, str], GroupMemory] = {}
        self._last_sync: dict[tuple[str, str], float] = {}
        # When each pool's next autoscaler evaluation is due (the earliest of its groups).
        self._autoscale_due: dict[tuple[str, str], float] = {}
        # When each pool's next re-placement boundary is (status.nextPlacementTime).
        self._placement_due: dict[tuple[str, str], float] = {}
        # When a pool handing groups over to a new placement looks at their readiness again.
        self._handover_due: dict[tuple[str, str], float] = {}
        # When a pool with scale-to-zero groups looks at them again.
        self._sleep_due: dict[tuple[str, str], float] = {}
        # When each pool's services' arrivals are next compared with their planned load (load shifts).
        self._shift_due: dict[tuple[str, str], float] = {}
        # The groups of each pool whose last due autoscaler evaluation found no measurements: their counts
        # stay as they are, and the pool's Scaled condition says so instead of claiming it autoscales.
        self._unmeasured: dict[tuple[str, str], set[str]] = {}
        # The bodies the API server refused as invalid, by (namespace, kind, name): not sent again
        # until the desired body changes (another try would be refused the same way).
        self._refused: dict[tuple[str, str, str], Mapping[str, Any]] = {}
        self._refused_messages: dict[tuple[str, str, str], str] = {}

    # -- pools ---------------------------------------------------------------------------------------

    def due(self, namespace: str, name: str, now: float) -> bool:
        """Whether a timed pass of the pool is due: when the autoscaler or a re-placement boundary (with
        Prometheus configured) is due, while old groups wait for new ones to become ready, and a resync
        now and then (events drive the rest; a periodic pass repairs drift such as a hand-edited
        StatefulSet)."""
        key = (namespace, name)
        if now - self._last_sync.get(key, -math.inf) >= self.resync_seconds:
            return True
        if now >= self._handover_due.get(key, math.inf) or now >= self._sleep_due.get(key, math.inf):
            return True
        return self.metrics is not None and (
            now >= self._autoscale_due.get(key, -math.inf)
            or now >= self._placement_due.get(key, math.inf)
            or now >= self._shift_due.get(key, math.inf)
        )

    def reconcile_pool(
        self,
        namespace: str,
        name: str,
        services: list[dict[str, Any]],
        classes: list[dict[str, Any]],
        now: float,
        autoscale: bool = False,
    ) -> None:
        """One pass: bring a pool's children and status (and its services' status) in line with the specs.

        ``services`` are the bodies of the LLMServices naming the pool, ``classes`` those of the
        RequestClasses they name. The pool itself is read afresh: its status holds the plan in effect
        and the scaling history, which the previous pass may have just written. ``autoscale`` runs the
        autoscaler's due evaluations (with Prometheus configured).
        """
        self._last_sync[(namespace, name)] = now
        body = self.kube.get_custom(st.POOLS, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return
        status = dict(body.get("status") or {})
        previous = st.plan_from_status(status.get("placement"))
        fingerprint = inputs_fingerprint(body, services, classes)
        due = st.parse_time(status.get("nextPlacementTime"))
        # A re-placement boundary needs measurements: without them the inputs are the specs, which the
        # fingerprint watches.
        boundary = self.metrics is not None and previous is not None and due is not None and now >= due
        # The digest of the specs the plan in effect came from is in status: a restart re-plans only
        # when they changed meanwhile.
        changed = status.get("inputsDigest") != fingerprint or previous is None
        measured: dict[str, ModelLoad] | None = None
        window = None
        if not (changed or boundary) and previous is not None:
            shift = self._load_shift(namespace, body, services, status, now)
            if shift is not None:
                boundary, (window, measured) = True, shift
        elif (changed or boundary) and self.metrics is not None:
            window = min(MAX_HISTORY_S, status.get("replacementIntervalSeconds") or _initial_interval(body))
            measured = self.metrics.loads(namespace, name, window)
        asleep = _sleeps_from_status(status)
        if measured is not None and window is not None:
            measured = {**asleep_loads(previous, asleep, services, window), **measured}
        if measured is not None:
            log.info(
                "pool %s/%s: measured loads over %.0f s: %s",
                namespace,
                name,
                window,
                {m: (round(v.rate, 3), v.span_s) for m, v in measured.items()},
            )
        # Prometheus unreachable at a boundary: no re-placement on defaults; the boundary stays due (and,
        # unless changed specs re-plan this pass, the pool's Placed condition says so until a pass measures).
        deferred = boundary and measured is None and not changed
        boundary = boundary and measured is not None
        replan = changed or boundary
        decided = desired_pool(
            body,
            services,
            classes,
            previous,
            now,
            replan=replan,
            measured=measured,
            window_s=window,
            unplaced=_unplaced(status),
        )
        if isinstance(decided, Problem):
            self.reporter.report_invalid(st.POOLS, body, decided, now)
            return
        real, finished = None, 0
        if boundary and measured is not None:
            by_service = {
                n: measured[s.spec.model.name]
                for n, s in decided.services.items()
                if s.spec.model.name in measured
            }
            real = interval_metrics(decided.inputs, by_service)
            finished = round(sum(m.finished_total for m in by_service.values()))
        if not boundary and previous is not None and decided.plan is not None:
            decided = _keep_unchanged(decided, previous)
        history = list(status.get("scalingHistory") or [])
        autoscale = autoscale and self.metrics is not None
        if autoscale and decided.plan is not None and decided.pool.spec.autoscaling.enabled:
            decided, history = self._autoscale(namespace, body, decided, history, now, not_awake(asleep))
        elif autoscale:  # nothing to autoscale: the resync (and events) will look again
            self._autoscale_due[(namespace, name)] = math.inf
        decided, sleeps = self._scale_to_zero(namespace, body, services, decided, status, asleep, now)
        seen = self._apply(namespace, body, decided, status, now)
        timeline = st.Timeline(boundary, real, finished, window, deferred)
        unmeasured = sorted(self._unmeasured.get((namespace, name), ()))
        self._placement_due[(namespace, name)] = self.reporter.report_pool(
            namespace, body, services, seen, decided, previous, history, timeline, sleeps, fingerprint,
            unmeasured, now,
        )  # fmt: skip

    def _load_shift(
        self,
        namespace: str,
        body: Mapping[str, Any],
        services: list[dict[str, Any]],
        status: Mapping[str, Any],
        now: float,
    ) -> tuple[float, dict[str, ModelLoad]] | None:
        """Between boundaries, every minSeconds/2: the arrivals of the last minSeconds against the load
        each service's plan was made for (its status.load); when one shifted (``shifted_loads``) and the
        plan is at least minSeconds old, the boundary comes now: its window (the interval's, as at any
        boundary) and the loads over it. An event names the shift.

        Planned on the interval, not on the minSeconds that showed the shift: on a bursty trace a shift
        is seen at a burst's peak, and a plan for that minute's rate (every candidate overloaded) gave a
        bursting service 2 GPUs of 32 for the intervals after the burst had passed (``tessera bench
        seallm --seed 1 --set minutes=20``: normalized latency 1.19x lower than round-robin's, 2.50x with
        the interval's window). A lasting shift is re-placed again once the new plan is minSeconds old,
        since its rates are still off the plan's."""
        key = (namespace, str(body["metadata"]["name"]))
        threshold, min_s = _shift_watch(body)
        if self.metrics is None or threshold <= 0:
            self._shift_due.pop(key, None)
            return None
        last = st.parse_time(status.get("lastPlacementTime"))
        first = now + min_s / 2  # a pool seen for the first time looks after half a window
        due, self._shift_due[key] = shift_check_due(now, self._shift_due.get(key, first), last, min_s)
        if not due:
            return None
        planned = {}
        for b in services:
            rate = ((b.get("status") or {}).get("load") or {}).get("requestsPerSecond")
            model = ((b.get("spec") or {}).get("model") or {}).get("name")
            if isinstance(rate, int | float) and isinstance(model, str):
                planned[model] = float(rate)
        recent = self.metrics.loads(namespace, key[1], min_s)
        if not recent or not planned:
            return None
        counts = {m: (load.requests, load.span_s) for m, load in recent.items()}
        shifted = shifted_loads(planned, counts, threshold)
        if not shifted:
            return None
        moves = ", ".join(f"{m} {a:.3g} -> {b:.3g} req/s" for m, (a, b) in sorted(shifted.items()))
        self.emit(
            body,
            "Normal",
            LOAD_SHIFT,
            f"load shifted over the last {min_s:.0f} s ({moves}): re-placing before the boundary",
        )
        window = min(MAX_HISTORY_S, status.get("replacementIntervalSeconds") or _initial_interval(body))
        loads = self.metrics.loads(namespace, key[1], window) if window > min_s else recent
        return (window, loads) if loads else (min_s, recent)

    def _scale_to_zero(
        self,
        namespace: str,
        body: Mapping[str, Any],
        service_bodies: list[dict[str, Any]],
        decided: PoolDesired,
        status: Mapping[str, Any],
        previous: Mapping[str, GroupSleep],
        now: float,
    ) -> tuple[PoolDesired, SleepStep]:
        """Put idle scale-to-zero groups to sleep and wake those a router asked for
        (``tessera.control.scale_to_zero``); the plan's replicas and the children follow."""
        key = (namespace, decided.pool.name)
        plan = decided.plan
        if plan is None:
            self._sleep_due[key] = math.inf
            return decided, SleepStep({}, ())
        idle_after = {
            g.name: unit_idle_after([m.policy for m in scale_to_zero_models(g, decided.services).values()])
            for g in plan.groups
        }
        ready = {
            g["name"]: int(g.get("readyReplicas") or 0)
            for g in (status.get("placement") or {}).get("groups") or []
            if isinstance(g, Mapping) and "name" in g
        }
        asked: dict[str, float] = {}
        for b in service_bodies:
            when = wake_request(b.get("status"))
            for g in plan.groups_of(str(b["metadata"]["name"])) if when is not None else []:
                asked[g.name] = max(asked.get(g.name, when), when)
        idle: dict[str, bool | None] = {}
        for g in plan.groups:
            after, was = idle_after[g.name], previous.get(g.name)
            awake_since = was.since if was is not None and was.state is UnitState.READY else None
            if (
                after is not None
                and self.metrics is not None
                and awake_since is not None
                and now - awake_since >= after
            ):
                idle[g.name] = self.metrics.idle(namespace, decided.pool.name, g.name, after)
        step = step_sleep(
            plan.groups, idle_after, previous, idle, asked, ready, decided.pool.spec.instances.min, now
        )
        for reason, message in step.events:
            self.emit(body, "Normal", reason, message)
        self._sleep_due[key] = now + SLEEP_POLL_S if step.groups else math.inf
        slept = step.apply(plan)
        if slept.groups == plan.groups:
            return decided, step
        children = desired_children(decided.pool, slept.groups, decided.services, decided.configs, namespace)
        return replace(decided, plan=slept, children=children), step

    def _apply(
        self,
        namespace: str,
        body: Mapping[str, Any],
        decided: PoolDesired,
        status: Mapping[str, Any],
        now: float,
    ) -> st.Observed:
        """Apply the pool's children; returns the children of the pool observed before (their status is
        what the report reads: objects created or patched now have no newer status yet), the groups the
        plan no longer has and the objects in the way that the operator did not create. Groups still
        handing their services over stay as they are: their objects count as desired unchanged."""
        listed = self.kube.list_children(namespace, pool_labels(decided.pool.name))
        pool_uid = str(body.get("metadata", {}).get("uid") or "")
        wanted, observed, conflicts = claim(decided.children, listed, pool_uid)
        retiring: list[Retiring] = []
        if decided.plan is not None:
            since = {
                r.get("name"): st.parse_time(r.get("since"))
                for r in (status.get("placement") or {}).get("retiring") or []
            }
            timeout = decided.pool.spec.placement.handover_timeout_seconds
            retiring = retiring_groups(
                decided.plan, observed, {g: t for g, t in since.items() if t is not None}, now, timeout
            )
        held = {r.group for r in retiring if r.held}
        kept = [o for o in observed if (o["metadata"].get("labels") or {}).get(GROUP_LABEL) in held]
        refused: list[str] = []
        for action in plan_actions([*wanted, *kept], observed):
            where = (namespace, action.kind, action.name)
            if action.body is not None and self._refused.get(where) == action.body:
                refused.append(f"{action.kind} {action.name}: {self._refused_messages[where]}")
                continue
            try:
                self.kube.apply(namespace, action)
            except OwnershipError as error:
                conflicts.append(error.conflict)
                continue
            except Exception as error:
                message = rejection(error)
                if message is None or action.body is None:
                    raise
                self._refused[where], self._refused_messages[where] = action.body, message
                refused.append(f"{action.kind} {action.name}: {message}")
                continue
            self._refused.pop(where, None)
            self.emit(body, "Normal", DONE[action.verb], f"{action.kind} {action.name}")
        for r in retiring:
            if r.held:
                continue
            if r.timed_out and r.waiting_for:
                message = (
                    f"group {r.group} removed after the handover timeout "
                    f"({decided.pool.spec.placement.handover_timeout_seconds} s); "
                    f"{list(r.waiting_for)} not all ready yet"
                )
                self.emit(body, "Warning", "HandoverTimedOut", message)
            else:
                self.emit(
                    body, "Normal", "Retired", f"group {r.group} removed: its services are served elsewhere"
                )
        key = (namespace, decided.pool.name)
        self._handover_due[key] = now + HANDOVER_POLL_S if held else math.inf
        return st.Observed(observed, retiring, conflicts, refused)

    def _autoscale(
        self,
        namespace: str,
        body: Mapping[str, Any],
        decided: PoolDesired,
        history: list[dict[str, Any]],
        now: float,
        skip: set[str],
    ) -> tuple[PoolDesired, list[dict[str, Any]]]:
        """One Chiron evaluation per group that is due, but those in ``skip`` (asleep or waking: no
        measurements); changed counts replace the plan's."""
        assert decided.plan is not None and self.metrics is not None
        pool = decided.pool
        groups: list[GroupPlan] = []
        entries: list[dict[str, Any]] = []
        interval = pool.spec.autoscaling.interval_seconds
        keys: list[tuple[str, str, str]] = []
        unmeasured = self._unmeasured.setdefault((namespace, pool.name), set())
        # A group gone from the plan, or asleep, waits for no measurement.
        unmeasured &= {g.name for g in decided.plan.groups if g.name not in skip}
        for group in decided.plan.groups:
            if group.name in skip:
                groups.append(group)
                continue
            key = (namespace, pool.name, group.name)
            keys.append(key)
            memory = self._scalers.setdefault(key, GroupMemory(_state_from_history(history, group.name)))
            scaling = group_scaling(decided, group)
            if not memory.due(scaling.settings, now):
                groups.append(group)
                continue
            snapshot = self.metrics.snapshot(
                namespace, pool.name, group, scaling.kinds, scaling.deadlines, now, scaling.models
            )
            if snapshot is None:
                unmeasured.add(group.name)
            else:
                unmeasured.discard(group.name)
            step = evaluate_group(snapshot, memory, scaling.settings, now)
            self._scalers[key] = step.memory
            if step.decision is not None and step.changed(group.replicas):
                desired = step.decision.desired
                entries += st.history_entries(group.name, group.replicas, desired, step.reason, now)
                self.emit(
                    body,
                    "Normal",
                    "Scaled",
                    f"group {group.name}: {group.replicas.short()} -> {desired.short()}: {step.reason}",
                )
                group = replace(group, replicas=desired)
            groups.append(group)
        # A group without a measurement yet (last_eval -inf) keeps the pool due at every tick.
        self._autoscale_due[(namespace, pool.name)] = min(
            (self._scalers[k].last_eval + interval for k in keys), default=math.inf
        )
        plan = replace(decided.plan, groups=tuple(groups))
        children = decided.children
        if entries:
            children = desired_children(pool, plan.groups, decided.services, decided.configs, namespace)
        return replace(decided, plan=plan, children=children), st.append_history(
            history, entries, SCALING_HISTORY_LENGTH
        )

    def cleanup_pool(self, namespace: str, name: str, uid: str) -> int:
        """Delete every child of a pool being deleted (``uid``: the pool's) that the pool owns or marked
        as its own; returns how many were deleted.

        Owner references let the garbage collector do this too; doing it here makes the cleanup
        immediate and visible in events, and works where no collector runs.
        """
        _, mine, _ = claim([], self.kube.list_children(namespace, pool_labels(name)), uid)
        actions = plan_actions([], mine)
        for action in actions:
            self.kube.apply(namespace, action)
        for key in [k for k in list(self._scalers) if k[:2] == (namespace, name)]:
            del self._scalers[key]
        self._last_sync.pop((namespace, name), None)
        self._autoscale_due.pop((namespace, name), None)
        self._unmeasured.pop((namespace, name), None)
        self._placement_due.pop((namespace, name), None)
        self._handover_due.pop((namespace, name), None)
        return len(actions)


def _sleeps_from_status(status: Mapping[str, Any]) -> dict[str, GroupSleep]:
    """The scale-to-zero states kept in ``status.scaleToZero`` (entries that do not read are dropped:
    their groups count as awake)."""
    out = {}
    for entry in status.get("scaleToZero") or []:
        sleep = GroupSleep.from_status(entry) if isinstance(entry, Mapping) else None
        if sleep is not None:
            out[sleep.group] = sleep
    return out


def _unplaced(status: Mapping[str, Any]) -> dict[str, Problem]:
    """The placement problems of the plan in effect (status.placement.unplaced), by service name."""
    entries = (status.get("placement") or {}).get("unplaced") or []
    return {
        e["name"]: Problem(str(e.get("reason", "")), str(e.get("message", "")))
        for e in entries
        if isinstance(e, Mapping) and isinstance(e.get("name"), str)
    }


def _interval_field(body: Mapping[str, Any], field: str, default: float, *, zero_ok: bool = False) -> float:
    """One number of the pool body's replacementInterval, read raw (the pass validates the spec after):
    ``default`` where it is unset, not a number, negative, or 0 unless ``zero_ok``."""
    spec = ((body.get("spec") or {}).get("placement") or {}).get("replacementInterval") or {}
    value = spec.get(field)
    if isinstance(value, int | float) and (value > 0 or (zero_ok and value == 0)):
        return float(value)
    return default


def _shift_watch(body: Mapping[str, Any]) -> tuple[float, float]:
    """The pool body's replacementInterval loadShiftThreshold and minSeconds."""
    defaults = ReplacementInterval()
    return (
        _interval_field(body, "loadShiftThreshold", defaults.load_shift_threshold, zero_ok=True),
        max(1.0, _interval_field(body, "minSeconds", defaults.min_seconds, zero_ok=True)),
    )


def _initial_interval(body: Mapping[str, Any]) -> float:
    """The pool body's replacementInterval.initialSeconds."""
    return _interval_field(body, "initialSeconds", IntervalSettings().initial_s)


def _keep_unchanged(decided: PoolDesired, previous: PlacementPlan) -> PoolDesired:
    """Between boundaries a re-plan (a spec changed) that gives the groups in effect keeps the plan in
    effect and its estimate, which the next boundary compares (the services' loads still show what the
    specs now declare)."""
    if decided.plan is None or decided.plan.groups != previous.groups:
        return decided
    return replace(decided, plan=previous)
