"""Scenario ``batch-local``: a Batch API job sharing a real model with chat, in local mode.

The demo's stack (``tessera local up``: the router, one worker launching vLLM on SmolLM2-135M-Instruct
in float32, eager, `tessera models pull smollm2` builds it, and the batch component) on
``examples/demo-real.yaml``: one instance, batch size 4, the spec's policy (``auto``: QLM, chat before
the batch class). The chat load is the trace's interactive requests (``examples/traces/demo-real.jsonl``:
12 chat prompts over 42 s, arrival times divided by ``time_scale``, 1); the job is ``lines`` (40) lines
made from the trace's batch prompts (their 64-token caps, cycled), uploaded and created through the
router's ``/v1/files`` and ``/v1/batches`` at the load's start (window ``window``, 1h). ``rounds`` (3)
interleaved rounds run the chat load alone and beside the job (the job first in odd rounds; a run
with the job waits for its end): the code of ``tessera local up --batch-job``
(``tessera.local.runner.compare_batch_job``).

Rows ``alone`` and ``with-job``: per-field medians over the rounds of the chat class's TTFT p99 and
mean, its SLO attainment (TTFT <= 3 s and mean ITL <= 0.5 s, measured on the client), and for
``with-job`` the job's makespan (submission to its end) and its lines answered. Checks: the median
paired ratio of chat TTFT p99 with the job to without (each round listed), and the machine's load.

Options (``--set``): lines, rounds, time_scale, window.
"""

from __future__ import annotations

import asyncio
import io
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tessera.bench.machine import MachineWatch
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "a Batch API job beside chat on real SmolLM2 in local mode: chat TTFT p99 with and without"
TRACE_REFUSED = "it replays the demo's trace (examples/traces/demo-real.jsonl); size it with --set"
ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "demo-real.yaml"
TRACE = ROOT / "examples" / "traces" / "demo-real.jsonl"
CHAT = "chat"
START_TIMEOUT_S = 900.0  # the real model's server on a loaded 2-core machine can take minutes to start


def _chat_row(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    row = summary["by_class"][CHAT]
    return {"policy": name, "requests": row["requests"], "finished": row["finished"],
            "mean_ttft_s": row["mean_ttft_s"], "p99_ttft_s": row["p99_ttft_s"],
            "slo_attainment": summary["slo_attainment_by_class"][CHAT]}  # fmt: skip


async def _rounds(lines: int, rounds: int, time_scale: float, window: str, run_dir: Path) -> list[Any]:
    from tessera.api import load_documents
    from tessera.api.traces import load_trace
    from tessera.local.control_plane import LocalEngine, plan_local
    from tessera.local.load import WorkloadOptions, build_workload
    from tessera.local.runner import LoadSettings, LocalStack, compare_batch_job
    from tessera.models.cache import resolve_model
    from tessera.router.app import class_infos
    from tessera.worker.engines.vllm_process import free_port

    model = resolve_model("smollm2")
    engine = LocalEngine("vllm", str(model.path), dtype=model.dtype, enforce_eager=True,
                         profile=model.worker_profile())  # fmt: skip
    plan = plan_local(load_documents(SPEC), engine, max_instances_per_group=1)
    stack = LocalStack(plan, run_dir, "127.0.0.1", free_port(), autoscale=False, batch=True,
                       report=lambda _: None)  # fmt: skip
    classes = {n: c for i in plan.instances for n, c in class_infos(i.config).items()}
    models = {m.name: m.max_model_len for i in plan.instances for m in i.config.models}
    workload = build_workload(load_trace(TRACE), classes, models, WorkloadOptions(time_scale=time_scale))
    await stack.start(START_TIMEOUT_S)
    try:
        return await compare_batch_job(stack, workload, classes, LoadSettings(live=False), lines,
                                       rounds=rounds, window=window, out=io.StringIO())  # fmt: skip
    finally:
        await stack.stop()


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """The chat load alone and beside a Batch API job, interleaved rounds on the real model."""
    from tessera.batch.rules import WindowError, window_seconds

    opts = config.options
    lines = option(opts, "lines", 40, int)
    rounds = option(opts, "rounds", 3, int)
    time_scale = option(opts, "time_scale", 1.0, float)
    window = option(opts, "window", "1h", str)
    if min(lines, rounds) < 1 or not time_scale > 0:
        raise ValueError("--set lines and rounds must be >= 1, time_scale > 0")
    try:
        window_seconds(window)
    except WindowError as exc:
        raise ValueError(f"--set window: {exc}") from None
    progress(0, total=1)
    with tempfile.TemporaryDirectory(prefix="tessera-batch-local-") as tmp, MachineWatch() as watch:
        done = asyncio.run(_rounds(lines, rounds, time_scale, window, Path(tmp)))
    progress(1)
    per_round = [(_chat_row("alone", r.alone), _chat_row("with-job", r.with_job), r.job) for r in done]
    results = []
    for i, name in enumerate(("alone", "with-job")):
        rows = [rr[i] for rr in per_round]
        row = {"policy": name} | {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "policy"}
        if name == "with-job":
            row["job_makespan_s"] = statistics.median(j.makespan_s for _, _, j in per_round)
            row["job_lines_completed"] = statistics.median(j.completed for _, _, j in per_round)
            row["job_lines"] = lines
        results.append(row)
    ratios = [b["p99_ttft_s"] / a["p99_ttft_s"] for a, b, _ in per_round]
    checks = [
        f"{watch.describe_load()} during the rounds",
        f"chat TTFT p99 with the job / without: {statistics.median(ratios):.2f}x (rounds "
        + ", ".join(f"{a['p99_ttft_s']:.2f} s -> {b['p99_ttft_s']:.2f} s" for a, b, _ in per_round)
        + ")",
        "job: "
        + ", ".join(f"{j.status} {j.completed}/{j.total} in {j.makespan_s:.0f} s" for _, _, j in per_round),
    ]
    cfg = {**config.as_dict(), "lines": lines, "rounds": rounds, "time_scale": time_scale, "window": window}
    return BenchReport("batch-local", cfg, results, checks)
