"""``tessera bench scale-to-zero`` on the simulator: the rows serve the same requests, the zero rows spend
fewer GPU-seconds, a cold woken request waits for the cold start, the activator releases held requests at
once while clients without it wait for the autoscaler's poll and their retry; under ``tessera`` idle
models sleep on the shared GPUs and wake at the cost of their sleep depth (level 1, level 2 when the
host memory is short, a cold start once stopped or on an extra GPU when their own is full); bad options
are refused by name."""

from __future__ import annotations

import pytest

from tessera.bench.scenarios import BenchConfig, Options
from tessera.bench.scenarios.scale_to_zero import (
    Settings,
    co_resident,
    first_after_idle,
    on_off_arrivals,
    run,
)
from tessera.core.activation import SleepDepth, sleep_depth, wake_cost_s
from tessera.core.profiles import PROFILES
from tessera.core.request import Request

SMALL = {"services": 3, "minutes": 20, "idle_gap_s": 300, "burst_s": 60, "burst_rate": 0.5}


def _rows(**extra: object) -> dict[str, dict]:  # type: ignore[type-arg]
    report = run(BenchConfig("scale-to-zero", options=Options({**SMALL, **extra})), lambda *a, **k: None)
    return {r["policy"]: r for r in report.results}, report.checks  # type: ignore[return-value]


def test_rows_serve_the_same_requests_with_fewer_gpu_seconds_when_idle_services_sleep() -> None:
    rows, checks = _rows()
    on, bare, tessera = rows["always-on"], rows["zero:no-activator"], rows["tessera:cold"]
    assert on["requests"] == bare["requests"] == tessera["requests"] == rows["tessera"]["requests"] > 50
    assert on["lost"] == bare["lost"] == tessera["lost"] == rows["tessera"]["lost"] == 0
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
    ratio = on["gpu_seconds"] / rows["tessera"]["gpu_seconds"]
    assert f"{ratio:.2f}x fewer" in gpu and gpu.endswith("PASS" if ratio >= 3 else "FAIL")


def test_a_short_cold_start_keeps_the_first_requests_after_idle_within_their_slo() -> None:
    rows, _ = _rows(cold_start_s=2.0)
    assert rows["tessera:cold"]["slo_attainment_first_after_idle"] == 1.0
    assert rows["tessera:cold"]["woken_ttft_p99_s"] < 3.0
    assert rows["zero:no-activator"]["slo_attainment_first_after_idle"] < 1.0  # the poll + retry delay


def test_sleeping_models_wake_from_host_memory_in_about_a_second_on_the_gpus_kept_up() -> None:
    rows, checks = _rows(shared_gpus=1, awake_per_gpu=3)
    sleep, on = rows["tessera"], rows["always-on"]
    # One GPU kept up for the 20 minutes: three services' worth of GPU-seconds cut to a third or less.
    assert sleep["mean_gpus"] == pytest.approx(1.0)
    assert sleep["wakes"] == sleep["wakes_level1"] >= 2 and sleep["wakes_extra_gpu"] == 0
    wake = PROFILES["a100-llama3-8b"].wake_time(1)  # 16 GB over 25 GB/s
    # The first request after idle waits the wake-up; a woken one never longer.
    assert wake <= sleep["ttft_first_after_idle_p50_s"] and sleep["woken_ttft_p99_s"] < wake + 1.0
    assert sleep["slo_attainment"] == sleep["slo_attainment_first_after_idle"] == on["slo_attainment"] == 1.0
    assert "level 1" in next(c for c in checks if c.startswith("tessera: "))
    assert all(c.endswith("PASS") for c in checks if c.startswith("tessera ") and "GPU-seconds" not in c)


def test_short_host_memory_sleeps_at_level_2_and_a_long_sleep_stops_the_model_and_frees_its_gpu() -> None:
    rows, _ = _rows(shared_gpus=1, awake_per_gpu=3, host_sleep_gb=0)
    deep = rows["tessera"]
    assert deep["wakes"] == deep["wakes_level2"] >= 2
    level2 = PROFILES["a100-llama3-8b"].wake_time(2)
    assert level2 <= deep["ttft_first_after_idle_p50_s"] and deep["woken_ttft_p99_s"] < level2 + 1.0
    stopped = _rows(shared_gpus=1, awake_per_gpu=3, stop_after_s=30)[0]["tessera"]
    assert stopped["wakes_cold"] >= 1 and stopped["woken_ttft_p99_s"] >= 30.0
    assert stopped["mean_gpus"] < 0.97  # the GPU went down while all were stopped


def test_a_model_whose_gpu_is_full_cold_starts_on_an_extra_gpu() -> None:
    rows, _ = _rows(shared_gpus=1, awake_per_gpu=1, idle_gap_s=60)
    busy = rows["tessera"]
    assert busy["wakes_extra_gpu"] >= 1 and busy["woken_ttft_p99_s"] >= 30.0
    assert busy["mean_gpus"] > 1.01  # the extra GPU counts while used
    assert busy["lost"] == 0


def test_co_resident_models_share_memory_and_compute() -> None:
    p = PROFILES["a100-llama3-8b"]
    two = co_resident(p, 2)
    assert co_resident(p, 1) is p
    assert two.decode_c0 == 2 * p.decode_c0 and two.prefill_p1 == 2 * p.prefill_p1
    kv = two.kv_capacity_tokens * p.kv_bytes_per_token
    assert 2 * kv + p.weights_bytes == pytest.approx(p.kv_capacity_tokens * p.kv_bytes_per_token, rel=1e-3)
    with pytest.raises(ValueError, match="awake_per_gpu=5"):
        co_resident(p, 5)


def test_sleep_depth_and_wake_cost() -> None:
    gb = 10**9
    assert sleep_depth(True, 16 * gb, 20 * gb, 0.0, 3600.0) is SleepDepth.LEVEL1
    assert sleep_depth(True, 16 * gb, 10 * gb, 0.0, 3600.0) is SleepDepth.LEVEL2  # host memory short
    assert sleep_depth(True, 16 * gb, 20 * gb, 3600.0, 3600.0) is SleepDepth.STOPPED  # asleep too long
    assert sleep_depth(True, 16 * gb, 20 * gb, 1e9, None) is SleepDepth.LEVEL1  # never stopped
    assert sleep_depth(False, 16 * gb, 20 * gb, 0.0, None) is SleepDepth.STOPPED  # no sleep mode
    p = PROFILES["a100-llama3-8b"]
    assert wake_cost_s(SleepDepth.LEVEL1, p) == pytest.approx(16e9 / 25e9)
    assert wake_cost_s(SleepDepth.LEVEL2, p) == pytest.approx(8.0)
    assert wake_cost_s(SleepDepth.STOPPED, p) == p.cold_start_s == 30.0
    with pytest.raises(ValueError, match="wake level"):
        p.wake_time(3)


def test_workload_shape_and_first_after_idle() -> None:
    import numpy as np

    s = Settings(minutes=60, burst_s=60, burst_rate=1.0, idle_gap_s=600)
    times = on_off_arrivals(s, np.random.default_rng(0))
    gaps = np.diff(times)
    assert all(0 <= t < 3600 for t in times) and (gaps > 120).sum() >= 2  # long idle gaps between bursts
    reqs = [Request(id=f"r{i}", arrival=t, prompt_tokens=1, max_tokens=1, model=m)
            for i, (t, m) in enumerate([(0, "a"), (10, "a"), (100, "a"), (5, "b"), (200, "b")])]  # fmt: skip
    assert first_after_idle(reqs, 60.0) == {"r0", "r2", "r3", "r4"}


@pytest.mark.parametrize(
    ("key", "value"),
    [("after_s", 0), ("services", 0), ("burst_rate", -1), ("shared_gpus", 0), ("awake_per_gpu", 0),
     ("host_sleep_gb", -1), ("stop_after_s", 0), ("wake_l1_s", -1), ("wake_l2_s", -1)],
)  # fmt: skip
def test_bad_options_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"--set {key} must be"):
        _rows(**{key: value})


def test_load_is_refused_and_rate_sets_the_burst_rate() -> None:
    with pytest.raises(ValueError, match="--load"):
        run(BenchConfig("scale-to-zero", load=0.5, options=Options(SMALL)), lambda *a, **k: None)
    slow = run(BenchConfig("scale-to-zero", rate=0.1, options=Options(SMALL)), lambda *a, **k: None)
    assert slow.config["burst_rate"] == 0.1
    assert slow.results[0]["requests"] < _rows()[0]["always-on"]["requests"]
