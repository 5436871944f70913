"""``tessera bench fair-share`` on a small run: rows, tenant metrics, the VTC bound and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios import fair_share as scenario


def test_vtc_keeps_the_flood_from_starving_the_fair_tenant() -> None:
    report = scenario.run(BenchConfig("fair-share", options={"requests": 60}), lambda *a, **k: None)
    alone, half, both, vtc, preempt = report.results
    assert [r["policy"] for r in report.results] == [
        "fcfs:tenants=a",
        "fcfs:tenants=a:half-batch",
        "fcfs:tenants=a+b",
        "fcfs:tenants=a+b:vtc",
        "fcfs:tenants=a+b:vtc+preempt",
    ]
    assert alone["requests"] == both["requests"] == vtc["requests"] == 60 and "b_p99_ttft_s" not in alone
    assert half["requests"] == 60 and half["p99_ttft_s"] >= alone["p99_ttft_s"]  # fewer slots, same load
    # where a's TTFT went adds up to it: each wait and the prefill, means over a's requests
    parts = ("a_wait_order_s", "a_wait_slot_s", "a_wait_other_s", "a_prefill_s")
    assert sum(vtc[k] for k in parts) == pytest.approx(vtc["mean_ttft_s"], rel=1e-6)
    assert vtc["a_wait_order_s"] > 0 and vtc["a_wait_slot_s"] > 0 and 0 < vtc["a_ahead_at_arrival"] < 1
    assert both["b_requests"] == vtc["b_requests"] == 600
    assert vtc["p99_ttft_s"] < both["p99_ttft_s"] / 10  # the flood no longer takes a's place in the queue
    assert vtc["slo_attainment"] > both["slo_attainment"]
    assert 0 < vtc["max_service_gap"] <= vtc["vtc_bound"] and vtc["vtc_preempted"] == 0
    assert 0 < preempt["max_service_gap"] <= preempt["vtc_bound"] and preempt["vtc_preempted"] > 0
    assert (
        report.checks[-1].endswith("PASS")
        and report.checks[-2].endswith("PASS")
        and report.config["rate_a_rps"] == pytest.approx(report.config["capacity_rps"] / 2)
    )


def test_the_cli_writes_the_contracts_json(tmp_path: Path) -> None:
    out = tmp_path / "fair.json"
    command = [sys.executable, "-m", "tessera", "bench", "fair-share", "--set", "requests=20", "--set",
               "policy=edf", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["scenario"] == "fair-share" and data["config"]["policy"] == "edf"
    assert {"p99_ttft_s", "slo_attainment", "max_service_gap", "a_wait_order_s"} <= set(data["results"][3])
