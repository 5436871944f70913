"""Every bench scenario honours ``--trace`` (two different traces give different rows) or refuses it
with a message that says what it takes; rate series are read, validated and sampled."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.api.traces import load_rate_series, load_trace, read_trace
from tessera.bench.scenarios import BenchConfig, BenchReport, Options
from tessera.cli import main
from tessera.sim.workloads import series_arrivals

# Keys that measure this machine (timing), not the simulated run.
NOISE = {"wall_s", "cpu_s", "solve_p50_s", "load_avg_1m", "sim_requests_per_s"}


# ---- small traces ----------------------------------------------------------------------------------------
def _requests_csv(path: Path, seed: int, scale: float, n: int = 200) -> Path:
    """A generic trace: bursty arrivals, lengths scaled by ``scale``."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(0.5, n) * np.where(np.arange(n) % 40 < 30, 1.0, 0.05)
    lines = ["arrival_s,input_tokens,output_tokens"]
    t = 0.0
    for gap in gaps:
        t += float(gap)
        lines.append(f"{t:.4f},{int(rng.integers(20, 500) * scale)},{int(rng.integers(8, 200) * scale)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _series_csv(path: Path, windows: list[tuple[float, float]], cv: list[float] | None = None) -> Path:
    lines = ["window_start_s,rate_rps" + (",cv" if cv else "")]
    for i, (start, rate) in enumerate(windows):
        lines.append(f"{start},{rate}" + (f",{cv[i]}" if cv else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def _lengths_csv(path: Path, seed: int, n: int = 20000) -> Path:
    """An output-length file in the SSJF/LMSYS layout: no arrival times, no prompt lengths."""
    rng = np.random.default_rng(seed)
    lines = ["row,output_token_length,model"]
    lines += [f"{i},{int(x)},vicuna-13b" for i, x in enumerate(rng.integers(4 * seed, 120 * seed, n))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _mooncake(path: Path, seed: int, n: int = 120) -> Path:
    """A Mooncake-format trace: turns of a few conversations sharing prompt blocks."""
    rng = np.random.default_rng(seed)
    lines, t = [], 0
    for _ in range(n):
        t += int(rng.integers(50, 1500 if seed % 2 else 400))
        blocks = int(rng.integers(1, 5))
        base = 100 * int(rng.integers(0, 6))
        ids = [base + b for b in range(blocks)]
        doc = {"timestamp": t, "input_length": blocks * 512 - int(rng.integers(0, 300)),
               "output_length": int(rng.integers(5, 200)), "hash_ids": ids}  # fmt: skip
        lines.append(json.dumps(doc))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("traces")
    return {
        "a": _requests_csv(d / "a.csv", 1, 1.0),
        "b": _requests_csv(d / "b.csv", 2, 2.5),
        # Short windows of very different rates, so a few dozen arrivals already span several.
        "series_a": _series_csv(d / "sa.csv", [(0, 4.0), (2, 0.2), (10, 6.0), (12, 0.3)]),
        "series_b": _series_csv(
            d / "sb.csv", [(0, 0.5), (5, 8.0), (6, 0.5), (20, 3.0)], [1.0, 3.0, 1.0, 0.5]
        ),
        "lengths_a": _lengths_csv(d / "la.csv", 1),
        "lengths_b": _lengths_csv(d / "lb.csv", 5),
        "mooncake_a": _mooncake(d / "ma.jsonl", 1),
        "mooncake_b": _mooncake(d / "mb.jsonl", 2),
    }


def _rows(report: BenchReport) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in NOISE} for row in report.results]


def _run(module: Any, trace: Path | None, rate: float | None = None, **options: Any) -> list[dict[str, Any]]:
    config = BenchConfig(module.__name__.rsplit(".", 1)[1], trace=trace, rate=rate, options=Options(options))
    return _rows(module.run(config, _no_progress))


def _no_progress(n: int = 1, total: int | None = None) -> None:
    return None


def _differ(module: Any, first: Path, second: Path, rate: float | None = None, **options: Any) -> None:
    """The scenario's rows on ``first`` and on ``second`` differ (the trace is not ignored)."""
    one, two = _run(module, first, rate, **options), _run(module, second, rate, **options)
    assert [r["policy"] for r in one] and one != two


# ---- the formats -----------------------------------------------------------------------------------------
def test_rate_series_is_read_and_told_apart_from_requests(traces: dict[str, Path], tmp_path: Path) -> None:
    series = read_trace(traces["series_b"]).series
    assert series is not None and series.has_cv and series.end_s == 34.0
    assert [w.rate_rps for w in series.windows] == [0.5, 8.0, 0.5, 3.0]
    assert read_trace(traces["a"]).rows is not None and read_trace(traces["a"]).series is None
    lengths = read_trace(traces["lengths_a"]).lengths
    assert lengths is not None and len(lengths) == 20000 and lengths[0][0] is None
    with pytest.raises(ValueError, match="rate series"):
        load_trace(traces["series_a"])
    bad = {
        "window_start_s,rate_rps\n0,1\n0,2\n": "after the previous",
        "window_start_s,rate_rps\n0,-1\n5,2\n": ">= 0",
        "window_start_s,rate_rps\n0,0\n5,0\n": "no request would arrive",
        "window_start_s,rate_rps,cv\n0,1,0\n5,2,1\n": "cv must be > 0",
        "window_start_s,rate_rps,cv\n0,1,1\n5,2,\n": "every window or on none",
        "window_start_s,rate_rps\n0,1\n": "at least two windows",
        "window_start_s,rate_rps\n0,x\n5,1\n": "rate_rps must be a number",
    }
    for text, message in bad.items():
        path = tmp_path / "bad.csv"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_rate_series(path)


def test_series_arrivals_follow_the_rates(tmp_path: Path) -> None:
    path = _series_csv(tmp_path / "s.csv", [(0, 10.0), (100, 0.0), (200, 2.0)], [1.0, 1.0, 4.0])
    series = load_rate_series(path)
    rng = np.random.default_rng(0)
    times = series_arrivals(series, 4000, rng, "poisson")
    one_pass = times[times < series.end_s]
    assert 900 < np.sum(one_pass < 100) < 1100  # 10 req/s for 100 s
    assert np.sum((one_pass >= 100) & (one_pass < 200)) == 0  # rate 0 stays empty
    assert 150 < np.sum(one_pass >= 200) < 250  # 2 req/s for the last 100 s (as long as the one before)
    assert np.all(np.diff(times) >= 0) and times.max() > series.end_s  # repeated to reach n
    gaps = np.diff(series_arrivals(series, 190, np.random.default_rng(1), "gamma")[:1000])
    burst = np.diff(series_arrivals(series, 190, np.random.default_rng(1), "poisson")[:1000])
    assert np.std(gaps) == pytest.approx(np.std(burst), rel=0.5)  # cv 1 in the first window: Poisson-like
    hi = series_arrivals(series, 1200, np.random.default_rng(2), "gamma")
    last = np.diff(hi[(hi >= 200) & (hi < 300)])
    assert np.std(last) / np.mean(last) > 2  # cv 4 in the last window
    with pytest.raises(ValueError, match="cv column"):
        series_arrivals(load_rate_series(_series_csv(tmp_path / "n.csv", [(0, 1), (5, 2)])), 5, rng, "gamma")
    with pytest.raises(ValueError, match="poisson, gamma"):
        series_arrivals(series, 5, rng, "uniform")


# ---- one test per scenario -------------------------------------------------------------------------------
def test_baseline_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import baseline

    _differ(baseline, traces["a"], traces["b"], requests=40, loads="0.8")
    _differ(baseline, traces["series_a"], traces["series_b"], requests=40, loads="0.8")
    _differ(baseline, traces["lengths_a"], traces["lengths_b"], requests=40, loads="0.8")
    with pytest.raises(ValueError, match="--set rate_dist=uniform: one of poisson, gamma"):
        _run(baseline, traces["series_a"], requests=40, rate_dist="uniform")


def test_perf_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import perf

    opts = {"requests": 150, "instances": 2, "capacity_requests": 40}
    _differ(perf, traces["a"], traces["b"], **opts)
    _differ(perf, traces["series_a"], traces["series_b"], **opts)
    _differ(perf, traces["lengths_a"], traces["lengths_b"], **opts)


def test_elis_honours_trace_series_and_data(traces: dict[str, Path], tmp_path: Path) -> None:
    from tessera.bench.scenarios import elis

    opts = {"requests": 30, "batches": "1", "seeds": 1, "predictor": "running-mean"}
    default = _run(elis, None, **opts)
    with_trace = _run(elis, traces["a"], **opts)
    assert with_trace != default  # the trace's arrivals replace the Gamma ones
    assert with_trace != _run(elis, traces["b"], **opts)
    _differ(elis, traces["series_a"], traces["series_b"], **opts)
    with pytest.raises(ValueError, match=r"no arrival times.*a trace of requests or a rate series"):
        _run(elis, traces["lengths_a"], **opts)
    sets = []
    for k in (1, 4):
        path = tmp_path / f"data{k}.jsonl"
        rows = [{"prompt": f"question {i} " * (1 + i % 7), "response": "word " * (k * (5 + 13 * (i % 9)))}
                for i in range(40)]  # fmt: skip
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        sets.append(_run(elis, None, data=str(path), **opts))
    assert sets[0] != sets[1]


def test_elis_refuses_a_lengths_file_before_loading_the_predictor(
    traces: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessera.bench.scenarios import elis

    def no_predictor(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the predictor was loaded before --trace was checked")

    monkeypatch.setattr(elis, "_predictor", no_predictor)
    with pytest.raises(ValueError, match=r"no arrival times"):
        _run(elis, traces["lengths_a"], requests=30, batches="1", seeds=1)


def test_andes_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import andes

    opts = {"requests": 40, "seeds": 1, "workload": "azure"}
    one = _run(andes, traces["a"], 1.0, **opts)
    assert one[0]["policy"].startswith("fcfs:a,rate=1")  # named after the replayed file, not "azure"
    assert one != _run(andes, traces["b"], 1.0, **opts)
    _differ(andes, traces["series_a"], traces["series_b"], 1.0, **opts)
    _differ(andes, traces["lengths_a"], traces["lengths_b"], 1.0, **opts)
    _differ(andes, traces["lengths_a"], traces["lengths_b"], 1.0, seeds=1, workload="bursty", duration_s=30)
    # The bursty workload draws its lengths from the trace.
    _differ(andes, traces["a"], traces["b"], 1.0, seeds=1, workload="bursty", duration_s=30)
    with pytest.raises(ValueError, match="bursty cannot take a rate series"):
        _run(andes, traces["series_a"], 1.0, seeds=1, workload="bursty")
    with pytest.raises(ValueError, match="solver cannot take a trace"):
        _run(andes, traces["a"], 1.0, workload="solver")


def test_qlm_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import qlm

    _differ(qlm, traces["a"], traces["b"], part="single", requests=80)
    _differ(qlm, traces["series_a"], traces["series_b"], part="single", requests=80)
    _differ(qlm, traces["lengths_a"], traces["lengths_b"], part="single", requests=80)
    _differ(qlm, traces["a"], traces["b"], part="multi", requests=60)
    _differ(qlm, traces["a"], traces["b"], part="estimator", requests=120, max_batch=8, snapshot_s=5)
    with pytest.raises(ValueError, match="eviction take no --trace"):
        _run(qlm, traces["a"], part="single,eviction", requests=80)
    with pytest.raises(ValueError, match="choose among single, multi"):
        _run(qlm, traces["series_a"], part="estimator")
    # A trace shorter than the part's default count runs whole; one shorter than an asked count is refused.
    rows = _run(qlm, traces["a"], part="multi")
    assert {r["requests"] for r in rows} == {200}
    with pytest.raises(ValueError, match="has 200 requests; --set requests=300 needs more"):
        _run(qlm, traces["a"], part="multi", requests=300)


def test_chiron_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import chiron

    opts = {"interactive_requests": 60, "batch_requests": 20, "dispatch": "arrival", "max_instances": 4}
    _differ(chiron, traces["a"], traces["b"], **opts)
    _differ(chiron, traces["series_a"], traces["series_b"], **opts)
    _differ(chiron, traces["lengths_a"], traces["lengths_b"], **opts)
    with pytest.raises(ValueError, match="rate series as --trace gives the interactive arrivals"):
        _run(chiron, traces["series_a"], interactive_arrivals="gamma", **opts)


def test_routing_honours_trace_and_series(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import routing

    opts = {"requests": 60, "loads": "0.8", "instances": 2}
    _differ(routing, traces["mooncake_a"], traces["mooncake_b"], **opts)
    _differ(routing, traces["series_a"], traces["series_b"], **opts)
    _differ(routing, traces["lengths_a"], traces["lengths_b"], **opts)
    with pytest.raises(ValueError, match="no hash_ids"):
        _run(routing, traces["a"], **opts)


def test_fidelity_replays_the_trace(traces: dict[str, Path]) -> None:
    """The real-vLLM replay needs a server; its requests come from ``replay_rows``."""
    from tessera.bench.scenarios.fidelity import replay_rows

    def rows(trace: Path) -> tuple[list[float], list[int], list[int]]:
        got, inp, out = replay_rows(BenchConfig("fidelity", trace=trace, options=Options()), 30, 4.0, 2.0)
        return [r.arrival for r in got], inp.tolist(), out.tolist()

    assert rows(traces["a"]) != rows(traces["b"])
    series_a, series_b = rows(traces["series_a"]), rows(traces["series_b"])
    assert series_a[0] != series_b[0] and series_a[1:] == series_b[1:]  # arrivals differ, Azure lengths
    lengths_a, lengths_b = rows(traces["lengths_a"]), rows(traces["lengths_b"])
    assert lengths_a[:2] == lengths_b[:2] and lengths_a[2] != lengths_b[2]  # Azure arrivals, their outputs


@pytest.mark.parametrize(
    "scenario",
    ["seallm", "worker-overhead", "decision-time", "real-policy", "real-sharing", "real-lora", "router"],
)
def test_scenarios_without_a_trace_refuse_it(
    scenario: str, traces: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", scenario, "--trace", str(traces["a"])]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"tessera bench {scenario} takes no --trace: it " in err and "--set" in err


def test_a_refused_part_exits_2_with_what_it_takes(
    traces: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "qlm", "--trace", str(traces["a"]), "--set", "part=solver"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "solver take no --trace" in err and "choose among estimator, single, multi" in err


def test_scenario_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "elis", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--trace" in out and "Options (``--set``): requests (400)" in out and "rate_dist" in out


def test_progress_never_passes_its_total(traces: dict[str, Path]) -> None:
    from tessera.bench.scenarios import andes, elis

    for module, options in (
        (elis, {"requests": 20, "batches": "1,2", "seeds": 2, "predictor": "running-mean"}),
        (andes, {"requests": 30, "seeds": 2, "duration_s": 20}),
    ):
        state = {"done": 0, "total": None}

        def progress(n: int = 1, total: int | None = None, state: dict = state) -> None:
            if total is not None:
                state["total"] = total
            state["done"] += n
            assert state["total"] is not None and state["done"] <= state["total"]

        module.run(BenchConfig("x", rate=1.0, options=Options(options)), progress)
        assert state["done"] == state["total"]


def test_andes_calibration_moves_its_bracket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace that loses QoE at lower rates than the default bracket (quantised timestamps: many
    requests at once) is calibrated, not refused."""
    from tessera.bench.scenarios import andes

    monkeypatch.setattr(andes, "fcfs_qoe", lambda rates, cluster: 1.0 / (1.0 + rates[0]))
    rate, qoe = andes.calibrate(lambda r: [r], None, 1.0, 4.0, 0.85, 8, below=True)  # type: ignore[arg-type]
    assert 0.125 <= rate <= 0.25 and qoe < 0.85 and rate == pytest.approx(0.15 / 0.85, rel=0.05)
    rate, _ = andes.calibrate(lambda r: [r], None, 1.0, 4.0, 0.05, 8, below=True)  # type: ignore[arg-type]
    assert 16 <= rate <= 32
    with pytest.raises(ValueError, match="do not bracket"):
        andes.calibrate(lambda r: [r], None, 1.0, 4.0, 1.5, 3, below=True)  # type: ignore[arg-type]


def test_andes_on_prompts_whose_prefill_outlasts_the_ttft_target_names_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """40k-token prompts: even alone a request misses T*, so FCFS cannot be calibrated to the paper's
    QoE; the error says what any policy can reach and which setting to lower, and a run at a given
    rate says the 0.95 target is out of reach."""
    rng = np.random.default_rng(0)
    lines = ["arrival_s,input_tokens,output_tokens"]
    for i in range(30):
        lines.append(f"{2.0 * i},{int(rng.integers(38_000, 40_000))},{int(rng.integers(50, 150))}")
    trace = tmp_path / "long.csv"
    trace.write_text("\n".join(lines) + "\n")
    args = ["bench", "andes", "--trace", str(trace), "--set", "workload=azure", "--set", "seeds=1"]
    assert main([*args, "--set", "fcfs_qoe_azure=0.99"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Served alone on an idle instance" in err and "--set fcfs_qoe_azure=Q" in err
    assert main([*args, "--rate", "0.01"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "bound on any policy's avg QoE" in out and "out of reach on this workload" in out


# ---- Chiron: held batch work is served, a real deadlock fails clearly ---------------------------------
def test_chiron_gives_held_batch_work_an_instance() -> None:
    """Queued batch work with nothing but an interactive instance left must get an instance: a group
    past its deadline (late whatever is launched) counts against one more batch SLO, and a queue the
    backpressure does not see (one request: nothing ahead of it) keeps one batch instance."""
    from tessera.core.planners.chiron import chiron_decide
    from tessera.core.planners.types import (
        AutoscalerState,
        BatchGroup,
        ChironSettings,
        MetricsSnapshot,
        RoleCounts,
    )

    settings = ChironSettings(max_instances=8, load_time_s=30.0, batch_slo_s=600.0)
    late = MetricsSnapshot(
        ready=RoleCounts(interactive=1),
        batch_queue=(BatchGroup(deadline=100.0, count=5000),),
        mean_output_tokens=200.0,
        std_output_tokens=50.0,
    )
    decision = chiron_decide(late, AutoscalerState(), settings, now=400.0)
    reasons = " ".join(decision.reasons)
    assert decision.desired.batch >= 1 and "batch backpressure: 1 groups late" in reasons
    one = replace(late, batch_queue=(BatchGroup(deadline=900.0, count=1),))
    decision = chiron_decide(one, AutoscalerState(), settings, now=400.0)
    assert decision.desired.batch == 1 and "no batch or mixed instance" in " ".join(decision.reasons)
    with_mixed = replace(one, ready=RoleCounts(interactive=1, mixed=1))
    assert chiron_decide(with_mixed, AutoscalerState(), settings, now=400.0).desired.batch == 0
    deferred = replace(settings, defer=True)  # far from its deadline: defer holds it back on purpose
    far = replace(one, batch_queue=(BatchGroup(deadline=4000.0, count=1),))
    assert chiron_decide(far, AutoscalerState(), deferred, now=400.0).desired.batch == 0


def test_chiron_serves_every_held_request_of_a_hopeless_bulk() -> None:
    """A bulk whose deadline no launch can meet, on mixed instances that scale down while it is queued:
    this stalled ("requests held in the global queue"); every request must finish, late."""
    from tessera.bench.scenarios import chiron

    opts = {"interactive_requests": 50, "batch_requests": 1200, "batch_deadline_s": 10.0,
            "dispatch": "arrival", "max_instances": 4}  # fmt: skip
    rows = chiron.run(BenchConfig("chiron", options=Options(opts)), _no_progress).results
    assert [r["requests"] for r in rows] == [1250] * len(rows) and len(rows) >= 2  # chiron, baselines
    assert rows[0]["slo_attainment_by_class"]["batch"] == 0.0  # served, after the deadline


def test_a_stalled_simulation_says_why_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tessera.bench.scenarios import baseline
    from tessera.core.baselines import FCFS
    from tessera.core.profiles import load_profile
    from tessera.sim.cluster import (
        Cluster,
        ClusterConfig,
        ClusterController,
        ClusterRouter,
        SimulationStalled,
    )
    from tessera.sim.workloads import build_requests

    class Hold(ClusterRouter):
        def route(self, req, view):  # type: ignore[no-untyped-def]
            return None

    class Never(ClusterController):
        interval_s = 1.0

        def tick(self, view):  # type: ignore[no-untyped-def]
            return []

    reqs = build_requests([0.0, 0.0], [50, 60], [20, 10], np.random.default_rng(0))
    config = ClusterConfig(profiles={"default": load_profile("a100-llama3-8b")}, instances=1)
    with pytest.raises(
        SimulationStalled, match=r"2 requests held .*\(2 interactive\).*\(instances: 1 default\)"
    ):
        Cluster(config, FCFS, router=Hold(), controller=Never()).run(reqs)

    def stalls(config: BenchConfig, progress: Any) -> BenchReport:
        raise SimulationStalled("simulation stalled at t=1.000s: 2 requests held")

    monkeypatch.setattr(baseline, "run", stalls)
    assert main(["bench", "baseline"]) == 1
    assert "tessera bench baseline: simulation stalled at t=1.000s" in capsys.readouterr().err
