"""``tessera bench lora-routing``: adapter-affinity against round-robin and least-loaded on adapters that
outnumber each engine's slots, on a small run of the Azure trace."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.bench.scenarios import BenchConfig, Options
from tessera.bench.scenarios.lora_routing import adapter_weights, run


def _run(**options: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
    opts = {"requests": 400, "adapters": 12, "max_loras": 3, "loads": "0.7", **options}
    report = run(BenchConfig("lora-routing", options=Options(opts)), lambda n=1, total=None: None)
    return {r["policy"].split(":")[0]: r for r in report.results}, report.checks


def test_affinity_keeps_adapters_in_their_slots_and_the_ttft_tail_short() -> None:
    rows, checks = _run()
    assert set(rows) == {"adapter-affinity", "round-robin", "least-loaded"}
    mine, rr = rows["adapter-affinity"], rows["round-robin"]
    assert all(r["requests"] == 400 for r in rows.values())
    assert 0 < mine["adapter_loads_per_request"] < rr["adapter_loads_per_request"]
    assert mine["p99_ttft_s"] <= 0.5 * rr["p99_ttft_s"]
    assert checks[0].startswith("adapter-affinity vs round-robin:load=0.7") and checks[0].endswith("PASS")


def test_an_engine_that_holds_every_adapter_loads_each_once() -> None:
    rows, _ = _run(max_cpu_loras=12, instances=1)
    # one instance, a cache of all 12 adapters: at most one load per adapter, whatever the route
    assert all(r["adapter_loads"] <= 12 for r in rows.values())


def test_zipf_weights_favour_the_first_adapters() -> None:
    weights = adapter_weights(4, 1.0)
    assert weights.sum() == pytest.approx(1.0)
    assert weights.tolist() == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    assert adapter_weights(4, 0.0).tolist() == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("bad", [{"adapters": 0}, {"max_loras": 0}, {"max_cpu_loras": 1}, {"zipf": -1}])
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _run(**bad)
