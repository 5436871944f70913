"""Pure decisions of one pool reconcile: which specs are valid, the plan, the instance counts, the children.

Input is what the API server holds (raw bodies) plus the plan in effect; output is everything the
operator should make true. No I/O and no clock: ``now`` is an argument.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.api import LLMService, RequestClass, RequestClassSpec, ServingPool, SpecError, parse_document
from tessera.api.worker_config import WorkerConfig
from tessera.control.children import ChildError, desired_children, group_configs
from tessera.control.inputs import ServiceLoad, chiron_settings, pool_input, service_inputs, service_load
from tessera.control.metrics_queries import ModelLoad
from tessera.control.placement import PlacementError, plan_placement
from tessera.core.planners import (
    ChironSettings,
    GroupPlan,
    PlacementPlan,
    RoleCounts,
    ServiceInput,
)

# Reasons used in conditions and events.
INVALID_SPEC = "InvalidSpec"
CLASS_NOT_FOUND = "RequestClassNotFound"
POOL_NOT_FOUND = "PoolNotFound"
PLACEMENT_FAILED = "PlacementFailed"
DUPLICATE_MODEL = "DuplicateModel"


def spec_only(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a body the API models validate: status is the operator's own output."""
    meta = dict(body.get("metadata") or {})
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": meta,
        "spec": body.get("spec"),
    }


def parse(body: Mapping[str, Any]) -> Any:
    """A body as its API model; raises SpecError saying which fields are wrong and what is allowed."""
    kind = body.get("kind", "object")
    name = (body.get("metadata") or {}).get("name", "?")
    return parse_document(spec_only(body), where=f"{kind} {name!r}")


def deleting(body: Mapping[str, Any]) -> bool:
    """Whether an object is being deleted (it no longer counts as desired)."""
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def pool_ref(body: Mapping[str, Any]) -> str | None:
    """The pool an LLMService body names, read without validation (an invalid service still belongs
    to its pool for reporting)."""
    spec = body.get("spec")
    ref = spec.get("poolRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class Problem:
    """Why an object is not served: a condition reason and a message that says how to fix it."""

    reason: str
    message: str

    @property
    def invalid(self) -> bool:
        """Whether the object's own spec is at fault (the Invalid condition)."""
        return self.reason == INVALID_SPEC


def parse_classes(
    bodies: Iterable[Mapping[str, Any]],
) -> tuple[dict[str, RequestClassSpec], dict[str, Problem]]:
    """Valid RequestClass specs by name, and the problems of the invalid ones."""
    valid: dict[str, RequestClassSpec] = {}
    problems: dict[str, Problem] = {}
    for body in bodies:
        if deleting(body):
            continue
        name = (body.get("metadata") or {}).get("name", "?")
        try:
            resource = parse(body)
        except SpecError as err:
            problems[name] = Problem(INVALID_SPEC, str(err))
            continue
        assert isinstance(resource, RequestClass)
        valid[name] = resource.spec
    return valid, problems


@dataclass(frozen=True)
class PoolDesired:
    """What a pool reconcile should make true."""

    pool: ServingPool
    services: dict[str, LLMService]  # the pool's valid services, placed by ``plan``
    classes: dict[str, RequestClassSpec]
    rejected: dict[str, Problem] = field(default_factory=dict)  # the pool's services left out, by name
    plan: PlacementPlan | None = None
    placement_problem: str | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    configs: dict[str, WorkerConfig] = field(default_factory=dict)  # group name -> its worker configuration
    # What a new plan was planned from, by service name (empty when the plan in effect was kept).
    loads: dict[str, ServiceLoad] = field(default_factory=dict)
    inputs: dict[str, ServiceInput] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GroupScaling:
    """What the global autoscaler of one placement group reads besides measurements."""

    kinds: dict[str, str]  # accepted class name -> "interactive" / "batch"
    deadlines: dict[str, float]  # batch class name -> deadline seconds
    settings: ChironSettings


def group_scaling(decided: PoolDesired, group: GroupPlan, instance_cap: int | None = None) -> GroupScaling:
    """The classes, deadlines and Chiron settings of ``group``: it may not outgrow the pool's GPU budget
    left by the other groups, any hosted service's replicas.max, nor ``instance_cap`` (local mode)."""
    assert decided.plan is not None
    pool = decided.pool
    accepted = {c.name for s in group.services for c in decided.services[s].spec.request_classes}
    kinds = {c: decided.classes[c].kind for c in accepted}
    deadlines = {c: decided.classes[c].slo.deadline_seconds or 0.0 for c in accepted if kinds[c] == "batch"}
    budget = pool.spec.instances.max * pool.spec.gpu.per_instance
    others = sum(g.gpus for g in decided.plan.groups if g.name != group.name)
    cap = min(decided.services[s].spec.replicas.max for s in group.services)
    if instance_cap is not None:
        cap = min(cap, instance_cap)
    return GroupScaling(kinds, deadlines, chiron_settings(pool, min((budget - others) // group.tp, cap)))


def pool_services(
    pool: str, service_bodies: Iterable[Mapping[str, Any]], classes: Mapping[str, RequestClassSpec]
) -> tuple[dict[str, LLMService], dict[str, Problem]]:
    """The LLMServices naming ``pool``: the servable ones, and the problems of the others.

    Clients pick a service by its model name and a class by its header value, so neither may be
    ambiguous: of two services serving the same model name, the older keeps it (creation time, then
    name) and the other is rejected; a service whose classes share a header value is rejected."""
    valid: dict[str, LLMService] = {}
    rejected: dict[str, Problem] = {}
    models: dict[str, str] = {}  # model name -> the service serving it
    for body in sorted(service_bodies, key=_age):
        if pool_ref(body) != pool or deleting(body):
            continue
        name = (body.get("metadata") or {}).get("name", "?")
        try:
            service = parse(body)
        except SpecError as err:
            rejected[name] = Problem(INVALID_SPEC, str(err))
            continue
        assert isinstance(service, LLMService)
        missing = [c.name for c in service.spec.request_classes if c.name not in classes]
        if missing:
            rejected[name] = Problem(
                CLASS_NOT_FOUND,
                f"RequestClass {missing} not found (or invalid) in this namespace; create it or remove "
                "it from spec.requestClasses",
            )
            continue
        values: dict[str, str] = {}
        for accepted in service.spec.request_classes:
            value = classes[accepted.name].header_value(accepted.name)
            if value in values:
                rejected[name] = Problem(
                    INVALID_SPEC,
                    f"RequestClasses {values[value]!r} and {accepted.name!r} are both selected by the header "
                    f"value {value!r}; give one of them another spec.match.value",
                )
                break
            values[value] = accepted.name
        if name in rejected:
            continue
        model = service.spec.model.name
        if model in models:
            rejected[name] = Problem(
                DUPLICATE_MODEL,
                f"LLMService {models[model]!r} already serves model {model!r} in pool {pool!r}; clients "
                "choose a service by model name: serve another model name or use another pool",
            )
            continue
        models[model] = name
        valid[name] = service
    return valid, rejected


def _age(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def counts_within_bounds(pool: ServingPool, plan: PlacementPlan) -> bool:
    """Whether a plan's instance counts respect the pool's instance and GPU bounds."""
    instances = sum(g.replicas.total for g in plan.groups)
    bounds = pool.spec.instances
    budget = bounds.max * pool.spec.gpu.per_instance
    return bounds.min <= instances <= bounds.max and plan.gpus <= budget


def carry_counts(pool: ServingPool, new: PlacementPlan, previous: PlacementPlan | None) -> PlacementPlan:
    """The new plan with the instance counts in effect kept for groups that stay (least churn).

    Only with autoscaling on: then the counts are the autoscaler's, and a re-placement must not undo
    them. When the kept counts break the pool's bounds (e.g. the bounds changed) the plan's own counts
    apply. With autoscaling off, ``instances.desired`` (when set) is spread over the groups.
    """
    spec = pool.spec
    # The planners size groups by the GPU budget and services' minimums; the pool's instances.min is
    # the operator's to hold (CHOICE: extra instances go to the groups in proportion, as interactive).
    if new.groups and sum(g.replicas.total for g in new.groups) < spec.instances.min:
        new = replace(new, groups=spread(new, spec.instances.min))
    if not spec.autoscaling.enabled:
        if spec.instances.desired is None or not new.groups:
            return new
        return replace(new, groups=spread(new, spec.instances.desired))
    if previous is None:
        return new
    kept = {g.name: g for g in previous.groups}
    carried = replace(
        new,
        groups=tuple(
            replace(g, replicas=kept[g.name].replicas, batch_size=kept[g.name].batch_size)
            if g.name in kept
            else g
            for g in new.groups
        ),
    )
    return carried if counts_within_bounds(pool, carried) else new


def spread(plan: PlacementPlan, total: int) -> tuple:
    """``total`` interactive instances spread over the plan's groups in proportion to their planned
    counts (largest remainder, ties by name)."""
    planned = [max(1, g.replicas.total) for g in plan.groups]
    weight = sum(planned)
    shares = [total * p / weight for p in planned]
    counts = [int(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), plan.groups[i].name))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return tuple(
        replace(g, replicas=RoleCounts(interactive=c)) for g, c in zip(plan.groups, counts, strict=True)
    )


def inputs_fingerprint(
    pool_body: Mapping[str, Any],
    service_bodies: Iterable[Mapping[str, Any]],
    class_bodies: Iterable[Mapping[str, Any]],
) -> str:
    """A digest of everything a pool's plan and children depend on: the pool's spec, the specs of the
    LLMServices naming it and of the RequestClasses given (objects being deleted left out)."""
    pool = (pool_body.get("metadata") or {}).get("name")

    def specs(bodies: Iterable[Mapping[str, Any]], keep: Any) -> list[Any]:
        chosen = [b for b in bodies if keep(b) and not deleting(b)]
        return sorted(
            (
                [(b.get("metadata") or {}).get("name"), (b.get("metadata") or {}).get("uid"), b.get("spec")]
                for b in chosen
            ),
            key=lambda item: str(item[0]),
        )

    document = {
        "pool": [(pool_body.get("metadata") or {}).get("uid"), pool_body.get("spec")],
        "services": specs(service_bodies, lambda b: pool_ref(b) == pool),
        "classes": specs(class_bodies, lambda b: True),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def desired_pool(
    pool_body: Mapping[str, Any],
    service_bodies: Iterable[Mapping[str, Any]],
    class_bodies: Iterable[Mapping[str, Any]],
    previous: PlacementPlan | None,
    now: float,
    replan: bool = True,
    measured: Mapping[str, ModelLoad] | None = None,
    window_s: float | None = None,
) -> PoolDesired | Problem:
    """Decide a pool: its valid services, the placement plan and the children it should own.

    With ``replan`` false and a plan in effect, that plan stays (planning can be costly: SeaLLM
    simulates); the caller replans when the inputs change or the re-placement interval is due.
    ``measured`` are the loads the workers reported by model name; services without one are planned
    for their declared or default load over ``window_s`` seconds (default: the pool's first
    re-placement interval).
    Returns a Problem (reason InvalidSpec) when the pool's own spec is invalid: nothing is created.
    When no placement exists, the plan in effect stays (``placement_problem`` says why).
    """
    try:
        pool = parse(pool_body)
    except SpecError as err:
        return Problem(INVALID_SPEC, str(err))
    assert isinstance(pool, ServingPool)
    namespace = pool_body.get("metadata", {}).get("namespace") or "default"
    classes, _ = parse_classes(class_bodies)
    services, rejected = pool_services(pool.name, service_bodies, classes)
    try:
        if not replan and previous is not None:
            configs = group_configs(pool, previous.groups, services, classes)
            children = desired_children(pool, previous.groups, services, configs, namespace)
            return PoolDesired(pool, services, classes, rejected, previous, None, children, configs)
        window = window_s or pool.spec.placement.replacement_interval.initial_seconds
        loads = {
            name: service_load(service, (measured or {}).get(service.spec.model.name), window)
            for name, service in services.items()
        }
        planned = service_inputs(pool, services.values(), loads, classes)
        plan = plan_placement(
            pool_input(pool),
            planned,
            strategy=pool.spec.placement.strategy,
            now=now,
            previous=previous,
        )
        plan = carry_counts(pool, plan, previous)
        configs = group_configs(pool, plan.groups, services, classes)
        children = desired_children(pool, plan.groups, services, configs, namespace)
    except (PlacementError, ChildError, ValueError) as err:
        # Keep serving with the plan in effect, restricted to services that are still valid.
        kept = (
            previous if previous and all(s in services for g in previous.groups for s in g.services) else None
        )
        configs = group_configs(pool, kept.groups, services, classes) if kept else {}
        children = desired_children(pool, kept.groups, services, configs, namespace) if kept else []
        return PoolDesired(pool, services, classes, rejected, kept, str(err), children, configs)
    inputs = {s.name: s for s in planned}
    return PoolDesired(pool, services, classes, rejected, plan, None, children, configs, loads, inputs)
