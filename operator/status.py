"""Pure status bookkeeping: conditions with transition times, scaling history, the plan as status JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tessera.api.serving_pool import SCALING_HISTORY_LENGTH
from tessera.api.times import parse_time as parse_time  # the operator reads status times through here
from tessera.api.times import rfc3339 as rfc3339
from tessera.core.planners import ROLES, GroupPlan, PlacementPlan, RoleCounts, parse_roles

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
    plan: PlacementPlan, ready: Mapping[str, int], batch_sizes: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The plan as the ServingPool's ``status.placement`` JSON; ``ready`` maps group name to ready pods,
    ``batch_sizes`` group name to the batch size its workers report (a measurement, not part of the
    plan: ``plan_from_status`` does not read it back)."""
    batch_sizes = batch_sizes or {}
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
            }
            for g in plan.groups
        ],
    }
    if plan.estimated_slo_attainment is not None:
        status["estimatedSloAttainment"] = plan.estimated_slo_attainment
    if plan.estimated_norm_latency is not None:
        status["estimatedNormLatency"] = plan.estimated_norm_latency
    return status


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
