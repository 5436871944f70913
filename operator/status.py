"""The status of the three resources: pure bookkeeping (conditions with transition times, scaling
history, the plan as status JSON) and the reporter that writes what each reconcile pass decided and saw
into the status and events of a pool, its services and their classes."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tessera.api.serving_pool import SCALING_HISTORY_LENGTH, ReplacementInterval, ServingPool
from tessera.api.times import parse_time as parse_time  # the operator reads status times through here
from tessera.api.times import rfc3339 as rfc3339
from tessera.control.children import GROUP_LABEL, endpoint_url, worker_engine
from tessera.control.pool_plan import (
    POOL_NOT_FOUND,
    PoolDesired,
    Problem,
    Retiring,
    parse,
    parse_classes,
    pool_ref,
)
from tessera.control.scale_to_zero import SleepStep, service_state
from tessera.core.activation import UnitState
from tessera.core.planners import (
    ROLES,
    GroupPlan,
    IntervalMetrics,
    IntervalSettings,
    PlacementPlan,
    RoleCounts,
    next_replacement_interval,
    parse_roles,
    rollout_diff,
)
from tessera.core.planners.replacement import prediction_error
from tessera.core.sharing import sharing_mode
from tessera.operator.kube import Kube
from tessera.operator.reconcile import Conflict, contains

log = logging.getLogger(__name__)

READY = "Ready"
PLACED = "Placed"
SCALED = "Scaled"
INVALID = "Invalid"


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: float,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """``conditions`` with the condition ``type_`` set; lastTransitionTime moves only when its status
    changes (metav1.Condition semantics). The other conditions keep their order and values."""
    value = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for condition in conditions:
        if condition.get("type") != type_:
            out.append(dict(condition))
            continue
        found = True
        changed = condition.get("status") != value
        since = rfc3339(now) if changed else condition.get("lastTransitionTime") or rfc3339(now)
        out.append(_condition(type_, value, reason, message, since, generation))
    if not found:
        out.append(_condition(type_, value, reason, message, rfc3339(now), generation))
    return out


def _condition(
    type_: str, value: str, reason: str, message: str, since: str, generation: int | None
) -> dict[str, Any]:
    condition = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def condition_status(conditions: Sequence[Mapping[str, Any]], type_: str) -> str | None:
    """The status ("True"/"False"/"Unknown") of one condition, None when it is not set."""
    return next((c.get("status") for c in conditions if c.get("type") == type_), None)


def append_history(
    history: Sequence[Mapping[str, Any]],
    entries: Sequence[Mapping[str, Any]],
    limit: int = SCALING_HISTORY_LENGTH,
) -> list[dict[str, Any]]:
    """The scaling history with ``entries`` appended, keeping the last ``limit`` (oldest first)."""
    return [dict(h) for h in (*history, *entries)][-limit:] if limit > 0 else []


def history_entries(
    group: str, before: RoleCounts, after: RoleCounts, reason: str, now: float
) -> list[dict[str, Any]]:
    """One ScalingDecision entry per role whose instance count changed."""
    return [
        {
            "time": rfc3339(now),
            "group": group,
            "role": role,
            "fromReplicas": before.get(role),
            "toReplicas": after.get(role),
            "reason": reason,
        }
        for role in ROLES
        if before.get(role) != after.get(role)
    ]


def plan_to_status(
    plan: PlacementPlan,
    ready: Mapping[str, int],
    batch_sizes: Mapping[str, int] | None = None,
    modes: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The plan as the ServingPool's ``status.placement`` JSON; ``ready`` maps group name to ready pods,
    ``batch_sizes`` group name to the batch size its workers report (a measurement, not part of the
    plan: ``plan_from_status`` does not read it back), ``modes`` group name to how its pods share
    their accelerator between models (``sharing_modes``)."""
    batch_sizes = batch_sizes or {}
    modes = modes or {}
    status: dict[str, Any] = {
        "strategy": plan.strategy,
        "groups": [
            {
                "name": g.name,
                "services": list(g.services),
                "tensorParallelSize": g.tp,
                "replicas": {r: g.replicas.get(r) for r in ROLES},
                "roles": list(g.roles),
                "readyReplicas": ready.get(g.name, 0),
                **({"batchSize": batch_sizes[g.name]} if g.name in batch_sizes else {}),
                **({"sharing": modes[g.name]} if g.name in modes else {}),
            }
            for g in plan.groups
        ],
    }
    if plan.estimated_slo_attainment is not None:
        status["estimatedSloAttainment"] = plan.estimated_slo_attainment
    if plan.estimated_norm_latency is not None:
        status["estimatedNormLatency"] = plan.estimated_norm_latency
    return status


def sharing_modes(pool: ServingPool, plan: PlacementPlan) -> dict[str, str]:
    """Group name -> ``single``, ``co-resident`` or ``swapping`` (``tessera.core.sharing``), as the
    group's pods run it: the one function the worker configuration and the estimator ask."""
    sleeps = worker_engine(pool) == "vllm"
    return {g.name: sharing_mode(len(g.services), sleeps) for g in plan.groups}


def plan_from_status(placement: Mapping[str, Any] | None) -> PlacementPlan | None:
    """The plan stored in ``status.placement`` (written by ``plan_to_status``); None when absent or
    unreadable, in which case the caller plans afresh."""
    if not placement or not placement.get("strategy"):
        return None
    try:
        groups = tuple(
            GroupPlan(
                name=str(g["name"]),
                services=tuple(str(s) for s in g["services"]),
                tp=int(g.get("tensorParallelSize", 1)),
                replicas=RoleCounts(**{r: int(g.get("replicas", {}).get(r, 0)) for r in ROLES}),
                roles=parse_roles(g.get("roles", [])),
            )
            for g in placement.get("groups", [])
        )
    except (KeyError, TypeError, ValueError):
        return None
    return PlacementPlan(
        strategy=str(placement["strategy"]),
        groups=groups,
        estimated_slo_attainment=placement.get("estimatedSloAttainment"),
        estimated_norm_latency=placement.get("estimatedNormLatency"),
    )


POOLS, SERVICES, CLASSES = "servingpools", "llmservices", "requestclasses"
# Ready's reason while an object the operator did not create holds a child's name.
OWNERSHIP_CONFLICT = "OwnershipConflict"
# Invalid's reason while the API server refuses a child the specs produce (422: e.g. a name or a field
# value the server's own validation rejects).
REJECTED_BY_SERVER = "RejectedByServer"
# The Scaled condition's reason while a due autoscaler evaluation found no measurements (counts held).
NO_MEASUREMENTS = "NoMeasurements"
# The Warning event's reason when a re-placement boundary waits for Prometheus.
REPLACEMENT_DEFERRED = "ReplacementDeferred"
# (object body, event type "Normal"/"Warning", reason, message)
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


class StatusMetrics(Protocol):
    """What the status reads of the measurements (the operator's MetricsSource)."""

    def attainment(self, namespace: str, pool: str, model: str) -> list[dict[str, Any]] | None:
        """Measured SLO attainment per class of one served model (ClassAttainment JSON); None if unknown."""
        ...

    def batch_sizes(self, namespace: str, pool: str) -> dict[str, int] | None:
        """Each placement group's batch size as its workers report it, by group name; None if unknown."""
        ...


@dataclass(frozen=True, slots=True)
class Timeline:
    """What a pass knows of the re-placement timeline: whether a boundary was reached, what the interval
    ending there measured (M_real, over how many requests) and over how many seconds, and whether a
    boundary is due but waits for measurements (Prometheus did not answer)."""

    boundary: bool
    measured: IntervalMetrics | None
    finished: int  # requests the interval finished
    window_s: float | None
    deferred: bool = False


@dataclass(frozen=True, slots=True)
class Observed:
    """The pool's own children as listed before this pass applied anything, the groups no longer in
    the plan, the objects holding a child's name that the operator did not create, and the children
    the API server refused."""

    children: list[Mapping[str, Any]]
    retiring: list[Retiring]
    conflicts: list[Conflict]
    refused: list[str]  # "<kind> <name>: <the API server's message>" of children refused as invalid


class StatusReporter:
    """Writes what each pass decided and saw into the status and events of the pool, its services and
    their classes (only what changed is patched)."""

    def __init__(self, kube: Kube, emit: EventSink, metrics: StatusMetrics | None) -> None:
        self.kube = kube
        self.emit = emit
        self.metrics = metrics

    def report_invalid(self, plural: str, body: Mapping[str, Any], problem: Problem, now: float) -> None:
        meta = body.get("metadata", {})
        conditions = list((body.get("status") or {}).get("conditions") or [])
        was_invalid = condition_status(conditions, INVALID) == "True"
        conditions = set_condition(conditions, INVALID, True, problem.reason, problem.message, now)
        conditions = set_condition(conditions, READY, False, problem.reason, problem.message, now)
        self.kube.patch_status(plural, meta.get("namespace"), meta["name"], {"conditions": conditions})
        previous_message = next(
            (
                c.get("message")
                for c in (body.get("status") or {}).get("conditions") or []
                if c.get("type") == INVALID
            ),
            None,
        )
        if not was_invalid or previous_message != problem.message:
            self.emit(body, "Warning", problem.reason, problem.message)

    def report_pool(
        self,
        namespace: str,
        body: Mapping[str, Any],
        service_bodies: list[dict[str, Any]],
        seen: Observed,
        decided: PoolDesired,
        previous: PlacementPlan | None,
        history: list[dict[str, Any]],
        timeline: Timeline,
        sleeps: SleepStep,
        fingerprint: str,
        unmeasured: Sequence[str],
        now: float,
    ) -> float:
        """Report a pass over the pool and its services; ``unmeasured``: the groups (sorted) whose due
        autoscaler evaluation found no measurements. Returns when the next re-placement boundary is due."""
        pool = decided.pool
        status = dict(body.get("status") or {})
        conditions = list(status.get("conditions") or [])
        ready = {
            (o["metadata"].get("labels") or {}).get(GROUP_LABEL, ""): int(
                (o.get("status") or {}).get("readyReplicas") or 0
            )
            for o in seen.children
            if o["kind"] == "StatefulSet"
        }
        unplaced = {n: p for n, p in decided.rejected.items() if p.unplaced}
        held = [r for r in seen.retiring if r.held]
        plan = decided.plan
        conditions = set_condition(conditions, INVALID, False, "Valid", "spec is valid", now)
        if decided.placement_problem:
            conditions = set_condition(
                conditions, PLACED, False, "PlacementFailed", decided.placement_problem, now
            )
            if condition_status(status.get("conditions") or [], PLACED) != "False":
                self.emit(body, "Warning", "PlacementFailed", decided.placement_problem)
        elif plan is not None:
            summary = ", ".join(f"{g.name}: {'+'.join(g.services)} x{g.replicas.total}" for g in plan.groups)
            message = f"{plan.strategy} placement: {summary or 'no services'}"
            if unplaced:
                message += f"; not placed: {sorted(unplaced)} (see their Placed conditions)"
            shared = [g.name for g in plan.groups if len(g.services) > 1]
            if shared and plan.strategy == "seallm":
                # Known gap, said where the user looks: the estimate plays a shared group under SeaLLM's
                # DB across its models, while each model of a pod keeps its own scheduler and the
                # models take turns drain-then-swap where vLLM can sleep.
                message += (
                    f"; shared groups {shared}: the estimate assumes SeaLLM's sharing across their models, "
                    "which the pods do not run (each model has its own scheduler), so it may be optimistic"
                )
            reason = "PartiallyPlaced" if unplaced else "Placed"
            if timeline.deferred:
                note = (
                    f"; the re-placement boundary due at {status.get('nextPlacementTime')} waits for "
                    "measurements: Prometheus did not answer, or not yet for a whole window since it failed "
                    "(the plan in effect stays; each pass asks again)"
                )
                message += note
                before = next((c for c in status.get("conditions") or [] if c.get("type") == PLACED), {})
                if not str(before.get("message", "")).endswith(note):
                    self.emit(body, "Warning", REPLACEMENT_DEFERRED, note.removeprefix("; "))
            conditions = set_condition(conditions, PLACED, True, reason, message, now)
            if previous is None or {g.key for g in previous.groups} != {g.key for g in plan.groups}:
                self.emit(body, "Normal", "Placed", message)
                if previous is not None:
                    self.emit(body, "Normal", "Rollout", rollout_churn(previous, plan, held))
        replicas = sum(g.replicas.total for g in plan.groups) if plan else 0
        ready_total = sum(ready.get(g.name, 0) for g in plan.groups) if plan else 0
        autoscaling = pool.spec.autoscaling.enabled
        scaled_reason = ("Autoscaled" if self.metrics else "NoMetrics") if autoscaling else "Fixed"
        if scaled_reason == "Autoscaled" and unmeasured:
            scaled_reason = NO_MEASUREMENTS
        scaled_message = {
            "Autoscaled": "Chiron global autoscaler sets instance counts from Prometheus",
            NO_MEASUREMENTS: f"the autoscaler has no measurements of group(s) {', '.join(unmeasured)}: "
            "Prometheus did not answer, or has not scraped their pods yet; their instance counts stay as "
            "they are until it measures again",
            "NoMetrics": "autoscaling is on but the operator has no --prometheus-url: counts are the plan's",
            "Fixed": "autoscaling is off: counts are instances.desired or the plan's",
        }[scaled_reason]
        scaled = scaled_reason in ("Autoscaled", "Fixed")
        conditions = set_condition(conditions, SCALED, scaled, scaled_reason, scaled_message, now)
        cold = sleeps.cold()
        # A pool whose every group is scaled to zero serves: the router holds and wakes.
        asleep = plan is not None and bool(plan.groups) and all(g.name in cold for g in plan.groups)
        is_ready = plan is not None and (replicas > 0 or asleep) and ready_total >= replicas
        message = f"{ready_total}/{replicas} instances ready"
        if cold:
            message += f"; scaled to zero (the router wakes them on a request): {sorted(cold)}"
        conditions = set_condition(
            conditions,
            READY,
            is_ready,
            ("ScaledToZero" if asleep else "AllInstancesReady") if is_ready else "InstancesNotReady",
            message,
            now,
        )
        if seen.conflicts:
            message = "; ".join(c.describe(namespace) for c in seen.conflicts)
            conditions = self._report_problem(body, status, conditions, OWNERSHIP_CONFLICT, message, now)
        if seen.refused:
            message = (
                f"the API server refused {'; '.join(seen.refused)}; change the ServingPool or LLMService "
                "spec (the operator sends these objects again only once the spec changes)"
            )
            conditions = self._report_problem(
                body, status, conditions, REJECTED_BY_SERVER, message, now, invalid=True
            )
        replanned = (
            previous is None
            or plan is None
            or {g.key for g in previous.groups} != {g.key for g in plan.groups}
        )
        last_placement = (
            status.get("lastPlacementTime") if not (replanned or timeline.boundary) else rfc3339(now)
        )
        batch_sizes = self.metrics.batch_sizes(namespace, pool.name) if self.metrics else None
        if batch_sizes is None:  # unknown now: keep what the status shows
            batch_sizes = {
                g["name"]: g["batchSize"]
                for g in (status.get("placement") or {}).get("groups") or []
                if "batchSize" in g
            }
        placement = (
            plan_to_status(plan, ready, batch_sizes, sharing_modes(pool, plan)) if plan else {"groups": []}
        )
        placement["unplaced"] = [
            {"name": n, "reason": p.reason, "message": p.message} for n, p in sorted(unplaced.items())
        ]
        placement["retiring"] = [
            {
                "name": r.group,
                "services": list(r.services),
                "waitingFor": list(r.waiting_for),
                "since": rfc3339(r.since),
            }
            for r in held
        ]
        new_status: dict[str, Any] = {
            "conditions": conditions,
            "placement": placement,
            "replicas": replicas,
            "readyReplicas": ready_total,
            "selector": f"tessera.dev/pool={pool.name}",
            "scalingHistory": history,
            "scaleToZero": [sleeps.groups[g].to_status() for g in sorted(sleeps.groups)],
            **self._interval_status(status, pool.spec.placement.replacement_interval, previous, timeline),
            "lastPlacementTime": last_placement or rfc3339(now),
            "inputsDigest": fingerprint,
        }
        next_placement = (parse_time(last_placement) or now) + new_status["replacementIntervalSeconds"]
        new_status["nextPlacementTime"] = rfc3339(next_placement)
        generation = body.get("metadata", {}).get("generation")
        if generation is not None:
            new_status["observedGeneration"] = generation
        if would_change(status, new_status):
            self.kube.patch_status(POOLS, namespace, pool.name, new_status)
        self._report_services(namespace, service_bodies, decided, ready, seen, sleeps, now)
        return next_placement

    def _report_problem(
        self,
        body: Mapping[str, Any],
        status: Mapping[str, Any],
        conditions: list[dict[str, Any]],
        reason: str,
        message: str,
        now: float,
        invalid: bool = False,
    ) -> list[dict[str, Any]]:
        """``conditions`` with Ready=False (and, when ``invalid``, Invalid=True) for ``reason`` and
        ``message``; a Warning event when the message is new."""
        watched = INVALID if invalid else READY
        before = next((c for c in status.get("conditions") or [] if c.get("type") == watched), {})
        if (before.get("reason"), before.get("message")) != (reason, message):
            self.emit(body, "Warning", reason, message)
        if invalid:
            conditions = set_condition(conditions, INVALID, True, reason, message, now)
        return set_condition(conditions, READY, False, reason, message, now)

    def _interval_status(
        self,
        status: Mapping[str, Any],
        spec: ReplacementInterval,
        previous: PlacementPlan | None,
        timeline: Timeline,
    ) -> dict[str, Any]:
        """SeaLLM Eq. 8 at a boundary: the plan in effect's estimate against what its interval measured
        sets the next interval (unchanged without a measurement or an estimate); between boundaries the
        interval stays (I_0 at first, clamped to the spec's bounds)."""
        settings = IntervalSettings(spec.initial_seconds, spec.min_seconds, spec.max_seconds, spec.beta)
        current = status.get("replacementIntervalSeconds")
        if not timeline.boundary:
            return {"replacementIntervalSeconds": next_replacement_interval(current, None, None, settings)}
        estimated = (
            IntervalMetrics(previous.estimated_slo_attainment, previous.estimated_norm_latency)
            if previous is not None
            and previous.estimated_slo_attainment is not None
            and previous.estimated_norm_latency is not None
            else None
        )
        real = timeline.measured
        out: dict[str, Any] = {
            "replacementIntervalSeconds": next_replacement_interval(current, estimated, real, settings)
        }
        if real is not None and timeline.window_s:
            out["measured"] = {
                "sloAttainment": real.slo_attainment,
                "normLatency": real.norm_latency,
                "requests": timeline.finished,
                "windowSeconds": timeline.window_s,
            }
            error = prediction_error(estimated, real) if estimated is not None else math.inf
            if math.isfinite(error):  # an estimate of 0 has no relative error (JSON has no infinity)
                out["estimateError"] = error
        log.info(
            "re-placement boundary: estimate %s, measured %s, interval %s -> %.1f s",
            estimated,
            real,
            current,
            out["replacementIntervalSeconds"],
        )
        return out

    def _report_services(
        self,
        namespace: str,
        service_bodies: list[dict[str, Any]],
        decided: PoolDesired,
        ready: Mapping[str, int],
        seen: Observed,
        sleeps: SleepStep,
        now: float,
    ) -> None:
        held = [r for r in seen.retiring if r.held]
        bodies = {b["metadata"]["name"]: b for b in service_bodies if pool_ref(b) == decided.pool.name}
        for name, problem in decided.rejected.items():
            if name in bodies:
                self._report_service_problem(bodies[name], problem, now)
        plan = decided.plan
        for name, service in decided.services.items():
            body = bodies.get(name)
            if body is None:
                continue
            groups = plan.groups_of(decided.placed_as(name)) if plan else []
            replicas = sum(g.replicas.total for g in groups)
            ready_count = sum(ready.get(g.name, 0) for g in groups)
            status = dict(body.get("status") or {})
            conditions = list(status.get("conditions") or [])
            conditions = set_condition(conditions, INVALID, False, "Valid", "spec is valid", now)
            placed = bool(groups)
            conditions = set_condition(
                conditions,
                PLACED,
                placed,
                "Placed" if placed else "NotPlaced",
                f"in groups {[g.name for g in groups]}"
                if placed
                else (decided.placement_problem or "no plan"),
                now,
            )
            # A moved service's old groups serve it until its new groups are ready.
            handing_over = sum(ready.get(r.group, 0) for r in held if name in r.services)
            state = service_state([g.name for g in groups], sleeps.groups, ready)
            # Scaled to zero, a service still serves: the router holds its requests and wakes it.
            is_ready = placed and (ready_count + handing_over > 0 or state is not UnitState.READY)
            message = f"{ready_count}/{replicas} replicas ready"
            if handing_over:
                message += f", and {handing_over} in groups of the previous placement until then"
            if state is not UnitState.READY:
                message += f"; {state.lower()}: the router holds its requests until a replica is ready"
            reason = (
                ("Serving" if state is UnitState.READY else state.value) if is_ready else "NoReadyReplicas"
            )
            conditions = set_condition(conditions, READY, is_ready, reason, message, now)
            mine = [c for c in seen.conflicts if c.owner == f"LLMService {name}"]
            if mine:  # its endpoint Service's name is taken
                message = "; ".join(c.describe(namespace) for c in mine)
                conditions = self._report_problem(body, status, conditions, OWNERSHIP_CONFLICT, message, now)
            has_batch = any(
                c.name in decided.classes and decided.classes[c.name].kind == "batch"
                for c in service.spec.request_classes
            )
            new_status: dict[str, Any] = {
                "conditions": conditions,
                "placement": [
                    {"group": g.name, "replicas": g.replicas.total, "tensorParallelSize": g.tp}
                    for g in groups
                ],
                "replicas": replicas,
                "readyReplicas": ready_count,
                "endpoint": endpoint_url(name, namespace),
                "policy": service.spec.scheduling.resolved_policy(has_batch),
                "state": state.value,
            }
            if mine:  # the Service of that name is not this service's: never point clients at it
                del new_status["endpoint"]
                if "endpoint" in status:
                    new_status["endpoint"] = None  # a merge patch's null removes it
            if name in decided.loads:
                new_status["load"] = decided.loads[name].to_status()
            measured = (
                self.metrics.attainment(namespace, decided.pool.name, service.spec.model.name)
                if self.metrics
                else None
            )
            # measuredAt moves only with the figures: an idle service's status is not patched every pass.
            if measured and measured != status.get("sloAttainmentByClass"):
                total = sum(c.get("requests", 0) for c in measured)
                new_status["sloAttainmentByClass"] = measured
                if total:
                    new_status["sloAttainment"] = (
                        sum(c["attainment"] * c.get("requests", 0) for c in measured) / total
                    )
                new_status["measuredAt"] = rfc3339(now)
            if would_change(status, new_status):
                self.kube.patch_status(SERVICES, namespace, name, new_status)

    def _report_service_problem(self, body: Mapping[str, Any], problem: Problem, now: float) -> None:
        if problem.invalid:
            self.report_invalid(SERVICES, body, problem, now)
            return
        meta = body["metadata"]
        status = dict(body.get("status") or {})
        conditions = list(status.get("conditions") or [])
        before = next((c for c in conditions if c.get("type") == READY), {})
        conditions = set_condition(conditions, INVALID, False, "Valid", "spec is valid", now)
        conditions = set_condition(conditions, PLACED, False, problem.reason, problem.message, now)
        conditions = set_condition(conditions, READY, False, problem.reason, problem.message, now)
        new_status = {"conditions": conditions, "replicas": 0, "readyReplicas": 0, "placement": []}
        if would_change(status, new_status):
            self.kube.patch_status(SERVICES, meta.get("namespace"), meta["name"], new_status)
        if (before.get("status"), before.get("reason"), before.get("message")) != (
            "False",
            problem.reason,
            problem.message,
        ):
            self.emit(body, "Warning", problem.reason, problem.message)

    def report_unplaced_service(self, body: Mapping[str, Any], now: float) -> None:
        """Report an LLMService whose pool does not exist: invalid, or waiting for the pool."""
        try:
            parse(body)
        except Exception as err:  # SpecError; any parse failure is the spec's fault
            self.report_invalid(SERVICES, body, Problem("InvalidSpec", str(err)), now)
            return
        namespace = body.get("metadata", {}).get("namespace")
        self._report_service_problem(
            body,
            Problem(
                POOL_NOT_FOUND,
                f"ServingPool {pool_ref(body)!r} not found in namespace {namespace!r}; create it",
            ),
            now,
        )

    def report_class(self, body: Mapping[str, Any], users: list[str], now: float) -> None:
        """Report a RequestClass's validity and the LLMServices naming it (``users``)."""
        name = body["metadata"]["name"]
        _, problems = parse_classes([body])
        if name in problems:
            self.report_invalid(CLASSES, body, problems[name], now)
            return
        status = dict(body.get("status") or {})
        conditions = set_condition(
            list(status.get("conditions") or []), INVALID, False, "Valid", "spec is valid", now
        )
        conditions = set_condition(conditions, READY, True, "Valid", f"used by {len(users)}", now)
        new_status = {"conditions": conditions, "usedBy": users}
        if would_change(status, new_status):
            self.kube.patch_status(CLASSES, body["metadata"].get("namespace"), name, new_status)


def rollout_churn(previous: PlacementPlan, plan: PlacementPlan, held: list[Retiring]) -> str:
    """A re-placement's churn for the pool's Rollout event (the groups compared as the simulator's
    re-placements compare them, ``rollout_diff``)."""
    diff = rollout_diff(previous, plan)
    message = (
        f"groups kept {list(diff.keep)}, created {[g.name for g in diff.create]}, retiring "
        f"{list(diff.delete)}; services moved {list(diff.moved_services)}"
    )
    for r in held:
        message += f"; {r.group} serves {list(r.services)} until {list(r.waiting_for)} are ready"
    return message


def would_change(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether patching ``new`` would change ``current`` (so an idle reconcile writes nothing)."""
    return not contains(dict(current), dict(new))
