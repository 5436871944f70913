"""``tessera bench fair-share`` on a small run: rows, tenant metrics, the VTC bound and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tessera.bench.runner import AZURE_CONV, cluster_config_from, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios import fair_share as scenario
from tessera.bench.scenarios._common import saturation_rate, slo_capacity
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import summarize
from tessera.sim.workloads import poisson_arrivals


def test_vtc_keeps_the_flood_from_starving_the_fair_tenant() -> None:
    report = scenario.run(BenchConfig("fair-share", options={"requests": 60}), lambda *a, **k: None)
    alone, half, both, vtc, preempt, credit, first, first_half = report.results
    assert [r["policy"] for r in report.results] == [
        "fcfs:tenants=a",
        "fcfs:tenants=a:half-batch",
        "fcfs:tenants=a+b",
        "fcfs:tenants=a+b:vtc",
        "fcfs:tenants=a+b:vtc+preempt",
        "fcfs:tenants=a+b:vtc+credit",
        "fcfs:tenants=a+b:a-first",
        "fcfs:tenants=a+b:a-first:b-half",
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
    # strict priority for a bounds what any order of admissions gives it; b held to half the slots
    # leaves a more of them and b less throughput
    assert first["p99_ttft_s"] < vtc["p99_ttft_s"] and first["slo_attainment"] >= vtc["slo_attainment"]
    assert first_half["b_output_tokens_per_s"] < first["b_output_tokens_per_s"]
    assert first_half["p99_ttft_s"] <= first["p99_ttft_s"]
    # the lift's credit: a tenant with requests running keeps its place ahead of the flood
    assert credit["p99_ttft_s"] < vtc["p99_ttft_s"] and credit["a_wait_order_s"] < vtc["a_wait_order_s"]
    assert 0 < credit["max_service_gap"] <= credit["vtc_bound"] == vtc["vtc_bound"] + 65536
    assert all(line.endswith("PASS") for line in report.checks[-3:])
    config = report.config
    assert config["capacity"] == "slo" and config["capacity_rps"] == config["slo_capacity_rps"]
    assert 0 < config["slo_capacity_rps"] <= config["saturation_rps"]
    assert config["rate_a_rps"] == pytest.approx(config["capacity_rps"] / 2)


def test_the_capacity_is_the_slo_capacity_or_the_saturated_throughput() -> None:
    options = {"requests": 60, "capacity": "saturation"}
    report = scenario.run(BenchConfig("fair-share", options=options), lambda *a, **k: None)
    config = report.config
    assert config["capacity_rps"] == config["saturation_rps"] >= config["slo_capacity_rps"]
    assert config["rate_a_rps"] == pytest.approx(config["saturation_rps"] / 2)
    with pytest.raises(ValueError, match="capacity must be one of slo, saturation"):
        scenario.run(BenchConfig("fair-share", options={"capacity": "peak"}), lambda *a, **k: None)
    with pytest.raises(ValueError, match="capacity_attainment"):
        scenario.run(BenchConfig("fair-share", options={"capacity_attainment": 1.5}), lambda *a, **k: None)


def test_slo_capacity_is_the_largest_rate_that_meets_the_slo() -> None:
    reqs = trace_requests(BenchConfig("fair-share"), AZURE_CONV, 80)
    chat = ServiceClass("chat", kind="interactive", ttft_slo_s=0.5)

    def at(rate: float) -> list[Request]:
        arrivals = poisson_arrivals(len(reqs), rate, np.random.default_rng(1))
        return [replace(r, arrival=float(t), service_class=chat) for r, t in zip(reqs, arrivals, strict=True)]

    cluster = cluster_config_from({}, max_batch=8)

    def attainment(rate: float) -> float:
        done, _ = run_one(at(rate), lambda: make_policy("fcfs"), cluster)
        return summarize(done, qoe=False)["slo_attainment"]

    rate = slo_capacity(at, cluster, 0.9, saturation_rate(reqs, cluster))
    assert attainment(rate) >= 0.9 > attainment(rate * 1.02)


def test_the_cli_writes_the_contracts_json(tmp_path: Path) -> None:
    out = tmp_path / "fair.json"
    command = [sys.executable, "-m", "tessera", "bench", "fair-share", "--set", "requests=20", "--set",
               "policy=edf", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["scenario"] == "fair-share" and data["config"]["policy"] == "edf"
    assert {"p99_ttft_s", "slo_attainment", "max_service_gap", "a_wait_order_s"} <= set(data["results"][3])
