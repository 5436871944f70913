"""One evaluation of Chiron's global autoscaler for one placement group, the same everywhere.

The operator (over Prometheus), local mode (over direct scrapes) and the simulator (over its
instances) each measure a group their own way into a ``MetricsSnapshot``; from there they all take
the same step: ``evaluate_group(snapshot, memory, settings, now)`` decides the instance counts by role
(``chiron_decide``) and returns the memory to keep for the next evaluation. ``GroupMemory.due`` says
when the next one is due, so callers measure only then.

``ArrivalMeter`` measures the interactive arrival rate that load forecasting reads. Also here: the
seeds of the global autoscaler's parameters from offline profiling: Θ_B, the output
tokens per second of one batch instance, from a step profile; Θ_op, the over-provisioning target, from
the arrival spikes of a service's history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tessera.core.planners.chiron import chiron_decide
from tessera.core.planners.types import (
    AutoscalerState,
    ChironSettings,
    MetricsSnapshot,
    RoleCounts,
    ScalingDecision,
)
from tessera.core.profile import StepProfile


@dataclass(frozen=True, slots=True)
class GroupMemory:
    """What one group's global autoscaler keeps between evaluations."""

    state: AutoscalerState = field(default_factory=AutoscalerState)
    last_eval: float = -math.inf  # time of the latest evaluation that had a measurement

    def next_due(self, settings: ChironSettings) -> float:
        """When the next evaluation is due."""
        return self.last_eval + settings.eval_interval_s

    def due(self, settings: ChironSettings, now: float) -> bool:
        """Whether an evaluation is due at ``now``."""
        return now >= self.next_due(settings)


@dataclass(frozen=True, slots=True)
class GroupEvaluation:
    """The outcome of one evaluation: the decision (None without a measurement) and the new memory."""

    decision: ScalingDecision | None
    memory: GroupMemory

    def changed(self, current: RoleCounts) -> bool:
        """Whether the group should move away from ``current``."""
        return self.decision is not None and self.decision.changed(current)

    @property
    def reason(self) -> str:
        """The decision's reasons as one line, for events and logs."""
        reasons = self.decision.reasons if self.decision is not None else ()
        return "; ".join(reasons) or "autoscaler"


def evaluate_group(
    snapshot: MetricsSnapshot | None, memory: GroupMemory, settings: ChironSettings, now: float
) -> GroupEvaluation:
    """One global-autoscaler step of a group: the desired counts by role and the memory to keep.

    ``snapshot`` None (nothing measured yet, e.g. no worker answered) decides nothing and keeps the
    memory as it was, so the group stays due."""
    if snapshot is None:
        return GroupEvaluation(None, memory)
    decision = chiron_decide(snapshot, memory.state, settings, now)
    return GroupEvaluation(decision, GroupMemory(decision.state, now))


@dataclass(slots=True)
class ArrivalMeter:
    """Interactive arrivals over the last ``window_s`` seconds: the rate load forecasting reads
    (``MetricsSnapshot.interactive_arrival_rps``) where the caller sees each arrival.

    ``start`` is when the meter began to watch: until a whole window has passed, the rate is the
    arrivals over the time watched, as Prometheus's ``rate()`` is over the samples it has. Dividing
    by the whole window instead read a rate rising from zero over the first window, which load
    forecasting took for a steep rise and over-provisioned for."""

    window_s: float
    start: float = 0.0
    times: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("the arrival window must be > 0 s")

    def record(self, now: float) -> None:
        """One arrival at ``now`` (times never decrease)."""
        self.times.append(now)

    def rate(self, now: float) -> float:
        """Arrivals per second over ``(now - window_s, now]``, or over the time watched while shorter."""
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()
        watched = min(self.window_s, now - self.start)
        return len(self.times) / watched if watched > 0 else 0.0


def instance_tokens_per_s(profile: StepProfile, mean_prompt: float, mean_output: float, slots: int) -> float:
    """The profile seed of Θ_B: output tokens per second of one instance full of mean-sized requests
    (each pays its prefill, then decodes in a batch of ``slots``)."""
    step = profile.decode_step(slots, int(slots * (mean_prompt + mean_output / 2)))
    per_request = profile.prefill(int(mean_prompt)) + mean_output * step / slots
    return mean_output / per_request


def spike_p99(arrivals: Sequence[float] | np.ndarray, window_s: float) -> float:
    """Chiron's request spike: the ratio of arrival counts in consecutive windows as long as the model
    load time; its 99th percentile over ``arrivals`` (windows after an empty one skipped). The
    over-provisioning target Θ_op is its inverse."""
    if window_s <= 0:
        raise ValueError("the spike window (model load time) must be > 0 s")
    arr = np.asarray(arrivals, dtype=float)
    counts = np.bincount(((arr - arr.min()) // window_s).astype(int)).astype(float)
    prev, nxt = counts[:-1], counts[1:]
    ratios = nxt[prev > 0] / prev[prev > 0]
    if len(ratios) < 2:
        raise ValueError(
            f"the arrival history spans under 3 windows of {window_s:g} s; it cannot give a spike"
        )
    return float(np.percentile(ratios, 99))
