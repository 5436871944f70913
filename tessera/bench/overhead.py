"""Scenario ``worker-overhead``: the worker in front of vLLM against vLLM directly (what the worker adds).

One real vLLM server on the offline tiny model; a `tessera worker` process (FCFS, batch bound
above the load) in front of it. The same burst of ``streams`` concurrent streaming requests
(``prompt_tokens`` random prompt ids, ``max_tokens`` output, ``ignore_eos``) goes to vLLM directly
(row ``vllm``) and through the worker (row ``worker``), alternating ``rounds`` times so that noise
from other load on the machine hits both alike; per row the medians over rounds are reported, and
the targets are checked on the median of the per-round paired ratios and differences, each round
listed with the machine's stalls during it (``tessera.bench.machine``).
Targets: worker throughput / vLLM throughput >= 0.95; added TTFT p50 <= 5 ms.

Then the scheduler's decision time (``tessera.bench.decision_time``, one model): the pod's
``InstanceScheduler.decide`` with ``queued`` (10,000) requests waiting and a full batch, p50 over
``decisions`` calls, for each policy that can run here (rows ``decide:POLICY``; target <= 1 ms p50).

Options (``--set``): streams (32), prompt_tokens (32), max_tokens (128), rounds (5), queued (10000),
decisions (200), policies (fcfs,isrtf,qoe,qlm), max_num_seqs (64).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.decision_time import decision_rows
from tessera.bench.machine import MachineWatch, Stalls
from tessera.bench.runner import option, require_positive
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "worker in front of real vLLM vs vLLM directly (tiny model, 32 streams) + decision time"

TRACE_REFUSED = (
    "it sends bursts of random-token streams to a real vLLM server and to its worker; size them with "
    "--set streams=, prompt_tokens=, max_tokens="
)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_PHASES = {
    "tessera_ttft_seconds": "worker_mean_ttft_s",  # arrival at the scheduler -> first token from vLLM
    "tessera_queue_wait_seconds": "worker_mean_queue_wait_s",  # arrival -> submitted to vLLM
    "tessera_engine_ttft_seconds": "worker_mean_engine_ttft_s",  # submitted -> first token from vLLM
}


def _phase_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the worker's latency histograms, all labels together, from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: (0.0, 0.0) for name in _PHASES}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            base, _, kind = sample.name.rpartition("_")
            if base in out and kind in ("sum", "count"):
                total, count = out[base]
                out[base] = (total + sample.value, count) if kind == "sum" else (total, count + sample.value)
    return out


def _burst(stats: list[Any]) -> dict[str, float]:
    """Throughput and TTFT/JCT figures of one burst."""
    ttfts = [s.ttft for s in stats]
    span = max(s.done for s in stats) - min(s.sent for s in stats)
    return {
        "output_tokens_per_s": sum(s.tokens for s in stats) / span,
        "p50_ttft_s": float(np.median(ttfts)),
        "mean_ttft_s": float(np.mean(ttfts)),
        "mean_jct_s": float(np.mean([s.jct for s in stats])),
    }


def _burst_row(name: str, requests: int, bursts: list[dict[str, float]]) -> dict[str, Any]:
    """Per-field medians over the rounds' bursts."""
    row: dict[str, Any] = {"policy": name, "requests": requests}
    return row | {key: statistics.median(b[key] for b in bursts) for key in bursts[0]}


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """vLLM vs worker on the same bursts, then decision time per policy."""
    from tessera.bench.harness import WorkerChild, replay
    from tessera.models.tiny import build_tiny_model
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    streams = option(opts, "streams", 32, int)
    prompt_tokens = option(opts, "prompt_tokens", 32, int)
    max_tokens = option(opts, "max_tokens", 128, int)
    rounds = option(opts, "rounds", 5, int)
    queued = option(opts, "queued", 10000, int)
    decisions = option(opts, "decisions", 200, int)
    seqs = option(opts, "max_num_seqs", 64, int)
    policies = [p for p in str(option(opts, "policies", "fcfs,isrtf,qoe,qlm", str)).split(",") if p]
    require_positive(streams=streams, max_tokens=max_tokens, rounds=rounds, queued=queued)
    rng = random.Random(config.seed)
    progress(0, total=2 * rounds + len(policies) + 1)
    direct: list[list[Any]] = []
    proxied: list[list[Any]] = []
    worker_cpu: list[float] = []
    stalls: list[tuple[Stalls, Stalls]] = []  # per round: during the direct burst, the worker's
    with tempfile.TemporaryDirectory(prefix="tessera-overhead-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        server = VLLMServer(model_dir, served_model_name="tiny", max_model_len=1024, max_num_seqs=seqs)
        with server, MachineWatch() as watch:
            worker_config = {
                "models": [{"name": "tiny", "url": server.url, "maxModelLen": 1024}],
                "scheduling": {"policy": "fcfs", "batch": {"max": seqs}},
            }
            worker = WorkerChild(worker_config, Path(tmp))
            progress(1)
            try:
                warm = [(0.0, [0, 5, 6], 8, "")] * 4
                asyncio.run(replay(server.url, "tiny", warm))
                asyncio.run(replay(worker.url, "tiny", warm))
                phases0 = _phase_sums(worker.url)
                for _ in range(rounds):
                    plan = [
                        (0.0, [rng.randrange(3, 900) for _ in range(prompt_tokens)], max_tokens, "")
                        for _ in range(streams)
                    ]
                    mark = watch.span()
                    direct.append(asyncio.run(replay(server.url, "tiny", plan)))
                    direct_stalls = watch.stalls(mark)
                    progress(1)
                    cpu0, mark = _cpu_seconds(worker.proc.pid), watch.span()
                    proxied.append(asyncio.run(replay(worker.url, "tiny", plan)))
                    worker_cpu.append(_cpu_seconds(worker.proc.pid) - cpu0)
                    stalls.append((direct_stalls, watch.stalls(mark)))
                    progress(1)
                phases1 = _phase_sums(worker.url)
            finally:
                worker.stop()
    pairs = [(_burst(d), _burst(w)) for d, w in zip(direct, proxied, strict=True)]
    vllm_row = _burst_row("vllm", sum(map(len, direct)), [d for d, _ in pairs])
    worker_row = _burst_row("worker", sum(map(len, proxied)), [w for _, w in pairs])
    # Paired per round (the same minutes of the machine), then the median over rounds.
    ratios = [w["output_tokens_per_s"] / d["output_tokens_per_s"] for d, w in pairs]
    added = [(w["p50_ttft_s"] - d["p50_ttft_s"]) * 1e3 for d, w in pairs]
    ratio, added_ms = statistics.median(ratios), statistics.median(added)
    per_round = "; ".join(
        f"{r:.3f} / {a:+.1f} ms (stalls direct: {d.describe()}; via the worker: {w.describe()})"
        for r, a, (d, w) in zip(ratios, added, stalls, strict=True)
    )
    # Load-independent: the worker's own CPU time per request (all of its work for one request).
    worker_row["worker_cpu_s_per_request"] = statistics.median(worker_cpu) / streams
    # Where the worker's TTFT goes (means over the measured bursts; the client's TTFT adds HTTP in/out).
    for metric, key in _PHASES.items():
        (s0, c0), (s1, c1) = phases0[metric], phases1[metric]
        worker_row[key] = (s1 - s0) / max(c1 - c0, 1.0)
    results = [vllm_row, worker_row]
    checks = [
        f"{watch.describe_load()} during the bursts; worker CPU "
        f"{worker_row['worker_cpu_s_per_request'] * 1e3:.2f} ms per request ({max_tokens} tokens)",
        f"worker TTFT split (means): queue {worker_row['worker_mean_queue_wait_s'] * 1e3:.1f} ms + vLLM "
        f"{worker_row['worker_mean_engine_ttft_s'] * 1e3:.1f} ms = "
        f"{worker_row['worker_mean_ttft_s'] * 1e3:.1f} ms in the worker; client-side mean TTFT "
        f"{worker_row['mean_ttft_s'] * 1e3:.1f} ms via the worker, "
        f"{vllm_row['mean_ttft_s'] * 1e3:.1f} ms direct",
        f"per round, throughput worker/vllm / added TTFT p50: {per_round}",
        f"throughput worker/vllm {ratio:.3f}, median of {rounds} paired rounds (target >= 0.95): "
        f"{'PASS' if ratio >= 0.95 else 'FAIL'}",
        f"added TTFT p50 {added_ms:.2f} ms, median of {rounds} paired rounds (target <= 5 ms): "
        f"{'PASS' if added_ms <= 5 else 'FAIL'}",
    ]
    rows, decided = decision_rows(policies, 1, queued, decisions, streams, config.seed, progress)
    results += rows
    checks += decided
    cfg = {
        **config.as_dict(),
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "queued": queued,
    }
    return BenchReport("worker-overhead", cfg, results, checks)
