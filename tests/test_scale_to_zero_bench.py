"""``tessera bench scale-to-zero`` on the simulator: the three rows serve the same requests, the zero
rows spend fewer GPU-seconds, a woken request waits for the cold start, the activator releases held
requests at once while clients without it wait for the autoscaler's poll and their retry, and bad
options are refused by name."""

from __future__ import annotations

import pytest

from tessera.bench.scenarios import BenchConfig, Options
from tessera.bench.scenarios.scale_to_zero import Settings, first_after_idle, on_off_arrivals, run
from tessera.core.request import Request

SMALL = {"services": 3, "minutes": 20, "idle_gap_s": 300, "burst_s": 60, "burst_rate": 0.5}


def _rows(**extra: object) -> dict[str, dict]:  # type: ignore[type-arg]
    report = run(BenchConfig("scale-to-zero", options=Options({**SMALL, **extra})), lambda *a, **k: None)
    return {r["policy"]: r for r in report.results}, report.checks  # type: ignore[return-value]


def test_rows_serve_the_same_requests_with_fewer_gpu_seconds_when_idle_services_sleep() -> None:
    rows, checks = _rows()
    on, bare, tessera = rows["always-on"], rows["zero:no-activator"], rows["tessera"]
    assert on["requests"] == bare["requests"] == tessera["requests"] > 50
    assert on["lost"] == bare["lost"] == tessera["lost"] == 0
    assert on["wakes"] == 0 and on["woken_requests"] == 0 and on["models_per_gpu"] == pytest.approx(1.0)
    assert tessera["wakes"] >= 2 and tessera["gpu_seconds"] < on["gpu_seconds"] / 2
    # A woken request waits for the cold start (30 s); at always-on the same first requests do not wait.
    assert 30.0 <= tessera["woken_ttft_p99_s"] < 31.0
    assert on["ttft_first_after_idle_p99_s"] < 1.0 <= 30.0 <= tessera["ttft_first_after_idle_p50_s"]
    # Without the activator the instance starts at the next poll and a client comes back at its retry.
    assert bare["woken_ttft_p99_s"] > tessera["woken_ttft_p99_s"]
    assert bare["ttft_first_after_idle_p50_s"] > tessera["ttft_first_after_idle_p50_s"]
    assert bare["slo_attainment"] <= tessera["slo_attainment"] < on["slo_attainment"] == 1.0
    assert checks[-1] == "tessera requests lost: 0 (target 0): PASS"
    (gpu,) = [c for c in checks if c.startswith("tessera GPU-seconds")]
    ratio = on["gpu_seconds"] / tessera["gpu_seconds"]
    assert f"{ratio:.2f}x fewer" in gpu and gpu.endswith("PASS" if ratio >= 3 else "FAIL")


def test_a_short_wake_up_keeps_the_first_requests_after_idle_within_their_slo() -> None:
    rows, checks = _rows(cold_start_s=2.0)
    assert rows["tessera"]["slo_attainment_first_after_idle"] == 1.0
    assert rows["tessera"]["woken_ttft_p99_s"] < 3.0
    assert rows["zero:no-activator"]["slo_attainment_first_after_idle"] < 1.0  # the poll + retry delay
    assert any("SLO attainment" in c and c.endswith("PASS") for c in checks)


def test_workload_shape_and_first_after_idle() -> None:
    import numpy as np

    s = Settings(minutes=60, burst_s=60, burst_rate=1.0, idle_gap_s=600)
    times = on_off_arrivals(s, np.random.default_rng(0))
    gaps = np.diff(times)
    assert all(0 <= t < 3600 for t in times) and (gaps > 120).sum() >= 2  # long idle gaps between bursts
    reqs = [Request(id=f"r{i}", arrival=t, prompt_tokens=1, max_tokens=1, model=m)
            for i, (t, m) in enumerate([(0, "a"), (10, "a"), (100, "a"), (5, "b"), (200, "b")])]  # fmt: skip
    assert first_after_idle(reqs, 60.0) == {"r0", "r2", "r3", "r4"}


@pytest.mark.parametrize(("key", "value"), [("after_s", 0), ("services", 0), ("burst_rate", -1)])
def test_bad_options_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"--set {key} must be"):
        _rows(**{key: value})


def test_load_is_refused_and_rate_sets_the_burst_rate() -> None:
    with pytest.raises(ValueError, match="--load"):
        run(BenchConfig("scale-to-zero", load=0.5, options=Options(SMALL)), lambda *a, **k: None)
    slow = run(BenchConfig("scale-to-zero", rate=0.1, options=Options(SMALL)), lambda *a, **k: None)
    assert slow.config["burst_rate"] == 0.1
    assert slow.results[0]["requests"] < _rows()[0]["always-on"]["requests"]
