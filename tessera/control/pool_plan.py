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
from tessera.control.adapters import adapter_problems, adapters_of, is_adapter
from tessera.control.children import (
    GROUP_LABEL,
    SERVES_PREFIX,
    ChildError,
    desired_children,
    group_configs,
    owner_reference,
    worker_config,
    worker_engine,
)
from tessera.control.inputs import (
    ServiceLoad,
    chiron_settings,
    pool_input,
    service_inputs,
    service_load,
    with_adapter_loads,
)
from tessera.control.metrics_queries import ModelLoad
from tessera.control.placement import PlacementError, plan_placement, validate_services
from tessera.core.planners import (
    ChironSettings,
    GroupPlan,
    PlacementPlan,
    RoleCounts,
    ServiceInput,
)
from tessera.core.planners.naming import group_name

# Reasons used in conditions and events.
INVALID_SPEC = "InvalidSpec"
CLASS_NOT_FOUND = "RequestClassNotFound"
POOL_NOT_FOUND = "PoolNotFound"
PLACEMENT_FAILED = "PlacementFailed"
DUPLICATE_MODEL = "DuplicateModel"
# Reasons of a valid service the pool cannot place (the others are placed without it).
UNPLACEABLE = "Unplaceable"  # fits no instance of the pool, or its group's pods cannot be built
POOL_FULL = "PoolFull"  # the pool's GPU budget holds the older services only
CANNOT_SHARE = "CannotShareGroup"  # fine alone, but not in the group the planner put it in
PLACEMENT_REASONS = frozenset({UNPLACEABLE, POOL_FULL, CANNOT_SHARE})


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

    @property
    def unplaced(self) -> bool:
        """Whether a valid service was left out of its pool's placement (the pool places the others)."""
        return self.reason in PLACEMENT_REASONS


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
    # The pool's services placed by ``plan`` (valid and placeable), and the adapters their groups serve
    services: dict[str, LLMService]
    classes: dict[str, RequestClassSpec]
    # The pool's services left out, by name: invalid ones and those the pool cannot place.
    rejected: dict[str, Problem] = field(default_factory=dict)
    plan: PlacementPlan | None = None
    placement_problem: str | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    configs: dict[str, WorkerConfig] = field(default_factory=dict)  # group name -> its worker configuration
    # What a new plan was planned from, by service name (empty when the plan in effect was kept).
    loads: dict[str, ServiceLoad] = field(default_factory=dict)
    inputs: dict[str, ServiceInput] = field(default_factory=dict)

    def placed_as(self, name: str) -> str:
        """The service whose groups serve ``name``: an adapter's base, else the service itself."""
        adapter = self.services[name].spec.model.adapter if name in self.services else None
        return adapter.base if adapter is not None else name


@dataclass(frozen=True, slots=True)
class GroupScaling:
    """What the global autoscaler of one placement group reads besides measurements."""

    kinds: dict[str, str]  # accepted class name -> "interactive" / "batch"
    deadlines: dict[str, float]  # batch class name -> deadline seconds
    settings: ChironSettings
    models: tuple[str, ...] = ()  # the model names its services serve (what the router holds is by model)


def group_scaling(decided: PoolDesired, group: GroupPlan, instance_cap: int | None = None) -> GroupScaling:
    """The classes, deadlines and Chiron settings of ``group``: it may not outgrow the pool's GPU budget
    left by the other groups, any hosted service's replicas.max, nor ``instance_cap`` (local mode).
    The adapters its bases serve count as its services for the classes and models (their demand is
    the group's), not for the replica cap (an adapter has no instances of its own)."""
    assert decided.plan is not None
    pool = decided.pool
    served = [*group.services, *(a.name for s in group.services for a in adapters_of(s, decided.services))]
    accepted = {c.name for s in served for c in decided.services[s].spec.request_classes}
    kinds = {c: decided.classes[c].kind for c in accepted}
    deadlines = {c: decided.classes[c].slo.deadline_seconds or 0.0 for c in accepted if kinds[c] == "batch"}
    budget = pool.spec.instances.max * pool.spec.gpu.per_instance
    others = sum(g.gpus for g in decided.plan.groups if g.name != group.name)
    cap = min(decided.services[s].spec.replicas.max for s in group.services)
    if instance_cap is not None:
        cap = min(cap, instance_cap)
    models = tuple(sorted(decided.services[s].spec.model.name for s in served))
    settings = chiron_settings(pool, min((budget - others) // group.tp, cap))
    return GroupScaling(kinds, deadlines, settings, models)


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
            replace(
                g,
                replicas=kept[g.name].replicas,
                batch_size=kept[g.name].batch_size,
                roles=kept[g.name].roles,
            )
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
    unplaced: Mapping[str, Problem] | None = None,
) -> PoolDesired | Problem:
    """Decide a pool: its valid services, the placement plan and the children it should own.

    With ``replan`` false and a plan in effect, that plan stays (planning can be costly: SeaLLM
    simulates), and ``unplaced`` (the placement problems found when it was made, by service name) still
    explain the valid services it leaves out; the caller replans when the inputs change or the
    re-placement interval is due.
    ``measured`` are the loads the workers reported by model name; services without one are planned
    for their declared or default load over ``window_s`` seconds (default: the pool's first
    re-placement interval).
    A service the pool cannot place is left out with its own problem (``place``); the others are placed.
    An adapter (``tessera.control.adapters``) is not planned: it is served by its base's groups, or left
    out with its own problem (an invalid adapter, or a base that is not placed) while its base serves.
    Returns a Problem (reason InvalidSpec) when the pool's own spec is invalid: nothing is created.
    When the pool as a whole cannot be built, the plan in effect stays (``placement_problem`` says why).
    """
    try:
        pool = parse(pool_body)
    except SpecError as err:
        return Problem(INVALID_SPEC, str(err))
    assert isinstance(pool, ServingPool)
    namespace = pool_body.get("metadata", {}).get("namespace") or "default"
    classes, _ = parse_classes(class_bodies)
    services, rejected = pool_services(pool.name, service_bodies, classes)
    bad = adapter_problems(pool, services, {n: p.message for n, p in rejected.items()})
    rejected.update({n: Problem(reason, message) for n, (reason, message) in bad.items()})
    adapters = {n: s for n, s in services.items() if n not in bad and is_adapter(s)}
    services = {n: s for n, s in services.items() if n not in bad and n not in adapters}
    try:
        if not replan and previous is not None:
            placed = {s for g in previous.groups for s in g.services}
            left_out = {n: p for n, p in (unplaced or {}).items() if n in services and n not in placed}
            rejected.update(left_out)
            services = {n: s for n, s in services.items() if n not in left_out}
            services = with_adapters(services, adapters, placed, rejected)
            configs = group_configs(pool, previous.groups, services, classes)
            children = desired_children(pool, previous.groups, services, configs, namespace)
            return PoolDesired(pool, services, classes, rejected, previous, None, children, configs)
        # Faults of the pool's own spec would fail every group: the pool reports them, not its services.
        worker_engine(pool)
        owner_reference(pool)
        window = window_s or pool.spec.placement.replacement_interval.initial_seconds
        loads = {
            name: service_load(service, (measured or {}).get(service.spec.model.name), window)
            for name, service in services.items()
        }
        # A base's instances serve its adapters' requests too: it is planned for theirs with its own.
        loads = {
            name: with_adapter_loads(
                load,
                {
                    a.name: service_load(a, (measured or {}).get(a.spec.model.name), window)
                    for a in adapters_of(name, adapters)
                },
            )
            for name, load in loads.items()
        }
        plan, planned, left_out = place(pool, services, classes, loads, previous, now, namespace)
        rejected.update(left_out)
        services = {n: s for n, s in services.items() if n not in left_out}
        placed = {s for g in plan.groups for s in g.services}
        services = with_adapters(services, adapters, placed, rejected)
        configs = group_configs(pool, plan.groups, services, classes)
        children = desired_children(pool, plan.groups, services, configs, namespace)
    except (PlacementError, ChildError, ValueError) as err:
        # Keep serving with the plan in effect, restricted to services that are still valid.
        kept = (
            previous if previous and all(s in services for g in previous.groups for s in g.services) else None
        )
        if kept:
            services = with_adapters(
                services, adapters, {s for g in kept.groups for s in g.services}, rejected
            )
        configs = group_configs(pool, kept.groups, services, classes) if kept else {}
        children = desired_children(pool, kept.groups, services, configs, namespace) if kept else []
        return PoolDesired(pool, services, classes, rejected, kept, str(err), children, configs)
    inputs = {s.name: s for s in planned}
    return PoolDesired(pool, services, classes, rejected, plan, None, children, configs, loads, inputs)


def with_adapters(
    bases: Mapping[str, LLMService],
    adapters: Mapping[str, LLMService],
    placed: set[str],
    rejected: dict[str, Problem],
) -> dict[str, LLMService]:
    """``bases`` and the ``adapters`` whose base is ``placed``; each other adapter is added to
    ``rejected`` with its base's problem (it is served where its base runs, and its base runs nowhere)."""
    served = dict(bases)
    for name, adapter in adapters.items():
        spec = adapter.spec.model.adapter
        assert spec is not None
        if spec.base in placed:
            served[name] = adapter
            continue
        why = rejected.get(spec.base)
        reason = why.reason if why is not None and why.unplaced else UNPLACEABLE
        detail = f": {why.message}" if why is not None else ""
        rejected[name] = Problem(reason, f"its base LLMService {spec.base!r} is not placed{detail}")
    return served


def place(
    pool: ServingPool,
    services: Mapping[str, LLMService],
    classes: Mapping[str, RequestClassSpec],
    loads: Mapping[str, ServiceLoad],
    previous: PlacementPlan | None,
    now: float,
    namespace: str,
) -> tuple[PlacementPlan, list[ServiceInput], dict[str, Problem]]:
    """The plan of every service the pool can place, their planner inputs, and the problem of each
    service left out.

    ``services`` are in age order (``pool_services``). A service is left out when it fits no instance of
    the pool alone (``UNPLACEABLE``), when a plan exists only without it, the newest, as for a model name
    (``POOL_FULL``), or when a group the planner gave it cannot be built: alone (``UNPLACEABLE``) or
    beside the group's older services (``CANNOT_SHARE``, the newest of the group leaves). Each leaving
    service re-plans the rest, so one bad spec never takes the others down."""
    gpu = pool_input(pool)
    left_out: dict[str, Problem] = {}
    inputs: dict[str, ServiceInput] = {}
    for name, service in services.items():
        try:
            (one,) = service_inputs(pool, [service], {name: loads[name]}, classes)
            validate_services(gpu, [one])
        except ValueError as err:  # PlacementError included
            left_out[name] = Problem(UNPLACEABLE, str(err))
            continue
        inputs[name] = one
    while True:
        planned = sorted(inputs.values(), key=lambda s: s.name)  # plans must not depend on listing order
        try:
            plan = plan_placement(
                gpu, planned, strategy=pool.spec.placement.strategy, now=now, previous=previous
            )
        except PlacementError as err:
            *older, newest = inputs  # a plan of no service always exists
            left_out[newest] = Problem(
                POOL_FULL,
                f"ServingPool {pool.name!r} cannot place it beside the older services {older}: {err}",
            )
            del inputs[newest]
            continue
        plan = carry_counts(pool, plan, previous)
        blamed: dict[str, Problem] = {}
        for group in plan.groups:
            blamed.update(_group_fault(pool, group, services, classes, namespace))
        if not blamed:
            return plan, planned, left_out
        left_out.update(blamed)
        for name in blamed:
            del inputs[name]


def _group_fault(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    classes: Mapping[str, RequestClassSpec],
    namespace: str,
) -> dict[str, Problem]:
    """The services to leave out because ``group``'s objects cannot be built (none when they can)."""

    def fault(candidate: GroupPlan) -> str | None:
        try:
            config = worker_config(pool, candidate, services, classes)
            desired_children(pool, [candidate], services, {candidate.name: config}, namespace)
        except ChildError as err:
            return str(err)
        return None

    error = fault(group)
    if error is None:
        return {}
    alone = {
        name: fault(GroupPlan(group_name((name,), group.tp), (name,), group.tp, RoleCounts(interactive=1)))
        for name in group.services
    }
    blamed = {n: Problem(UNPLACEABLE, e) for n, e in alone.items() if e is not None}
    if blamed:
        return blamed
    newest = max(group.services, key=list(services).index)
    older = [n for n in group.services if n != newest]
    message = f"it cannot share placement group {group.name!r} with {older}: {error}"
    return {newest: Problem(CANNOT_SHARE, message)}


@dataclass(frozen=True, slots=True)
class Retiring:
    """A group the plan in effect no longer has, whose objects still exist: it keeps serving while the
    plan's groups that take over its services start (``waiting_for``), unless ``timed_out``."""

    group: str
    services: tuple[str, ...]  # the LLMServices its pods serve
    waiting_for: tuple[str, ...]  # the plan's groups serving some of them, not all ready yet
    since: float  # when it left the plan
    timed_out: bool

    @property
    def held(self) -> bool:
        """Whether its objects stay this pass (else they are deleted and its pods drain)."""
        return bool(self.waiting_for) and not self.timed_out


def retiring_groups(
    plan: PlacementPlan,
    observed: Iterable[Mapping[str, Any]],
    since: Mapping[str, float],
    now: float,
    timeout_s: float,
) -> list[Retiring]:
    """The observed groups (their StatefulSets) that ``plan`` no longer has, sorted by name.

    A moved service's old group keeps serving until every group of ``plan`` that serves it reports all
    its replicas ready, so its requests always find a ready pod (make before break); it is released at
    once when none of its services is in ``plan`` any more, and after ``timeout_s`` seconds from when it
    left the plan (``since`` by group name; ``now`` when not known) in any case."""
    current = {g.name for g in plan.groups}
    ready: dict[str, int] = {}
    retired: dict[str, tuple[str, ...]] = {}
    for obj in observed:
        meta = obj.get("metadata") or {}
        group = (meta.get("labels") or {}).get(GROUP_LABEL)
        if obj.get("kind") != "StatefulSet" or group is None or meta.get("deletionTimestamp"):
            continue
        ready[group] = int((obj.get("status") or {}).get("readyReplicas") or 0)
        if group not in current:
            labels = ((obj.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
            retired[group] = tuple(
                sorted(k[len(SERVES_PREFIX) :] for k in labels if k.startswith(SERVES_PREFIX))
            )
    out = []
    for group, services in sorted(retired.items()):
        waiting = tuple(
            g.name
            for g in plan.groups
            if set(g.services) & set(services) and ready.get(g.name, 0) < g.replicas.total
        )
        start = since.get(group, now)
        out.append(Retiring(group, services, waiting, start, now - start >= timeout_s))
    return out
