"""Utilization-threshold autoscaler: the Llumnix / KPA-style baseline of Chiron's evaluation (Chiron §6).

Every ``interval_s`` it compares the mean KV-token utilization of the ready instances with a band and
adds or removes one instance. No notion of SLOs, request classes or queues.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThresholdSettings:
    """Defaults of Chiron's Llumnix baseline: Llumnix SCALING_INTERVAL = 10 s, U_hi = 0.8, U_lo = 0.4."""

    interval_s: float = 10.0
    high: float = 0.8
    low: float = 0.4
    min_instances: int = 1
    max_instances: int = 50

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high <= 1:
            raise ValueError(f"need 0 <= low < high <= 1, got low={self.low} high={self.high}")
        if not 0 <= self.min_instances <= self.max_instances or self.max_instances < 1:
            raise ValueError("need 0 <= min_instances <= max_instances and max_instances >= 1")
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    """Desired instance count, the reason, and when the rule may act next."""

    desired: int
    reason: str
    next_eval: float


def threshold_decide(
    utilization: float, instances: int, settings: ThresholdSettings, now: float, next_eval: float = 0.0
) -> ThresholdDecision:
    """One step of the baseline: ±1 instance when mean utilization (0-1) leaves [low, high].

    ``instances`` counts ready and starting instances; ``next_eval`` is the previous decision's."""
    if not 0 <= utilization <= 1.0 + 1e-9:
        raise ValueError(f"utilization must be in [0, 1], got {utilization}")
    if now < next_eval:
        return ThresholdDecision(instances, "waiting for the next interval", next_eval)
    nxt = now + settings.interval_s
    if utilization > settings.high and instances < settings.max_instances:
        return ThresholdDecision(instances + 1, f"utilization {utilization:.2f} > {settings.high}", nxt)
    if utilization < settings.low and instances > settings.min_instances:
        return ThresholdDecision(instances - 1, f"utilization {utilization:.2f} < {settings.low}", nxt)
    if instances < settings.min_instances:
        return ThresholdDecision(settings.min_instances, "below min_instances", nxt)
    return ThresholdDecision(instances, f"utilization {utilization:.2f} within band", nxt)
