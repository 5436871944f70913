"""The ``elis`` bench scenario on a small workload with a cheap predictor (rows, checks, config)."""

from __future__ import annotations

from tessera.sim.scenarios import BenchConfig
from tessera.sim.scenarios.elis import run


def test_elis_scenario_rows_and_checks() -> None:
    cfg = BenchConfig(
        scenario="elis", seed=3, options={"requests": 40, "batches": "1,2", "predictor": "running-mean"}
    )
    report = run(cfg, lambda *a, **k: None)
    names = [r["policy"] for r in report.results]
    assert names[0] == "fcfs:batch=1" and "isrtf:batch=1" in names and "srtf-oracle:batch=2" in names
    assert any(n.startswith("isrtf:batch=2,aging=") for n in names)
    assert all(r["requests"] == 40 for r in report.results)
    by = {r["policy"]: r for r in report.results}
    # the oracle bound never loses to FCFS on the same requests
    assert by["srtf-oracle:batch=1"]["mean_jct_s"] <= by["fcfs:batch=1"]["mean_jct_s"]
    assert report.config["gamma_shape"] == 0.73 and report.config["batches"] == [1, 2]
    assert any(c.startswith("isrtf:batch=1 mean JCT") for c in report.checks)
