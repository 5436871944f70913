"""The predictor interface and its cheap fallbacks (no text, no torch).

The oracle (true remaining length) exists only in the simulator: see the ``srtf-oracle`` policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tessera.core.request import Request


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts the remaining output tokens of each request (one batched call)."""

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        """Predicted remaining output tokens, one per request, in order."""
        ...


class ConstantPredictor:
    """Predicts the same remaining length for every request: ISRTF then orders by arrival (FCFS)."""

    def __init__(self, value: float = 200.0) -> None:
        if value < 0:
            raise ValueError(f"constant prediction must be >= 0 tokens, got {value}")
        self.value = float(value)

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        """``value`` for every request."""
        return [self.value] * len(requests)


class RunningMeanPredictor:
    """Per-service-class running mean of finished requests' output lengths.

    Predicted remaining = max(mean − generated, ``floor``); ``prior`` (weight ``prior_weight``
    requests) stands in until a class has finished requests. The policy feeds it through ``observe``.
    """

    def __init__(self, prior: float = 200.0, prior_weight: float = 1.0, floor: float = 1.0) -> None:
        if prior < 0 or prior_weight < 0 or floor < 0:
            raise ValueError("prior, prior_weight and floor must be >= 0")
        self.prior = float(prior)
        self.prior_weight = float(prior_weight)
        self.floor = float(floor)
        self._sum: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def observe(self, req: Request) -> None:
        """Record a finished request's output length under its class."""
        cls = req.service_class.name
        self._sum[cls] = self._sum.get(cls, 0.0) + req.generated
        self._count[cls] = self._count.get(cls, 0) + 1

    def mean(self, class_name: str) -> float:
        """Current mean output length of ``class_name`` (prior-smoothed)."""
        total = self._sum.get(class_name, 0.0) + self.prior * self.prior_weight
        weight = self._count.get(class_name, 0) + self.prior_weight
        return total / weight if weight > 0 else self.prior

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        """Class mean minus tokens generated so far, at least ``floor``."""
        return [max(self.mean(r.service_class.name) - r.generated, self.floor) for r in requests]
