"""`tessera bench router`: both paths over real worker and router processes, paired, with the checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.bench import control_faults
from tessera.bench.router_overhead import run
from tessera.bench.scenarios import BenchConfig, Options

pytestmark = pytest.mark.integration


def test_bench_router_runs_both_paths_and_the_fault_run() -> None:
    options = Options({"streams": "8", "rounds": "2", "max_tokens": "4", "faults": "true"})
    report = run(BenchConfig("router", options=options), lambda *a, **k: None)
    rows = {r["policy"]: r for r in report.results}
    assert set(rows) == {"direct:streams=8", "router:streams=8", "router+router-restarted:streams=8",
                         "router+router-killed:streams=8", "router+worker-killed:streams=8"}  # fmt: skip
    for name in ("direct:streams=8", "router:streams=8"):
        assert rows[name]["completed"] == 16 and rows[name]["lost"] == 0 and rows[name]["tokens_per_s"] > 0
    killed = rows["router+worker-killed:streams=8"]
    assert killed["accepted"] == 8 and killed["completed"] + killed["failed"] + killed["lost"] == 8
    restarted = rows["router+router-restarted:streams=8"]
    # The load ran across the restart: requests completed before and after it (at least one per client
    # before it, and more on the new router), and connections were refused while no router listened.
    assert restarted["completed"] > 8 and restarted["refused"] > 0 and restarted["router_down_s"] > 0
    assert restarted["requests"] == restarted["accepted"] + restarted["refused"]
    assert restarted["accepted"] == restarted["completed"] + restarted["failed"] + restarted["lost"]
    killed_router = rows["router+router-killed:streams=8"]
    # The router's SIGKILL broke streams in flight: each one a connection error the client saw, none lost.
    assert killed_router["completed"] > 8 and killed_router["refused"] > 0 and killed_router["lost"] == 0
    assert killed_router["accepted"] == killed_router["completed"] + killed_router["failed"]
    reasons = killed_router["failed_by_reason"]
    assert killed_router["failed"] > 0
    assert all(reason.startswith("connection broken by the router's kill") for reason in reasons), reasons
    assert len(report.checks) == 5 and report.checks[0].startswith("streams=8: router/direct TTFT p50")
    assert "--set control_faults=true runs them" in report.checks[-1]
    with pytest.raises(ValueError, match="--set streams"):
        run(BenchConfig("router", options=Options({"streams": "0"})), lambda *a, **k: None)


def test_bench_router_measures_a_baseline_tree_s_router_in_the_same_rounds() -> None:
    tree = str(Path(__file__).resolve().parents[1])  # this tree as its own baseline
    options = Options({"streams": "4", "rounds": "3", "max_tokens": "4", "faults": "false", "baseline": tree})
    report = run(BenchConfig("router", options=options), lambda *a, **k: None)
    rows = {r["policy"]: r for r in report.results}
    assert set(rows) == {"direct:streams=4", "router:streams=4", "baseline:streams=4"}
    for name in rows:
        assert rows[name]["completed"] == 12 and rows[name]["lost"] == 0
    assert rows["direct:streams=4"]["router_cpu_ms_per_request"] is None
    for name in ("router:streams=4", "baseline:streams=4"):  # CPU clock ticks are 10 ms: may round to 0
        cpu = rows[name]["router_cpu_ms_per_request"]
        assert isinstance(cpu, float) and cpu >= 0
    assert len(report.checks) == 1 and "; baseline router/direct TTFT p50 x" in report.checks[0]
    with pytest.raises(ValueError, match="--set baseline"):
        run(BenchConfig("router", options=Options({"baseline": "/nonexistent"})), lambda *a, **k: None)


@pytest.mark.timeout(180)
@pytest.mark.skipif(control_faults.unavailable() is not None, reason="needs prometheus and kmock")
def test_bench_router_restarts_the_operator_and_stops_prometheus_under_load() -> None:
    options = Options({"streams": "8", "rounds": "1", "max_tokens": "4", "faults": "false",
                       "control_faults": "true"})  # fmt: skip
    report = run(BenchConfig("router", options=options), lambda *a, **k: None)
    rows = {r["policy"]: r for r in report.results}
    assert set(rows) == {"direct:streams=8", "router:streams=8", "router+operator-restarted:streams=8",
                         "router+prometheus-stopped:streams=8"}  # fmt: skip
    for name in ("router+operator-restarted:streams=8", "router+prometheus-stopped:streams=8"):
        row = rows[name]
        # The load ran across the fault (every client had a request completed before it, and went on), the
        # counts add up, and the workers and the router served it all: none refused, failed or lost.
        assert row["completed"] > 8 and row["requests"] == row["accepted"] + row["refused"]
        assert row["accepted"] == row["completed"] + row["failed"] + row["lost"]
        assert row["lost"] == 0 and row["refused"] == 0 and row["failed"] == 0, row
        assert sum(row["in_flight_at_fault"].values()) == 8
    restarted = rows["router+operator-restarted:streams=8"]["operator"]
    # The new operator rewrote nothing and removed no instance of the two the autoscaler had sized.
    assert restarted["replicas_before"] == 2 and restarted["replicas_seen"] == [2], restarted
    assert restarted["child_writes"] == [] and restarted["children_changed"] == []
    stopped = rows["router+prometheus-stopped:streams=8"]["operator"]
    # Prometheus down longer than the scale-down cooldown and two intervals: no scaling on missing metrics.
    assert stopped["outage_s"] > control_faults.COOLDOWN_S + 2 * control_faults.INTERVAL_S
    assert stopped["replicas_before"] == 2 and stopped["replicas_during"] == stopped["replicas_after"] == [
        2
    ], stopped
    # The pool's status said the counts were held for want of measurements, and autoscaled again after.
    assert stopped["scaled_condition_during"]["reason"] == "NoMeasurements"
    assert stopped["scaled_condition_during"]["status"] == "False"
    assert stopped["scaled_condition_after"]["reason"] == "Autoscaled"
    assert all(": PASS (goal:" in c for c in report.checks[1:]), report.checks


def test_bench_router_refuses_control_faults_without_prometheus_or_kmock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control_faults, "unavailable", lambda: "the prometheus binary (make sysdeps)")
    options = Options({"streams": "4", "control_faults": "true"})
    with pytest.raises(ValueError, match=r"control_faults=true needs the prometheus binary \(make sysdeps\)"):
        run(BenchConfig("router", options=options), lambda *a, **k: None)
