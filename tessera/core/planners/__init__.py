"""Pure planners from specs and metrics to desired state (placement, which simulates, is in
``tessera.control.placement``).

The operator (kopf), local mode and the simulator call the same functions:

- ``next_replacement_interval(current_s, estimated, measured, settings) -> float`` (SeaLLM Eq. 8);
- ``rollout_diff(previous, new) -> RolloutDiff`` (least-churn roll-out of a new plan);
- ``chiron_decide(snapshot, state, settings, now) -> ScalingDecision`` (Chiron global autoscaler);
- ``threshold_decide(...)`` (the utilization-threshold baseline autoscaler).

Inputs and outputs are plain dataclasses (``types.py``), independent of the Kubernetes API models;
``convert.py`` maps ``tessera.api`` resources onto them. No planner does I/O or reads a clock: time is
an argument.
"""

from __future__ import annotations

from tessera.core.planners.chiron import chiron_decide
from tessera.core.planners.replacement import (
    IntervalMetrics,
    IntervalSettings,
    RolloutDiff,
    next_replacement_interval,
    rollout_diff,
)
from tessera.core.planners.threshold import ThresholdDecision, ThresholdSettings, threshold_decide
from tessera.core.planners.types import (
    ROLES,
    AutoscalerState,
    BatchGroup,
    ChironSettings,
    GroupPlan,
    HistoryRequest,
    LoraAdapters,
    MetricsSnapshot,
    PlacementPlan,
    PoolInput,
    Role,
    RoleCounts,
    ScalingDecision,
    ServiceInput,
    Strategy,
    assign_roles,
    parse_roles,
)

__all__ = [
    "ROLES",
    "AutoscalerState",
    "BatchGroup",
    "ChironSettings",
    "GroupPlan",
    "HistoryRequest",
    "IntervalMetrics",
    "IntervalSettings",
    "LoraAdapters",
    "MetricsSnapshot",
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
    "assign_roles",
    "chiron_decide",
    "next_replacement_interval",
    "parse_roles",
    "rollout_diff",
    "threshold_decide",
]
