"""Scenario ``decision-time``: how long one decision of a pod's scheduler takes, over several models.

The worker's ``InstanceScheduler`` over ``models`` idle engines (their streams never produce, so the
scheduler alone is timed), ``queued`` requests of each model waiting (random lengths, chat and batch
classes alternating, models interleaved in arrival) and a full batch of ``batch``; the policy's
``decide`` p50 and p99 over ``decisions`` calls, for each policy of ``policies`` (rows
``decide:POLICY``; target <= 1 ms p50). With ``models`` > 1 the pod is co-resident: every decision sees
each engine's view (``InstanceView.models``), as a CPU pod of several models runs.

Options (``--set``): models (3), queued (2000, per model), decisions (200), batch (32),
policies (fcfs,edf,isrtf,seallm,round-robin-sharing,qlm); part (``scheduler``, the above, or
``online``: the text predictor's share of a decision with and without online refits,
``tessera.bench.refit_time``, which lists its own options).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tessera.bench.runner import option, require_positive
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "the pod scheduler's decision time with several models' queues (target <= 1 ms p50)"
TRACE_REFUSED = "it times decisions over random queued requests; size them with --set models=, queued="
TARGET_S = 1e-3


class _IdleEngine:
    """An engine whose streams never produce: the decision benchmark times the scheduler alone."""

    max_model_len = 1 << 20
    supports_sleep = False

    def __init__(self, model: str) -> None:
        self.model = model

    async def healthy(self) -> bool:
        return True

    async def stats(self) -> None:
        return None

    async def stream(self, job: Any) -> AsyncIterator[Any]:
        await asyncio.Event().wait()
        yield None  # pragma: no cover - never reached

    async def close(self) -> None:
        return None


async def decision_times(
    policy_name: str, models: int, queued: int, decisions: int, batch: int, seed: int
) -> list[float]:
    """Seconds of each of ``decisions`` decisions of the pod's scheduler under ``policy_name``, over
    ``models`` engines with ``queued`` requests of each waiting (after a first decision filled the batch)."""
    from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec
    from tessera.core.registry import make_policy
    from tessera.core.request import Request, ServiceClass
    from tessera.worker.metrics import WorkerMetrics
    from tessera.worker.scheduler import InstanceScheduler, Job

    rng = random.Random(seed)
    names = ["bench"] if models == 1 else [f"bench-{i}" for i in range(models)]
    sched = InstanceScheduler(
        {name: _IdleEngine(name) for name in names},  # type: ignore[misc]
        make_policy(policy_name),
        profiles={name: ProfileSpec().to_profile(name, 1 << 22) for name in names},
        batch=BatchBounds(max=batch),
        autoscale=AutoscaleSpec(),
        max_queued=queued + 1,
        metrics=WorkerMetrics(),
    )
    classes = [
        ServiceClass("chat", ttft_slo_s=1.0, itl_slo_s=0.2),
        ServiceClass("batch", "batch", deadline_s=600),
    ]
    for i in range(queued * models):
        n = rng.randint(8, 512)
        prompt = [rng.randrange(3, 900) for _ in range(rng.randint(4, 64))]
        req = Request(
            f"r{i}", 0.0, len(prompt), n, model=names[i % models], service_class=classes[(i // models) % 2],
            prompt_text="x" * len(prompt),
        )  # fmt: skip
        sched.submit(Job(req, prompt, {}))
    sched.decide()  # admit the first batch
    times = []
    for _ in range(decisions):
        t0 = time.perf_counter()
        sched.decide()
        times.append(time.perf_counter() - t0)
    for job in list(sched.inflight):
        if job.task is not None:
            job.task.cancel()
    await asyncio.sleep(0)
    return times


def decision_rows(
    policies: list[str], models: int, queued: int, decisions: int, batch: int, seed: int, progress: Progress
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows ``decide:POLICY`` (p50 and p99 of ``decision_times``) and their check lines against
    ``TARGET_S``; a policy that fails to run is reported in the checks, not hidden."""
    results: list[dict[str, Any]] = []
    checks: list[str] = []
    shape = f"{queued} queued" if models == 1 else f"{models} models x {queued} queued"
    for name in policies:
        try:
            times = asyncio.run(decision_times(name, models, queued, decisions, batch, seed))
        except Exception as exc:  # a policy that fails here is reported, not hidden
            checks.append(f"decide:{name}: not measured ({type(exc).__name__}: {exc})")
            progress(1)
            continue
        p50 = float(np.median(times))
        results.append(
            {
                "policy": f"decide:{name}",
                "models": models,
                "queued": queued * models,
                "decision_p50_s": p50,
                "decision_p99_s": float(np.percentile(times, 99)),
            }
        )
        checks.append(
            f"decide:{name} p50 {p50 * 1e3:.3f} ms with {shape} (target <= {TARGET_S * 1e3:g} ms): "
            f"{'PASS' if p50 <= TARGET_S else 'FAIL'}"
        )
        progress(1)
    return results, checks


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Decision time per policy over ``models`` models' queues (or part ``online``)."""
    opts = config.options
    part = option(opts, "part", "scheduler", str)
    if part == "online":
        from tessera.bench.refit_time import online_rows

        rows, lines, part_cfg = online_rows(opts, progress)
        return BenchReport("decision-time", {**config.as_dict(), **part_cfg}, rows, lines)
    if part != "scheduler":
        raise ValueError(f"--set part={part!r}: expected scheduler or online")
    models = option(opts, "models", 3, int)
    queued = option(opts, "queued", 2000, int)
    decisions = option(opts, "decisions", 200, int)
    batch = option(opts, "batch", 32, int)
    default = "fcfs,edf,isrtf,seallm,round-robin-sharing,qlm"
    policies = [p for p in str(option(opts, "policies", default, str)).split(",") if p]
    require_positive(models=models, queued=queued, decisions=decisions, batch=batch)
    progress(0, total=len(policies))
    results, checks = decision_rows(policies, models, queued, decisions, batch, config.seed, progress)
    cfg = {**config.as_dict(), "models": models, "queued": queued, "decisions": decisions, "batch": batch}
    return BenchReport("decision-time", cfg, results, checks)
