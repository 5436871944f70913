"""The ``elis`` bench scenario on a small workload with a cheap predictor (rows, checks, config)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tessera.bench.scenarios import BenchConfig
from tessera.bench.scenarios.elis import run
from tessera.predictor.dataset import is_validation
from tessera.predictor.train import DEFAULT_ARTIFACT_DIR


def test_elis_scenario_rows_and_checks() -> None:
    opts = {"requests": 40, "batches": "1,2", "predictor": "running-mean", "seeds": 1}
    report = run(BenchConfig(scenario="elis", seed=3, options=opts), lambda *a, **k: None)
    names = [r["policy"] for r in report.results]
    assert names[0] == "fcfs:batch=1" and "isrtf:batch=1" in names and "srtf-oracle:batch=2" in names
    assert {"isrtf:batch=2,guard=off", "isrtf-tail:batch=2"} <= set(names)
    assert all(r["requests"] == 40 for r in report.results)
    by = {r["policy"]: r for r in report.results}
    # the oracle bound never loses to FCFS on the same requests
    assert by["srtf-oracle:batch=1"]["mean_jct_s"] <= by["fcfs:batch=1"]["mean_jct_s"]
    assert report.config["gamma_shape"] == 0.73 and report.config["batches"] == [1, 2]
    assert any(c.startswith("isrtf:batch=1 mean JCT") for c in report.checks)
    # the guard's tail target, and every row against fcfs at its batch size (default tolerance 10%)
    assert any(c.startswith("isrtf-tail:batch=2 p99 JCT") and "x fcfs's" in c for c in report.checks)
    tails = [c for c in report.checks if " vs fcfs:batch=1: throughput " in c]
    assert len(tails) == 4 and all(c.endswith(("PASS", "FAIL")) and "(no worse than 10%)" in c for c in tails)
    for row in report.results:  # tails and costs next to the headline
        assert {"p50_ttft_s", "p99_ttft_s", "p50_jct_s", "p99_jct_s", "throughput_rps", "preemptions"} <= set(
            row
        )


def test_elis_scenario_guard_and_tolerance_settings() -> None:
    opts = {"requests": 30, "batches": "1", "predictor": "running-mean", "seeds": 1, "guard_credit": 0.0,
            "tolerance": 0.5}  # fmt: skip
    report = run(BenchConfig(scenario="elis", seed=1, options=opts), lambda *a, **k: None)
    by = {r["policy"]: r for r in report.results}
    # guard_credit=0 makes the shipped row the guard-off one (fresh predictors: no row learns from another)
    assert by["isrtf:batch=1"]["mean_jct_s"] == by["isrtf:batch=1,guard=off"]["mean_jct_s"]
    assert report.config["guard_credit"] == 0.0 and report.config["aging_tokens_per_s"] == 0.0
    assert report.config["tolerance"] == 0.5
    assert any("(no worse than 50%)" in c for c in report.checks)
    with pytest.raises(ValueError, match="tolerance"):
        run(BenchConfig(scenario="elis", options={**opts, "tolerance": 1.5}), lambda *a, **k: None)


def test_elis_scenario_checks_the_seed_means() -> None:
    opts = {"requests": 40, "batches": "1", "predictor": "running-mean", "seeds": 2}
    report = run(BenchConfig(scenario="elis", seed=3, options=opts), lambda *a, **k: None)
    by = {r["policy"]: r for r in report.results}
    assert {"fcfs:batch=1,seed=3", "fcfs:batch=1,seed=4", "fcfs:batch=1"} <= set(by)
    seeds = [by[f"fcfs:batch=1,seed={s}"]["mean_jct_s"] for s in (3, 4)]
    assert seeds[0] != seeds[1]  # two draws of requests and arrivals
    assert by["fcfs:batch=1"]["mean_jct_s"] == pytest.approx(sum(seeds) / 2)
    assert report.config["seeds"] == [3, 4]
    assert report.checks[0].startswith("mean of seeds 3..4: srtf-oracle:batch=1 mean JCT")
    assert any(c.startswith("  seed 4: isrtf:batch=1 mean JCT") for c in report.checks)


def test_elis_runs_the_online_row_and_leads_isrtf_rows_with_their_ranking(tmp_path: Path) -> None:
    # 40 rows of the smollm2 head's own held-out prompts: another file than its training data, all rows kept
    shipped = Path(DEFAULT_ARTIFACT_DIR / "smollm2" / "data.jsonl.gz")
    with gzip.open(shipped, "rt") as fh:
        rows = [line for line in fh if is_validation(json.loads(line)["prompt_id"], 0.2)]
    data = tmp_path / "unseen.jsonl.gz"
    with gzip.open(data, "wt") as fh:
        fh.writelines(rows[:40])
    opts = {"requests": 40, "batches": "1", "seeds": 1, "artifact": "smollm2", "data": str(data),
            "refit_every": 10, "min_samples": 10}  # fmt: skip
    report = run(BenchConfig(scenario="elis", seed=0, options=opts), lambda *a, **k: None)
    by = {r["policy"]: r for r in report.results}
    online = by["isrtf:batch=1,online"]
    assert list(online)[:4] == ["policy", "step0_tau", "within_step_tau", "pooled_tau"]
    assert -1.0 <= online["step0_tau_per_refit"] <= 1.0  # τ among the requests of one refit
    assert "step0_tau" in by["isrtf:batch=1"] and "step0_tau" not in by["fcfs:batch=1"]
    (learner,) = report.config["online"]["learners"]["isrtf:batch=1,online"]
    # ISRTF hands a finished request over at its next prediction: the last one's never comes
    assert learner["seen"] == 39 and learner["refits"] + learner["rejected"] == 3  # at 10, 20 and 30
    online_checks = [c for c in report.checks if c.startswith("isrtf:batch=1,online recovers")]
    assert len(online_checks) == 1 and online_checks[0].endswith(("PASS", "FAIL"))
