"""The operator's planners: pure functions from specs and metrics to desired state.

The operator (kopf) and the simulator call the same functions:

- ``plan_placement(pool, services, strategy=..., now=..., previous=...) -> PlacementPlan``
  (SeaLLM placement, or one dedicated group per service);
- ``next_replacement_interval(current_s, estimated, measured, settings) -> float`` (SeaLLM Eq. 8);
- ``rollout_diff(previous, new) -> RolloutDiff`` (least-churn roll-out of a new plan);
- ``chiron_decide(snapshot, state, settings, now) -> ScalingDecision`` (Chiron global autoscaler);
- ``threshold_decide(...)`` (the utilization-threshold baseline autoscaler).

Inputs and outputs are plain dataclasses (``types.py``), independent of the Kubernetes API models;
``convert.py`` maps ``tessera.api`` resources onto them. No planner does I/O or reads a clock: time is
an argument.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.operator.planners.chiron import chiron_decide
from tessera.operator.planners.placement import PlacementError, plan_dedicated, plan_seallm
from tessera.operator.planners.replacement import (
    IntervalMetrics,
    IntervalSettings,
    RolloutDiff,
    next_replacement_interval,
    rollout_diff,
)
from tessera.operator.planners.threshold import ThresholdDecision, ThresholdSettings, threshold_decide
from tessera.operator.planners.types import (
    ROLES,
    AutoscalerState,
    BatchGroup,
    ChironSettings,
    GroupPlan,
    HistoryRequest,
    LatencyModel,
    MetricsSnapshot,
    PlacementPlan,
    PoolInput,
    Role,
    RoleCounts,
    ScalingDecision,
    ServiceInput,
    Strategy,
)


def plan_placement(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    *,
    strategy: Strategy,
    now: float,
    previous: PlacementPlan | None = None,
) -> PlacementPlan:
    """Place ``services`` onto ``pool``'s GPUs.

    ``strategy="dedicated"``: one group per service (GPUs split evenly). ``strategy="seallm"``: SeaLLM's
    two-stage search over the services' recent history; services without history or rate get their
    minimum dedicated placement first (SeaLLM §4). ``previous`` is the plan in effect: groups that stay
    keep their names (and so their pods). ``now`` is the planning time (for the history window).
    Raises ``PlacementError`` when the pool cannot host every service."""
    if strategy == "dedicated":
        return plan_dedicated(pool, services)
    if strategy == "seallm":
        return plan_seallm(pool, services, now=now, previous=previous)
    raise PlacementError(f"unknown placement strategy {strategy!r}; use 'seallm' or 'dedicated'")


__all__ = [
    "ROLES",
    "AutoscalerState",
    "BatchGroup",
    "ChironSettings",
    "GroupPlan",
    "HistoryRequest",
    "IntervalMetrics",
    "IntervalSettings",
    "LatencyModel",
    "MetricsSnapshot",
    "PlacementError",
    "PlacementPlan",
    "PoolInput",
    "Role",
    "RoleCounts",
    "RolloutDiff",
    "ScalingDecision",
    "ServiceInput",
    "Strategy",
    "ThresholdDecision",
    "ThresholdSettings",
    "chiron_decide",
    "next_replacement_interval",
    "plan_placement",
    "rollout_diff",
    "threshold_decide",
]
