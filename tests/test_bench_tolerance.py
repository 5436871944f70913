"""Rows carry tails and costs (one computation); every scenario checks rows against its baseline."""

from __future__ import annotations

import pytest

from tessera.bench.scenarios._common import baseline_checks, tolerance
from tessera.core.slo import latency_metrics


def test_latency_metrics_carries_tails_throughput_and_goodput() -> None:
    m = latency_metrics([1.0, 2.0, 3.0, 10.0], [2.0, 4.0, 6.0, 40.0], [True, False, None, True], 10.0)
    assert m["p50_ttft_s"] == 2.5 and m["p50_jct_s"] == 5.0
    assert m["p99_jct_s"] == pytest.approx(40.0 - 0.03 * 34.0)
    assert m["throughput_rps"] == 0.4
    assert m["goodput_rps"] == 0.2  # the two requests that met their SLO, per second
    assert "goodput_rps" not in latency_metrics([1.0], [1.0], [None], 1.0)  # nobody has an SLO
    assert latency_metrics([], [1.0], [None], 1.0)["p99_ttft_s"] is None  # no first token at all


def row(name: str, thr: float, p99: float) -> dict:
    return {"policy": name, "throughput_rps": thr, "p99_jct_s": p99}


def test_baseline_checks_fail_beyond_the_tolerance_on_either_metric() -> None:
    base = row("fcfs", 10.0, 100.0)
    lines = baseline_checks(
        [row("ok", 9.0, 110.0), row("slow", 8.9, 50.0), row("tail", 12.0, 111.0)], base, 0.10
    )
    assert lines[0] == "ok vs fcfs: throughput -10.0%, p99_jct +10.0% (no worse than 10%): PASS"
    assert lines[1].startswith("slow vs fcfs: throughput -11.0%") and lines[1].endswith("FAIL")
    assert lines[2].endswith("FAIL")
    assert baseline_checks([row("tail", 12.0, 111.0)], base, 0.2)[0].endswith("PASS")
    # a metric a row lacks is left out, not counted as a failure
    assert baseline_checks([{"policy": "x", "throughput_rps": 10.0}], base, 0.1) == [
        "x vs fcfs: throughput +0.0% (no worse than 10%): PASS"
    ]


def test_tolerance_setting_is_validated() -> None:
    assert tolerance({}) == 0.10
    assert tolerance({"tolerance": "0.25"}) == 0.25
    for bad in ("-0.1", "1", "x"):
        with pytest.raises(ValueError, match="tolerance"):
            tolerance({"tolerance": bad})
