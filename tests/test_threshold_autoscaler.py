"""Utilization-threshold baseline autoscaler."""

from __future__ import annotations

import pytest

from tessera.core.planners import ThresholdSettings, threshold_decide


def test_adds_and_removes_one_instance_per_interval():
    s = ThresholdSettings(interval_s=10, high=0.8, low=0.4, min_instances=1, max_instances=3)
    d = threshold_decide(0.9, 2, s, now=0.0)
    assert d.desired == 3 and d.next_eval == 10.0
    assert threshold_decide(0.95, 3, s, now=5.0, next_eval=d.next_eval).desired == 3  # waits
    assert threshold_decide(0.95, 3, s, now=10.0, next_eval=d.next_eval).desired == 3  # at cap
    assert threshold_decide(0.1, 3, s, now=20.0).desired == 2
    assert threshold_decide(0.1, 1, s, now=20.0).desired == 1  # at floor
    assert threshold_decide(0.6, 2, s, now=20.0).desired == 2


def test_validation():
    with pytest.raises(ValueError, match="low < high"):
        ThresholdSettings(high=0.3, low=0.5)
    with pytest.raises(ValueError, match="utilization"):
        threshold_decide(1.5, 1, ThresholdSettings(), now=0.0)
