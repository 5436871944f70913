"""Scenario ``real-policy``: scheduling policies through the worker on real vLLM (issue 7).

One vLLM server on the offline tiny model; for each policy a `tessera worker` with that policy and
a small batch bound (``batch``, default 4) so that requests queue. Two workloads, the same for
every policy (seeded):

- ``mixed``: ``requests`` (60) with mixed output lengths (80% short 8-32 tokens, 20% long
  200-400 tokens), Poisson arrivals at ``rate`` req/s (default 6, above the capacity at this batch
  bound); rows ``POLICY:mixed`` with mean / p99 JCT. Target: ISRTF mean JCT below FCFS.
- ``burst``: ``burst`` (40) requests at once, 64-160 tokens, interactive class with reading
  speed 20 tokens/s and T* 1 s; rows ``POLICY:burst`` with average Andes QoE computed from the
  token arrival times the client saw. Target: QoE policy above FCFS.

Policies not available in this build are reported as such (a check line), not silently skipped.
Options (``--set``): requests, rate, batch, burst, policies (fcfs,isrtf,qoe).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.sim.runner import option
from tessera.sim.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "policies through the worker on real vLLM (tiny model): mixed-length JCT and burst QoE"
READING_TPS = 20.0
TTFT_TARGET_S = 1.0


def _plans(config: BenchConfig, requests: int, rate: float, burst: int) -> dict[str, list[Any]]:
    rng = random.Random(config.seed)
    t = 0.0
    mixed = []
    for _ in range(requests):
        t += rng.expovariate(rate)
        n = rng.randint(200, 400) if rng.random() < 0.2 else rng.randint(8, 32)
        mixed.append((t, [rng.randrange(3, 900) for _ in range(rng.randint(8, 48))], n, "batch"))
    bursty = [
        (0.0, [rng.randrange(3, 900) for _ in range(16)], rng.randint(64, 160), "chat") for _ in range(burst)
    ]
    return {"mixed": mixed, "burst": bursty}


def _qoe(stat: Any) -> float:
    from tessera.worker.core.qoe import QoEParams, qoe_from_delivery

    params = QoEParams(stat.sent, TTFT_TARGET_S, READING_TPS)
    return float(qoe_from_delivery(np.array(stat.times), params))


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every policy on the same two workloads through the worker."""
    from tessera.worker.bench._harness import WorkerChild, replay
    from tessera.worker.core.registry import policy_class
    from tessera.worker.engines.tiny_model import build_tiny_model
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    requests = option(opts, "requests", 60, int)
    rate = config.rate if config.rate is not None else option(opts, "rate", 6.0, float)
    batch = option(opts, "batch", 4, int)
    burst = option(opts, "burst", 40, int)
    names = [p for p in str(option(opts, "policies", "fcfs,isrtf,qoe", str)).split(",") if p]
    if requests < 1 or burst < 1 or batch < 1 or rate <= 0:
        raise ValueError("--set requests, burst and batch must be >= 1 and the rate > 0")
    checks: list[str] = []
    usable = []
    for name in names:
        try:
            policy_class(name)
            usable.append(name)
        except ValueError as exc:
            checks.append(f"{name}: not measured ({exc})")
    plans = _plans(config, requests, rate, burst)
    results: list[dict[str, Any]] = []
    progress(0, total=1 + 2 * len(usable))
    with tempfile.TemporaryDirectory(prefix="tessera-real-policy-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        with VLLMServer(model_dir, served_model_name="tiny", max_model_len=1024, max_num_seqs=64) as server:
            progress(1)
            for name in usable:
                worker_config = {
                    "models": [
                        {"name": "tiny", "url": server.url, "maxModelLen": 1024, "defaultClass": "chat"}
                    ],
                    "classes": {
                        "chat": {
                            "slo": {"ttftSeconds": TTFT_TARGET_S},
                            "qoe": {
                                "readingSpeedTokensPerSecond": READING_TPS,
                                "ttftTargetSeconds": TTFT_TARGET_S,
                            },
                        },
                        "batch": {"kind": "batch", "slo": {"deadlineSeconds": 600}},
                    },
                    "scheduling": {"policy": name, "batch": {"min": 1, "max": batch}},
                }
                worker = WorkerChild(worker_config, Path(tmp))
                try:
                    for workload, plan in plans.items():
                        stats = asyncio.run(replay(worker.url, "tiny", plan))
                        jcts = np.array([s.jct for s in stats])
                        qoes = np.array([_qoe(s) for s in stats])
                        results.append(
                            {
                                "policy": f"{name}:{workload}",
                                "requests": len(stats),
                                "mean_jct_s": float(jcts.mean()),
                                "p99_jct_s": float(np.percentile(jcts, 99)),
                                "mean_ttft_s": float(np.mean([s.ttft for s in stats])),
                                "avg_qoe": float(qoes.mean()),
                                "qoe_ge_095_share": float(np.mean(qoes >= 0.95)),
                            }
                        )
                        progress(1)
                finally:
                    worker.stop()
    rows = {r["policy"]: r for r in results}
    base_mixed, base_burst = rows.get("fcfs:mixed"), rows.get("fcfs:burst")
    for name in usable:
        if name == "fcfs" or base_mixed is None or base_burst is None:
            continue
        jct_ratio = rows[f"{name}:mixed"]["mean_jct_s"] / base_mixed["mean_jct_s"]
        qoe_ratio = rows[f"{name}:burst"]["avg_qoe"] / max(base_burst["avg_qoe"], 1e-9)
        line = f"{name}: mean JCT {jct_ratio:.3f}x fcfs (mixed), avg QoE {qoe_ratio:.3f}x fcfs (burst)"
        if name == "isrtf":
            line += f"; target JCT < fcfs: {'PASS' if jct_ratio < 1 else 'FAIL'}"
        if name == "qoe":
            line += f"; target QoE > fcfs: {'PASS' if qoe_ratio > 1 else 'FAIL'}"
        checks.append(line)
    cfg = {**config.as_dict(), "requests": requests, "rate": rate, "batch": batch, "burst": burst}
    return BenchReport("real-policy", cfg, results, checks)
