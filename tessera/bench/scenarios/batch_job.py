"""Scenario ``batch-job``: one Batch API job on the chat pool's capacity vs a batch pool of its own.

Workload: chat from the Azure 2023 conversation trace (its own timestamps and lengths, the rows that
arrive within the job's window; SLO TTFT ``chat_ttft_s`` 2 s, ITL 0.2 s) and one job of
``job_requests`` (20,000) lines submitted at time 0, with lengths drawn from the same trace. Every
line carries the job's expiry as its own deadline (``Request.deadline``, what ``x-tessera-deadline``
gives a worker). The window is one that a dedicated batch instance would just meet: the makespan of
the job alone on one instance, plus ``window_slack`` (5%).

Rows (the same mechanisms as ``tessera bench chiron``'s ``chiron:lean``: Chiron's local batch size,
its global queue and autoscaler with over-provisioning 1 and a scale-down cooldown of one load time):

- ``shared``: chat and the job on one autoscaled pool (what Tessera does: the job's lines wait in the
  global queue, by deadline, and fill the room chat leaves; batch instances are added only when the
  window would be missed otherwise);
- ``dedicated``: chat on its autoscaled pool and the job on one batch instance of its own for as long
  as the job runs (the GPU-seconds of both; chat as in ``chat-only``);
- ``chat-only``: chat alone on the autoscaled pool.

Metrics: the contract's keys (``slo_attainment_by_class`` ``chat``), ``job_completion_s`` (the last
line's end), ``job_window_s`` and ``gpu_seconds``. Checks: the job completes inside its window in
``shared``; chat SLO attainment of ``shared`` within ``CHAT_POINTS`` (2 points) of ``chat-only``;
GPU-seconds of ``shared`` <= ``GPU_RATIO`` (0.7x) ``dedicated``.

The pool starts with one interactive instance (a lean pool has no mixed spare); the calibration's lone
instance is a batch instance. ``shared`` launches batch instances just in time
(``ChironSettings.just_in_time``): with Chiron's own rule the ramp of each new instance (a whole batch
of prompts prefilled, almost no output) read as too little throughput, and the pool launched ten
batch instances for a job that one meets.

Options (``--set``): job_requests, window_slack, job_at (60: the job comes while chat runs), defer
(false; true: Chiron's batch backpressure counts the job only within a quarter window of its expiry,
``ChironSettings.defer``), just_in_time (true; false: Chiron's rule), chat_ttft_s, profile
(a100-llama3-8b), cold_start_s, initial_instances (1), max_instances (25), eval_interval_s (5).
``--trace`` replaces the chat trace (a trace of requests: its arrivals and lengths).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, bench_trace, option, run_one
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.core.chiron import ChironLocal, RunningStats, instance_tokens_per_s
from tessera.core.planners.types import ChironSettings
from tessera.core.profiles import load_profile
from tessera.core.request import Request, ServiceClass
from tessera.sim.autoscaling import chiron_cluster
from tessera.sim.cluster import ClusterConfig
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import build_requests

DESCRIPTION = "A 20,000-line batch job on the chat pool (shared) vs a batch instance of its own (dedicated)"
TRACE_NOTE = "a trace of requests: the chat arrivals and lengths"
CHAT_ITL_S = 0.2
BATCH_ITL_S = 2.0
BS_MAX = 8192
BS_INITIAL = 256
CHAT_POINTS = 0.02
GPU_RATIO = 0.70
EXEC_MARGIN_S = 60.0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _job(rows: list[Any], n: int, at: float, window: float, rng: np.random.Generator) -> list[Request]:
    """``n`` lines submitted at ``at`` with lengths drawn from ``rows``, each due ``window`` later."""
    picks = rng.integers(0, len(rows), n)
    job = build_requests(np.full(n, at), [max(1, rows[i].input_tokens) for i in picks],
                         [max(1, rows[i].output_tokens) for i in picks], rng, prefix="job")  # fmt: skip
    batch = ServiceClass("batch", "batch", deadline_s=window, itl_slo_s=BATCH_ITL_S)
    for r in job:
        r.service_class = batch
        r.deadline = at + window  # the job's expiry, carried per line
    return job


def _run(reqs: list[Request], settings: ChironSettings, profile: Any, initial: int, mean_context: float,
         stats: tuple[float, float], progress: Progress, role: str = "interactive",
         ) -> tuple[list[Request], dict[str, Any]]:  # fmt: skip
    router, controller, factory = chiron_cluster(
        settings,
        RunningStats.seeded(500, *stats),
        lambda: ChironLocal(min_batch=1, max_batch=BS_MAX, initial=BS_INITIAL),
        group_s=0.01 * settings.batch_slo_s,
        interval_s=1.0,
        exec_margin_s=EXEC_MARGIN_S,
        mean_context=mean_context,
    )
    cluster = ClusterConfig(profiles={"default": profile}, instances=initial,
                            engine=EngineConfig(max_batch=BS_MAX), role=role)  # fmt: skip
    done, metrics = run_one(reqs, factory, cluster, router=router, controller=controller, progress=progress)
    return done, {**metrics, **controller.timeline.metrics()}


def _job_end(reqs: list[Request], at: float) -> float:
    """Seconds from the job's submission at ``at`` to its last line's end (inf: a line unfinished)."""
    ends = [r.finished_at for r in reqs if r.service_class.kind == "batch"]
    return max((e if e is not None else float("inf") for e in ends), default=at) - at


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Calibrate the window on a lone batch instance, then run the three rows."""
    opts = config.options
    n_job = option(opts, "job_requests", 20000, int)
    slack = option(opts, "window_slack", 0.05, float)
    ttft = option(opts, "chat_ttft_s", 2.0, float)
    job_at = option(opts, "job_at", 60.0, float)
    profile = load_profile(str(option(opts, "profile", "a100-llama3-8b", str)))
    profile = replace(profile, cold_start_s=option(opts, "cold_start_s", profile.cold_start_s, float))
    initial = option(opts, "initial_instances", 1, int)
    hi = option(opts, "max_instances", 25, int)
    _require(
        n_job >= 1 and slack >= 0 and ttft > 0, "--set job_requests >= 1, window_slack >= 0, chat_ttft_s > 0"
    )
    _require(job_at >= 0, "--set job_at must be >= 0 seconds")
    _require(1 <= initial <= hi, "--set needs 1 <= initial_instances <= max_instances")
    trace = bench_trace(config, AZURE_CONV)
    _require(not trace.series, f"--trace: {TRACE_NOTE}, not a rate series")
    rows = trace.rows
    rng = np.random.default_rng(config.seed)
    outs = np.array([max(1, r.output_tokens) for r in rows[:500]], dtype=float)
    ctx = float(np.mean([max(1, r.input_tokens) for r in rows[:500]]) + outs.mean())
    stats = (float(outs.mean()), float(outs.std()))
    theta = instance_tokens_per_s(
        profile, ctx - outs.mean(), outs.mean(), max(1, int(profile.kv_capacity_tokens / ctx))
    )
    base = ChironSettings(over_provisioning=1.0, eval_interval_s=option(opts, "eval_interval_s", 5.0, float),
                          load_time_s=profile.cold_start_s, min_instances=1, max_instances=hi,
                          default_instance_tokens_per_s=theta, scale_down_cooldown_s=profile.cold_start_s,
                          batch_slo_s=3600.0)  # fmt: skip
    # The window a lone batch instance just meets: the job's makespan there, plus the slack.
    progress(0, total=n_job)
    lone = replace(base, min_instances=1, max_instances=1, min_interactive=0)
    lone_job = _job(rows, n_job, 0.0, 1e9, np.random.default_rng(config.seed))  # no deadline: its makespan
    calib, lone_metrics = _run(lone_job, lone, profile, 1, ctx, stats, progress, role="batch")
    window = _job_end(calib, 0.0) * (1 + slack)
    settings = replace(
        base,
        batch_slo_s=window,
        defer=option(opts, "defer", False, bool),
        just_in_time=option(opts, "just_in_time", True, bool),
    )
    chat_class = ServiceClass("chat", "interactive", ttft_slo_s=ttft, itl_slo_s=CHAT_ITL_S)
    start = rows[0].arrival
    chat_rows = [r for r in rows if r.arrival - start < job_at + window]
    chat = build_requests(np.array([r.arrival - start for r in chat_rows]),
                          [max(1, r.input_tokens) for r in chat_rows],
                          [max(1, r.output_tokens) for r in chat_rows], rng, prefix="chat")  # fmt: skip
    for r in chat:
        r.service_class = chat_class
    job = _job(rows, n_job, job_at, window, np.random.default_rng(config.seed))
    progress(0, total=n_job + len(chat) + n_job + len(chat))
    results: dict[str, dict[str, Any]] = {}
    done, results["shared"] = _run(chat + job, settings, profile, initial, ctx, stats, progress)
    results["shared"]["job_completion_s"] = _job_end(done, job_at)
    _, results["chat-only"] = _run(chat, settings, profile, initial, ctx, stats, progress)
    chat_only = results["chat-only"]
    results["dedicated"] = {
        **chat_only,
        "gpu_seconds": chat_only["gpu_seconds"] + lone_metrics["gpu_seconds"],
        "job_completion_s": _job_end(calib, 0.0),
        "requests": chat_only["requests"] + lone_metrics["requests"],
    }
    results["chat-only"]["job_completion_s"] = None
    rows_out = [{"policy": name, **results[name], "job_window_s": window}
                for name in ("shared", "dedicated", "chat-only")]  # fmt: skip
    cfg = {**config.as_dict(), "profile": profile.name, "job_requests": n_job, "window_s": window,
           "window_slack": slack, "chat_requests": len(chat), "max_instances": hi,
           "chat_slo": {"ttft_s": ttft, "itl_s": CHAT_ITL_S}}  # fmt: skip
    return BenchReport("batch-job", cfg, rows_out, _checks(results, window))


def _chat_slo(row: dict[str, Any]) -> float:
    return float(row.get("slo_attainment_by_class", {}).get("chat", 0.0))


def _checks(results: dict[str, dict[str, Any]], window: float) -> list[str]:
    shared, dedicated, chat_only = results["shared"], results["dedicated"], results["chat-only"]
    end = shared["job_completion_s"]
    points = _chat_slo(shared) - _chat_slo(chat_only)
    ratio = shared["gpu_seconds"] / dedicated["gpu_seconds"]
    return [
        f"shared: the job ends at {end:.0f} s, its window is {window:.0f} s: "
        f"{'PASS' if end <= window else 'FAIL'}",
        f"shared: chat SLO attainment {_chat_slo(shared):.1%} vs chat-only {_chat_slo(chat_only):.1%} "
        f"({points * 100:+.1f} points; target: within {CHAT_POINTS * 100:.0f}): "
        f"{'PASS' if points >= -CHAT_POINTS else 'FAIL'}",
        f"shared: GPU-seconds {ratio:.2f}x dedicated (target <= {GPU_RATIO:.2f}x): "
        f"{'PASS' if ratio <= GPU_RATIO else 'FAIL'}",
    ]


__all__ = ["DESCRIPTION", "run"]
