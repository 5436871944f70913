"""Scenario ``chiron``: Chiron's hierarchical autoscaler vs a utilization-threshold autoscaler.

Workload (the Chiron paper's mixed workload, scaled down about 5x in GPUs and 6x in time): interactive
requests (SLO TTFT 10 s, ITL 200 ms) arrive by a Gamma process of CV ``interactive_cv`` at
``interactive_rate`` (default CV 4, 10 req/s, 7000 requests; paper: 30 req/s), Poisson, or the trace's
own timestamps rescaled to the rate (Azure 2023 conversation trace); at ``batch_at`` (60 s) a bulk of
``batch_requests`` (30,000; paper: 1M) batch requests arrives that must finish within
``batch_deadline_s`` (600 s; paper: 1 h; ITL SLO 2 s). Token lengths come from the trace or from a
lognormal ShareGPT fit (``lengths=sharegpt``). ``--trace`` takes a trace of requests (its lengths, and
its timestamps with ``interactive_arrivals=trace``), a lengths file (its lengths) or a rate series:
the interactive arrivals then come from the series (sampled by ``rate_dist``: poisson, or gamma with
each window's cv; rescaled to the rate like a trace's timestamps), with the Azure conversation lengths.
The cap is 25 instances (paper: 50 GPUs). Every row gets the same requests, seed, profile, instance
bounds, initial instances and cold start.

Rows (mechanisms: ``tessera.core.chiron``; the simulator's adapters: ``tessera.sim.autoscaling``):

- ``chiron``: ``ChironPolicy`` around EDF on every instance (batch size from ITL and throughput
  backpressure), ``evaluate_group`` every ``T_eval`` and at once when interactive requests wait, and
  Chiron's routing (``chiron_pick``; batch work waits in the ``GlobalQueue`` and is pulled by batch
  instances and the spare capacity of mixed ones, ``batch_pulls``; the live router runs the same
  dispatch, ``tessera.router.chiron_hold``, docs/bench.md). ``chiron:defer=true`` (``defer_variant``): BBP
  counts a group only near its deadline; ``chiron:op=X`` (``op_history_variant``): Θ_op = 1 / p99
  arrival spike of the history over windows of the load time (paper §5.2). ``chiron:forecast``
  (``forecast_variant``, on by default): load forecasting, our extension: Θ_op follows the trend of
  the interactive arrival rate (over ``forecast_window_s``, 60 s) one load time ahead, aiming at
  ``forecast_utilization`` (0.8) busy instances then (``tessera.core.planners.chiron.forecast_theta``).
- ``chiron:lean`` (``lean_variant``, on by default): the paper's rule with two of its settings changed
  (``ChironSettings``; on a cluster the ServingPool's ``overProvisioning`` and
  ``scaleDownCooldownSeconds``): Θ_op = ``lean_over_provisioning`` (1: no standing spare, interactive
  capacity grows when an interactive request finds no instance with room) and a scale-down cooldown of
  ``lean_cooldown_s`` (default: the load time, the longest a retired instance takes to come back,
  instead of 120 s). Most of its saving against ``chiron`` is the spare Θ_op = 1/3 keeps; batch
  instances are sized by the same backpressure rule.
- ``threshold:band=LO-HI``: a Llumnix-style baseline: every 10 s, ±1 instance when the utilization
  leaves [LO, HI]; static batch size 256 (vLLM's max_num_seqs); FCFS. ``dispatch``: ``arrival`` (each
  request at once to the least-loaded instance), ``pull`` (one FCFS queue that instances pull, as
  Llumnix's migration would), ``pull-priority`` (interactive first). ``utilization``: ``demand``
  (Llumnix's scaling load: KV in use plus waiting prompts) or ``kv`` (KV in use only: never scales for
  a queued bulk). ``bands`` sweeps the band; the best row is the paper's "Llumnix (tuned)". The
best variant with arrival dispatch is labelled ``(paper baseline)``, the best of all (highest
attainment, then fewest GPU-seconds; the target checks' "tuned" baseline) ``(strongest baseline)``.

Metrics: the contract's keys plus mean / peak instances, scaling actions, hysteresis (actions /
scale-ups), ``instances_over_time`` ([t, interactive, mixed, batch] every 10 s) and
``batch_size_over_time`` (mean batch size of the same roles).

Other options (``--set``): interactive_requests, interactive_rate, interactive_arrivals, interactive_cv,
lengths, batch_requests, batch_at, batch_deadline_s (above), dispatch, bands, utilization, defer_variant,
op_history_variant, forecast_variant, forecast_window_s, forecast_utilization, lean_variant,
lean_over_provisioning, lean_cooldown_s (rows above), rate_dist (a rate
series' arrivals), initial_instances (2), min_instances (1), max_instances (25), eval_interval_s (5),
dispatch_interval_s (1), over_provisioning (1/3), prefill_backlog_s (1.0), batch_exec_margin_s (60), profile
(a100-llama3-8b), cold_start_s (profile's), static_batch (256), tolerance (0.10: every Chiron row against the
best threshold variant on throughput and p99 JCT, no worse than this share).

Checks: each Chiron row against every threshold variant (the bench's own target below), the GPU-seconds
target against the strongest baseline (``FEWER_GPU_RATIO``: <= 0.80x at equal or better
attainment), and the tolerance on throughput and p99 JCT.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, bench_trace, option, run_one
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import PAPER, STRONGEST, baseline_checks, label_baseline, tolerance
from tessera.core.chiron import (
    PREFILL_BACKLOG_S,
    ChironLocal,
    RunningStats,
    instance_tokens_per_s,
    spike_p99,
)
from tessera.core.planners.threshold import ThresholdSettings
from tessera.core.planners.types import ChironSettings
from tessera.core.policy import Policy
from tessera.core.profiles import load_profile
from tessera.core.request import Request, ServiceClass
from tessera.sim.autoscaling import ChironController, ThresholdController, chiron_cluster, threshold_cluster
from tessera.sim.cluster import ClusterConfig, ClusterRouter
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import (
    build_requests,
    gamma_arrivals,
    gamma_for_rate,
    poisson_arrivals,
    scale_to_rate,
    sharegpt_lengths,
)

DESCRIPTION = (
    "Chiron (local + global autoscaler) vs a utilization-threshold autoscaler, bursty interactive + batch"
)

INTERACTIVE_TTFT_S = 10.0
INTERACTIVE_ITL_S = 0.2
BATCH_ITL_S = 2.0
BS_MAX = 8192  # the local autoscaler's batch-size bound
BS_INITIAL = 256  # vLLM's default max_num_seqs
TARGET_POINTS = 0.30  # the target: attainment >= 30 points higher at similar GPU-seconds ...
SIMILAR_GPU = 1.10  # ... "similar": within 10 % (CHOICE)
TARGET_GPU_RATIO = 0.70  # ... or GPU-seconds <= 0.7x at equal (or better) attainment
# Our product target: >= 20% fewer GPU-seconds than the strongest baseline at equal attainment.
FEWER_GPU_RATIO = 0.80
ARRIVAL_KINDS = ("trace", "gamma", "poisson")
LENGTH_SOURCES = ("trace", "sharegpt")
DISPATCH_MODES = ("arrival", "pull", "pull-priority")
Parts = tuple[ClusterRouter, ChironController | ThresholdController, Callable[[], Policy]]


# ---- workload ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Workload:
    """The requests and what the autoscalers may know of them in advance (offline profiling)."""

    requests: list[Request]
    mean_output: float  # from a 500-request offline profiling sample (seeds μ_o, σ_o and Θ_B)
    std_output: float
    mean_context: float  # prompt + output, same sample
    history: np.ndarray  # interactive arrival times of the service's past (for Θ_op from spikes)


def build_workload(config: BenchConfig) -> Workload:
    """Interactive requests (trace replay, Gamma or Poisson arrivals) plus one bulk arrival of batch
    requests; token lengths from the trace or a ShareGPT fit (the paper's dataset)."""
    opts = config.options
    n_int = option(opts, "interactive_requests", 7000, int)
    rate = config.rate if config.rate is not None else option(opts, "interactive_rate", 10.0, float)
    trace = bench_trace(config, AZURE_CONV)
    rows = trace.rows
    arrival_kind = option(opts, "interactive_arrivals", "trace" if trace.series else "gamma", str)
    _require(
        not trace.series or arrival_kind == "trace",
        f"--set interactive_arrivals={arrival_kind}: a rate series as --trace gives the interactive "
        "arrivals; leave interactive_arrivals unset (or trace), or pass a trace of requests",
    )
    cv = option(opts, "interactive_cv", 4.0, float)
    lengths = option(opts, "lengths", "trace", str)
    n_batch = option(opts, "batch_requests", 30000, int)
    batch_at = option(opts, "batch_at", 60.0, float)
    deadline = option(opts, "batch_deadline_s", 600.0, float)
    _require(n_int >= 2 and n_batch >= 0, "--set interactive_requests must be >= 2 and batch_requests >= 0")
    _require(batch_at >= 0 and deadline > 0, "--set batch_at must be >= 0 and batch_deadline_s > 0")
    _require(
        arrival_kind in ARRIVAL_KINDS,
        f"--set interactive_arrivals={arrival_kind!r}: one of {', '.join(ARRIVAL_KINDS)} "
        "(trace: the trace's own timestamps rescaled to the rate; gamma: CV from interactive_cv)",
    )
    _require(lengths in LENGTH_SOURCES, f"--set lengths={lengths!r}: one of {', '.join(LENGTH_SOURCES)}")
    _require(cv > 0, "--set interactive_cv must be > 0")
    _require(
        arrival_kind != "trace" or len(rows) >= n_int,
        f"the trace has {len(rows)} rows; --set interactive_requests={n_int} needs more",
    )
    rng = np.random.default_rng(config.seed)
    interactive = ServiceClass(
        "interactive", "interactive", ttft_slo_s=INTERACTIVE_TTFT_S, itl_slo_s=INTERACTIVE_ITL_S
    )
    batch = ServiceClass("batch", "batch", deadline_s=deadline, itl_slo_s=BATCH_ITL_S)

    def draw_lengths(n: int, head: bool) -> tuple[list[int], list[int]]:
        if lengths == "sharegpt":
            inp, out = sharegpt_lengths(n, rng)
            return [int(x) for x in inp], [int(x) for x in out]
        picks = range(n) if head else rng.integers(0, len(rows), n)
        return [max(1, rows[i].input_tokens) for i in picks], [max(1, rows[i].output_tokens) for i in picks]

    if arrival_kind == "trace":
        arrivals = scale_to_rate([r.arrival for r in rows[:n_int]], rate)
        history = scale_to_rate([r.arrival for r in rows], rate)  # the whole trace is the history
    else:
        # The history is another draw of the same process (its own RNG: the workload stays the same).
        past = np.random.default_rng([config.seed, 1])
        if arrival_kind == "gamma":
            arrivals = gamma_arrivals(n_int, *gamma_for_rate(rate, cv), rng)
            history = gamma_arrivals(n_int, *gamma_for_rate(rate, cv), past)
        else:
            arrivals = poisson_arrivals(n_int, rate, rng)
            history = poisson_arrivals(n_int, rate, past)
    reqs = build_requests(arrivals, *draw_lengths(n_int, arrival_kind == "trace"), rng, prefix="i")
    for r in reqs:
        r.service_class = interactive
    if n_batch:
        reqs += build_requests(np.full(n_batch, batch_at), *draw_lengths(n_batch, False), rng, prefix="b")
        for r in reqs[n_int:]:
            r.service_class = batch
    # What offline profiling of the service's history gives: a 500-request sample of the same lengths.
    sample = reqs[:500]
    outs = np.array([r.true_output_tokens for r in sample], dtype=float)
    ctx = np.array([r.prompt_tokens for r in sample], dtype=float) + outs
    return Workload(reqs, float(outs.mean()), float(outs.std()), float(ctx.mean()), history)


# ---- run --------------------------------------------------------------------------------------------
def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run Chiron and the threshold variants on the same requests; checks against the target."""
    opts = config.options
    profile = load_profile(str(option(opts, "profile", "a100-llama3-8b", str)))
    cold = option(opts, "cold_start_s", profile.cold_start_s, float)
    profile = replace(profile, cold_start_s=cold)
    initial = option(opts, "initial_instances", 2, int)
    lo_inst = option(opts, "min_instances", 1, int)
    hi_inst = option(opts, "max_instances", 25, int)
    static_batch = option(opts, "static_batch", BS_INITIAL, int)
    dispatches = str(option(opts, "dispatch", "arrival,pull,pull-priority", str)).split(",")
    _require(
        bool(dispatches) and all(d in DISPATCH_MODES for d in dispatches),
        f"--set dispatch={opts.get('dispatch')!r}: comma-separated among {', '.join(DISPATCH_MODES)}",
    )
    _require(
        1 <= lo_inst <= initial <= hi_inst,
        "--set needs 1 <= min_instances <= initial_instances <= max_instances",
    )
    _require(static_batch >= 1, "--set static_batch must be >= 1")
    bands = _parse_bands(str(opts.get("bands", "0.4-0.8")))
    tick = option(opts, "dispatch_interval_s", 1.0, float)
    _require(tick > 0, "--set dispatch_interval_s must be > 0")
    work = build_workload(config)
    deadline = option(opts, "batch_deadline_s", 600.0, float)
    margin = option(opts, "batch_exec_margin_s", 60.0, float)
    _require(margin >= 0, "--set batch_exec_margin_s must be >= 0")
    backlog = option(opts, "prefill_backlog_s", PREFILL_BACKLOG_S, float)
    _require(
        backlog >= 0, "--set prefill_backlog_s must be >= 0 (seconds of waiting prefill an instance may hold)"
    )
    mean_prompt = float(np.mean([r.prompt_tokens for r in work.requests[:500]]))
    seed_theta = instance_tokens_per_s(
        profile, mean_prompt, work.mean_output, max(1, int(profile.kv_capacity_tokens / work.mean_context))
    )
    settings = ChironSettings(
        over_provisioning=option(opts, "over_provisioning", 1 / 3, float),
        eval_interval_s=option(opts, "eval_interval_s", 5.0, float),
        load_time_s=cold,
        min_instances=lo_inst,
        max_instances=hi_inst,
        default_instance_tokens_per_s=seed_theta,
        batch_slo_s=deadline,
    )
    chirons = {"chiron": settings}
    theta_history = None
    if option(opts, "op_history_variant", False, bool):
        # Paper §5.2: Θ_op = 1 / (p99 arrival spike of the history); kept above the band.
        theta_history = min(1.0, max(settings.band + 0.01, 1.0 / spike_p99(work.history, cold)))
        chirons[f"chiron:op={theta_history:.2f}"] = replace(settings, over_provisioning=theta_history)
    if option(opts, "defer_variant", False, bool):
        chirons["chiron:defer=true"] = replace(settings, defer=True)
    if option(opts, "forecast_variant", True, bool):
        window = option(opts, "forecast_window_s", 60.0, float)
        _require(window > 0, "--set forecast_window_s must be > 0 seconds (the arrival-rate window)")
        util = option(opts, "forecast_utilization", 0.8, float)
        _require(settings.band < util <= 1, f"--set forecast_utilization must be in ({settings.band:g}, 1]")
        chirons["chiron:forecast"] = replace(settings, forecast_window_s=window, forecast_utilization=util)
    if option(opts, "lean_variant", True, bool):
        theta = option(opts, "lean_over_provisioning", 1.0, float)
        band = settings.band
        _require(band < theta <= 1, f"--set lean_over_provisioning must be in ({band:g}, 1]")
        down = option(opts, "lean_cooldown_s", cold, float)
        _require(down >= 0, "--set lean_cooldown_s must be >= 0 seconds")
        chirons["chiron:lean"] = replace(settings, over_provisioning=theta, scale_down_cooldown_s=down)
    variants: dict[str, Callable[[], Parts]] = {
        name: partial(_chiron_parts, s, work, tick, deadline, margin, backlog) for name, s in chirons.items()
    }
    utils = str(option(opts, "utilization", "demand", str)).split(",")
    _require(
        bool(utils) and all(u in ("kv", "demand") for u in utils),
        f"--set utilization={opts.get('utilization')!r}: demand (Llumnix), kv (KV in use), or both",
    )
    for (lo, hi), dispatch, util in itertools.product(bands, dispatches, utils):
        name = f"threshold:band={lo:g}-{hi:g}" + (f":dispatch={dispatch}" if dispatch != "arrival" else "")
        name += ":util=kv" if util == "kv" else ""
        th = ThresholdSettings(interval_s=10.0, high=hi, low=lo, min_instances=lo_inst, max_instances=hi_inst)
        variants[name] = lambda th=th, d=dispatch, u=util: threshold_cluster(
            th, dispatch=d, interval_s=tick, static_batch=static_batch, demand=u == "demand"
        )
    n = len(work.requests)
    progress(0, total=n * len(variants))
    rows: list[dict[str, Any]] = []
    for name, build in variants.items():
        router, controller, factory = build()
        engine = EngineConfig(max_batch=BS_MAX if name.startswith("chiron") else static_batch)
        role = "mixed" if name.startswith("chiron") else "default"
        cluster = ClusterConfig(profiles={"default": profile}, instances=initial, engine=engine, role=role)
        _, metrics = run_one(
            work.requests, factory, cluster, router=router, controller=controller, progress=progress
        )
        rows.append({"policy": name, **metrics, **controller.timeline.metrics()})
    checks = _checks(rows, tolerance(opts))
    cfg = {
        **config.as_dict(),
        "profile": profile.name,
        "cold_start_s": cold,
        "initial_instances": initial,
        "min_instances": lo_inst,
        "max_instances": hi_inst,
        "static_batch": static_batch,
        "batch_deadline_s": deadline,
        "prefill_backlog_s": backlog,
        "interactive_slo": {"ttft_s": INTERACTIVE_TTFT_S, "itl_s": INTERACTIVE_ITL_S},
        "requests_by_class": {
            k: sum(1 for r in work.requests if r.service_class.kind == k) for k in ("interactive", "batch")
        },
        "theta_b_seed_tokens_per_s": seed_theta,
        "over_provisioning_from_history": theta_history,
    }
    return BenchReport("chiron", cfg, rows, checks)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _parse_bands(text: str) -> list[tuple[float, float]]:
    """``"0.4-0.8,0.5-0.9"`` -> [(0.4, 0.8), (0.5, 0.9)], each 0 <= lo < hi <= 1."""
    bands = []
    for part in text.split(","):
        lo_s, sep, hi_s = part.strip().partition("-")
        try:
            lo, hi = float(lo_s), float(hi_s)
        except ValueError:
            sep = ""
        if not sep or not 0 <= lo < hi <= 1:
            raise ValueError(f"--set bands={text!r}: give LO-HI pairs with 0 <= LO < HI <= 1, e.g. 0.4-0.8")
        bands.append((lo, hi))
    return bands


def _chiron_parts(
    settings: ChironSettings, work: Workload, tick: float, deadline: float, margin: float, backlog_s: float
) -> Parts:
    return chiron_cluster(
        settings,
        RunningStats.seeded(500, work.mean_output, work.std_output),  # the profiling sample as a prior
        lambda: ChironLocal(min_batch=1, max_batch=BS_MAX, initial=BS_INITIAL),
        group_s=0.01 * deadline,  # batch groups 1% of the deadline wide
        interval_s=tick,
        exec_margin_s=margin,
        mean_context=work.mean_context,
        backlog_s=backlog_s,
    )


def _checks(rows: list[dict[str, Any]], tol: float) -> list[str]:
    """The target (>= +30 points of SLO attainment at similar GPU-seconds, or <= 0.7x GPU-seconds at
    equal attainment) against every threshold variant, then against the best of them: the paper's
    "Llumnix (tuned)" is the per-workload configuration that maximizes SLO attainment, so the last line
    compares Chiron with the variant of highest attainment (ties: fewest GPU-seconds) among those run.
    Then every Chiron row against that best variant on the GPU-seconds target (``FEWER_GPU_RATIO``),
    last on throughput and p99 JCT (``tol``)."""
    chiron = next(r for r in rows if r["policy"] == "chiron")
    bases = [r for r in rows if r["policy"].startswith("threshold")]
    out = [_check_line(chiron, base, base["policy"]) for base in bases]
    best = max(bases, key=lambda r: (r["slo_attainment"], -r["gpu_seconds"]))
    # The paper's baseline is Llumnix-style dispatch on arrival; the strongest may pull a global queue.
    paper = [r for r in bases if ":dispatch=" not in r["policy"]]
    if paper:
        label_baseline(max(paper, key=lambda r: (r["slo_attainment"], -r["gpu_seconds"])), PAPER)
    label_baseline(best, STRONGEST)
    if len(bases) > 1:
        out.append(_check_line(chiron, best, f"the best threshold variant (tuned: {best['policy']})"))
    # Chiron variants (defer, Θ_op from history) against the first baseline and the best one.
    for other in (r for r in rows if r["policy"].startswith("chiron:")):
        for base in {id(b): b for b in (bases[0], best)}.values():
            out.append(_check_line(other, base, base["policy"]))
    ours = [r for r in rows if r["policy"].startswith("chiron")]
    out += [_fewer_gpu_line(r, best) for r in ours]
    return out + baseline_checks(ours, best, tol)


def _check_line(chiron: dict[str, Any], base: dict[str, Any], label: str) -> str:
    points = chiron["slo_attainment"] - base["slo_attainment"]
    ratio = chiron["gpu_seconds"] / base["gpu_seconds"]
    a = points >= TARGET_POINTS and ratio <= SIMILAR_GPU
    b = ratio <= TARGET_GPU_RATIO and points >= 0
    return (
        f"{chiron['policy']} vs {label}: SLO attainment {chiron['slo_attainment']:.1%} vs "
        f"{base['slo_attainment']:.1%} ({points * 100:+.1f} points), GPU-seconds {ratio:.2f}x "
        f"(target: >= +30 points at <= {SIMILAR_GPU:.2f}x GPU-seconds, or <= {TARGET_GPU_RATIO:.2f}x "
        f"GPU-seconds at equal or better attainment): {'PASS' if a or b else 'FAIL'}"
    )


def _fewer_gpu_line(chiron: dict[str, Any], best: dict[str, Any]) -> str:
    points = chiron["slo_attainment"] - best["slo_attainment"]
    ratio = chiron["gpu_seconds"] / best["gpu_seconds"]
    ok = ratio <= FEWER_GPU_RATIO and points >= 0
    return (
        f"{chiron['policy']} vs the strongest baseline {best['policy']}: GPU-seconds {ratio:.2f}x at "
        f"{points * 100:+.1f} points of SLO attainment (target: <= {FEWER_GPU_RATIO:.2f}x at equal or "
        f"better attainment): {'PASS' if ok else 'FAIL'}"
    )


def plot(report: BenchReport, out_dir: Path) -> list[Path]:
    """Instance count over time per row, and SLO attainment by class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    for row in report.results:
        pts = np.asarray(row["instances_over_time"], dtype=float)
        if len(pts):
            ax.step(pts[:, 0], pts[:, 1:].sum(axis=1), where="post", label=row["policy"])
    ax.set(xlabel="time (s)", ylabel="instances (GPUs)")
    ax.grid(alpha=0.3)
    first = _save(plt, fig, ax, out_dir / "instances_over_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["policy"] for r in report.results]
    classes = sorted({c for r in report.results for c in r.get("slo_attainment_by_class", {})})
    width = 0.8 / max(1, len(classes) + 1)
    for k, cls in enumerate(["all", *classes]):
        vals = [
            r["slo_attainment"] if cls == "all" else r.get("slo_attainment_by_class", {}).get(cls, 0.0)
            for r in report.results
        ]
        ax.bar(np.arange(len(names)) + k * width, vals, width, label=cls)
    ax.set_xticks(np.arange(len(names)) + width * len(classes) / 2, names, rotation=15, fontsize=8)
    ax.set_ylabel("SLO attainment")
    return [first, _save(plt, fig, ax, out_dir / "slo_attainment.png")]


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["DESCRIPTION", "plot", "run"]
