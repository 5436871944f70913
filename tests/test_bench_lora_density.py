"""``tessera bench lora-density``: the fewest GPUs that hold every adapter's SLO, shared on one base
against one deployment per adapter, on a small run of the Azure trace."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.bench.scenarios import BenchConfig, Options
from tessera.bench.scenarios.lora_density import run


def _run(**options: Any) -> dict[str, dict[str, Any]]:
    config = BenchConfig("lora-density", options=Options({"requests": 300, "adapters": 4, **options}))
    report = run(config, lambda n=1, total=None: None)
    assert len(report.checks) == len(str(options.get("scales", "1,4,16,64")).split(","))
    return {r["policy"]: r for r in report.results}


def test_shared_needs_fewer_gpus_and_each_count_holds_the_target() -> None:
    rows = _run(scales="1,48")
    for scale in ("x1", "x48"):
        shared, dedicated = rows[f"shared:{scale}"], rows[f"dedicated:{scale}"]
        assert dedicated["gpus"] >= 4  # at least one GPU per adapter
        assert 1 <= shared["gpus"] <= dedicated["gpus"]
        assert min(shared["worst_adapter_slo_attainment"], dedicated["worst_adapter_slo_attainment"]) >= 0.95
    assert rows["shared:x1"]["gpus"] == 1
    assert rows["shared:x48"]["gpus"] > 1  # 48 times the trace's rate is more than one H100's


def test_the_adapters_overhead_costs_gpus_not_attainment() -> None:
    light = _run(scales="48", lora_overhead=0.0)["shared:x48"]
    heavy = _run(scales="48", lora_overhead=1.0)["shared:x48"]
    assert heavy["gpus"] > light["gpus"]
    assert heavy["worst_adapter_slo_attainment"] >= 0.95


@pytest.mark.parametrize("bad", [{"adapters": 0}, {"target": 1.5}, {"lora_overhead": -0.1}, {"scales": "0"}])
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _run(**bad)


def test_shared_runs_on_the_adapter_engine_whose_slots_bound_it() -> None:
    # One GPU slot for four adapters: a batch runs one adapter at a time, and a request of another
    # waits for every request of the one in the batch; no count up to max_instances holds the TTFT SLO.
    slots = _run(scales="16", max_loras=1, max_instances=16)["shared:x16"]
    every = _run(scales="16")["shared:x16"]
    assert every["gpus"] is not None and every["worst_adapter_slo_attainment"] >= 0.95
    assert slots["gpus"] is None and slots["worst_adapter_slo_attainment"] < 0.95
