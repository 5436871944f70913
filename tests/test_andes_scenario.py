"""Helpers of the ``andes`` bench scenario: seed means, per-seed checks, the capacity bound."""

from __future__ import annotations

import pytest

from tessera.bench.scenarios._common import mean_row, seed_checks
from tessera.bench.scenarios.andes import _out_of_reach, alone_qoe_bound, andes_cluster, burst_qoe_bound
from tessera.core import Request, ServiceClass

CLS = ServiceClass(name="chat", reading_speed_tps=5.0)


def burst(count: int, prompt: int = 2000, output: int = 200) -> list[Request]:
    """``count`` requests spread evenly over the burst of a 1200 s trace (390 s to 810 s)."""
    return [
        Request(
            f"r{i}", 390.0 + 420.0 * i / count, prompt, output, service_class=CLS, true_output_tokens=output
        )
        for i in range(count)
    ]


def test_mean_row_averages_numbers_present_in_every_row() -> None:
    rows = [
        {"policy": "qoe:x,seed=0", "avg_qoe": 0.8, "preemptions": 2, "by_class": {"a": 1.0}, "tds": None},
        {"policy": "qoe:x,seed=1", "avg_qoe": 0.6, "preemptions": 5, "by_class": {"a": 0.0}, "tds": 3.0},
    ]
    out = mean_row(rows, "qoe:x,mean")
    assert out == {"policy": "qoe:x,mean", "seeds": 2, "avg_qoe": pytest.approx(0.7), "preemptions": 3.5}


def test_seed_checks_judge_the_mean_and_list_each_seed() -> None:
    def check(fcfs: dict, qoe: dict) -> list[str]:
        return [f"ratio {qoe['q'] / fcfs['q']:.1f}: {'PASS' if qoe['q'] >= 2 * fcfs['q'] else 'FAIL'}"]

    pairs = [({"q": 0.4}, {"q": 0.9}), ({"q": 0.5}, {"q": 0.8}), ({"q": 0.45}, {"q": 0.85})]
    lines = seed_checks(pairs, [3, 4], lambda p: check(*p))
    assert lines[0] == "mean of seeds 3..4: ratio 1.9: FAIL"
    assert lines[1:] == ["  seed 3: ratio 2.2: PASS", "  seed 4: ratio 1.6: FAIL"]


def test_capacity_bound_falls_once_the_burst_needs_more_work_than_its_length() -> None:
    cluster = andes_cluster({})
    # 2000-token prompts prefill in 0.44 s each: 400 of them fit the 420 s burst, 1,200 do not
    light, deferred_light = burst_qoe_bound(burst(400), {}, cluster)
    heavy, deferred_heavy = burst_qoe_bound(burst(1200), {}, cluster)
    assert (light, deferred_light) == (1.0, 0)
    assert deferred_heavy > 1200 - 420 / 0.44 - 1
    assert 0.0 < heavy < 0.9


def test_alone_bound_is_perfect_for_short_prompts_and_falls_when_the_prefill_outlasts_the_ttft_target() -> (
    None
):
    cluster = andes_cluster({})
    # All at once: FCFS would queue them, the bound serves each alone.
    short = [Request(f"s{i}", 0.0, 500, 100, service_class=CLS, true_output_tokens=100) for i in range(50)]
    # 40k-token prompts: T* = 8 s, the prefill at about 4,500 tokens/s takes about 9 s.
    long = [Request(f"l{i}", 0.0, 40_000, 100, service_class=CLS, true_output_tokens=100) for i in range(5)]
    assert alone_qoe_bound(short, cluster) == pytest.approx(1.0)
    assert alone_qoe_bound(long, cluster) < 0.99
    assert _out_of_reach("x", 0.95, "0.95", {0: 0.96}) == []
    assert "out of reach" in _out_of_reach("x", 0.95, "0.95", {0: 0.84, 1: 0.86})[0]
