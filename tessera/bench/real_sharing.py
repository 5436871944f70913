"""Scenario ``real-sharing``: two real models co-resident in one worker, SeaLLM's DB against FCFS.

Two vLLM servers run side by side on the CPU, as the two engines of one pod: SmolLM2-135M-Instruct
(float32, eager; `tessera models pull smollm2` builds it) and the offline tiny model. They share the
machine's cores: the co-resident mode of ``tessera.core.sharing``, measured, not modelled. For each
policy one `tessera worker` serves both models under one scheduler (its ``InstanceScheduler``), with
the instance batch bound ``batch`` (4): ``seallm`` (the doubling budget over both services, with each
service's measured isolated execution time as its statistics) and ``fcfs`` (one queue across both
models in arrival order, each engine admitting in that order).

Workload (seeded, the same for both policies): per model Poisson arrivals over ``duration`` (20) s of
random prompt ids (``prompt_tokens``, 32) with exact lengths (``ignore_eos``): ``long_tokens`` (48) on
SmolLM2, ``short_tokens`` (16) on the tiny model. Each service's isolated execution time ``L̂_s`` is the
median JCT of ``iso`` (3) requests sent alone to its vLLM server. Both services arrive at one rate,
``load · batch / (L̂_long + L̂_short)`` requests per second each: ``load`` 1 would keep a batch of
``batch`` busy if requests took their isolated time (they take longer batched, so the default 0.8
queues without overflowing). Equal rates, not equal work: a per-request rate from the tiny model's
tens of milliseconds would flood the worker's own per-request cost. As SeaLLM
judges a service: normalized latency ``L_N = JCT / L̂_s`` and the SLO met when ``JCT <= slo_scale · L̂_s``
(``slo_scale`` 5).

``rounds`` (3) rounds run both policies in turn (fcfs first in odd rounds, seallm first in even
ones), so the drifting load of the 2-core machine hits both alike. Rows ``POLICY`` (both services) and
``POLICY:MODEL`` give per-field medians over the rounds; the checks give the median of the per-round
paired ratios fcfs / seallm of the mean normalized latency (overall and per service) and SeaLLM's
SLO attainment against FCFS's, beside the simulator's ratio for the same requests on a co-resident
instance (``tessera.bench.sharing_sim``: each server's step profile fitted alone, as ``tessera
profile`` measures it, then both engines side by side at the shipped co-resident cost), and whether
both point the same way.

Options (``--set``): duration, prompt_tokens, long_tokens, short_tokens, batch, iso, load (also
``--load``), slo_scale, rounds.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.machine import MachineWatch
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "two real models co-resident in one worker (SmolLM2 + tiny): seallm vs fcfs, vs the simulator"
TRACE_REFUSED = "it sends random-token streams of known lengths to two real models; size them with --set"
POLICIES = ("fcfs", "seallm")
LONG, SHORT = "smollm2", "tiny"
START_TIMEOUT_S = 900.0  # a real model's server on a loaded 2-core machine can take minutes to start


def _plan(
    rng: random.Random,
    exec_s: dict[str, float],
    duration: float,
    prompt: int,
    lengths: dict[str, int],
    load: float,
    batch: int,
) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, model, prompt ids, output tokens) of both services' Poisson arrivals over
    ``duration`` seconds, merged in arrival order."""
    out = []
    rate = load * batch / (exec_s[LONG] + exec_s[SHORT])
    for model in (LONG, SHORT):
        t = rng.expovariate(rate)
        while t < duration:
            out.append((t, model, [rng.randrange(3, 900) for _ in range(prompt)], lengths[model]))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda p: p[0])


async def _replay(url: str, plan: list[tuple[float, str, list[int], int]]) -> list[tuple[str, Any]]:
    """Send the plan's requests at their times to ``url``, streamed; (model, what the client saw)."""
    import time

    from tessera.bench.harness import stream_one
    from tessera.local.load import load_client

    async with load_client() as client:
        start = time.perf_counter()

        async def one(at: float, model: str, prompt: list[int], n: int) -> tuple[str, Any]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True}
            return model, await stream_one(client, url, body)

        return list(await asyncio.gather(*(one(*p) for p in plan)))


def _isolated(url: str, model: str, prompt: int, tokens: int, iso: int, rng: random.Random) -> float:
    """Median JCT of ``iso`` requests sent one at a time."""
    jcts = []
    for _ in range(iso):
        plan = [(0.0, model, [rng.randrange(3, 900) for _ in range(prompt)], tokens)]
        ((_, stat),) = asyncio.run(_replay(url, plan))
        jcts.append(stat.jct)
    return statistics.median(jcts)


def _rows(
    policy: str, seen: list[tuple[str, Any]], exec_s: dict[str, float], slo_scale: float
) -> dict[str, dict[str, Any]]:
    """The row of both services and of each, from what the client saw."""

    def row(name: str, stats: list[Any], models: list[str]) -> dict[str, Any]:
        norm = [s.jct / exec_s[m] for m, s in zip(models, stats, strict=True)]
        met = [s.jct <= slo_scale * exec_s[m] for m, s in zip(models, stats, strict=True)]
        return {
            "policy": name,
            "requests": len(stats),
            "normalized_latency_mean": float(np.mean(norm)),
            "slo_attainment": float(np.mean(met)),
            "mean_jct_s": float(np.mean([s.jct for s in stats])),
            "p99_jct_s": float(np.percentile([s.jct for s in stats], 99)),
            "mean_ttft_s": float(np.mean([s.ttft for s in stats])),
        }

    out = {policy: row(policy, [s for _, s in seen], [m for m, _ in seen])}
    for model in (LONG, SHORT):
        mine = [s for m, s in seen if m == model]
        out[f"{policy}:{model}"] = row(f"{policy}:{model}", mine, [model] * len(mine))
    return out


def _fit(server: Any, model_dir: Path, batch: int) -> Any:
    """The server's step profile, measured alone (``tessera profile``'s measurement and fit)."""
    import json

    from tessera.bench.measure import measure_and_fit
    from tessera.bench.scenarios.fidelity import _kv_bytes_per_token

    vocab = min(1000, int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
    kv_tokens = (1 << 30) // _kv_bytes_per_token(model_dir)
    profile, _ = measure_and_fit(server.url, server.model_name, f"{server.model_name}-cpu", kv_tokens, 16,
                                 vocab, batch, server.max_model_len, repeats=2)  # fmt: skip
    return profile


def _worker_config(urls: dict[str, str], policy: str, batch: int, exec_s: dict[str, float],
                   slo_scale: float) -> dict[str, Any]:  # fmt: skip
    """One worker over both servers; DB's statistics are the measured isolated times."""
    settings: dict[str, Any] = {}
    if policy == "seallm":
        settings = {
            "services": {
                m: {"meanExecS": exec_s[m], "starvationS": 0.5 * slo_scale * exec_s[m]} for m in urls
            }
        }
    return {
        "models": [{"name": m, "url": u, "maxModelLen": 1024} for m, u in urls.items()],
        "scheduling": {"policy": policy, "batch": {"max": batch}, "settings": settings},
    }


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Both policies over two real co-resident models, interleaved rounds, beside the simulator."""
    from tessera.bench.harness import WorkerChild
    from tessera.bench.sharing_sim import simulated_ratios
    from tessera.models.cache import resolve_model
    from tessera.models.tiny import build_tiny_model
    from tessera.worker.engines.vllm_process import VLLMServer

    opts = config.options
    duration = option(opts, "duration", 20.0, float)
    prompt = option(opts, "prompt_tokens", 32, int)
    lengths = {LONG: option(opts, "long_tokens", 48, int), SHORT: option(opts, "short_tokens", 16, int)}
    batch = option(opts, "batch", 4, int)
    iso = option(opts, "iso", 3, int)
    load = config.load if config.load is not None else option(opts, "load", 0.8, float)
    slo_scale = option(opts, "slo_scale", 5.0, float)
    rounds = option(opts, "rounds", 3, int)
    if min(prompt, *lengths.values(), batch, iso, rounds) < 1:
        raise ValueError("--set prompt_tokens, long_tokens, short_tokens, batch, iso, rounds: must be >= 1")
    if not (load > 0 and slo_scale > 0 and duration > 0):
        raise ValueError("--set load, slo_scale and duration must be > 0")
    smollm2 = resolve_model(LONG).path
    rng = random.Random(config.seed)
    progress(0, total=2 + 2 * rounds)
    per_round: list[dict[str, dict[str, Any]]] = []
    plans = []
    with tempfile.TemporaryDirectory(prefix="tessera-sharing-") as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        servers = {
            LONG: VLLMServer(smollm2, served_model_name=LONG, max_model_len=1024, max_num_seqs=batch,
                             extra_args=["--enforce-eager"], start_timeout_s=START_TIMEOUT_S),
            SHORT: VLLMServer(tiny, served_model_name=SHORT, max_model_len=1024, max_num_seqs=batch,
                              start_timeout_s=START_TIMEOUT_S),
        }  # fmt: skip
        with servers[LONG], servers[SHORT], MachineWatch() as watch:
            urls = {m: s.url for m, s in servers.items()}
            exec_s = {m: _isolated(urls[m], m, prompt, lengths[m], iso, rng) for m in urls}
            dirs = {LONG: Path(smollm2), SHORT: Path(tiny)}
            profiles = {m: _fit(servers[m], dirs[m], batch) for m in servers}
            progress(1)
            workers = {
                p: WorkerChild(_worker_config(urls, p, batch, exec_s, slo_scale), Path(tmp)) for p in POLICIES
            }
            progress(1)
            try:
                for r in range(rounds):
                    plan = _plan(rng, exec_s, duration, prompt, lengths, load, batch)
                    plans.append(plan)
                    rows: dict[str, dict[str, Any]] = {}
                    for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                        rows |= _rows(
                            policy, asyncio.run(_replay(workers[policy].url, plan)), exec_s, slo_scale
                        )
                        progress(1)
                    per_round.append(rows)
            finally:
                for w in workers.values():
                    w.stop()
    names = list(per_round[0])
    results = []
    for name in names:
        keys = [k for k in per_round[0][name] if k != "policy"]
        results.append(
            {"policy": name} | {k: statistics.median(rr[name][k] for rr in per_round) for k in keys}
        )
    sim = simulated_ratios(profiles, plans, batch, slo_scale)
    checks = [f"{watch.describe_load()} during the rounds; isolated execution "
              + ", ".join(f"{m} {exec_s[m]:.2f} s" for m in exec_s)]  # fmt: skip
    for suffix in ("", f":{LONG}", f":{SHORT}"):
        ratios = [
            rr[f"fcfs{suffix}"]["normalized_latency_mean"] / rr[f"seallm{suffix}"]["normalized_latency_mean"]
            for rr in per_round
        ]
        real = statistics.median(ratios)
        simulated = sim[suffix.lstrip(":") or "all"]
        same = "yes" if (real > 1) == (simulated > 1) else "NO"
        checks.append(
            f"mean normalized latency fcfs/seallm{suffix or ' (both services)'}: {real:.2f}x real "
            f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}), {simulated:.2f}x simulated; "
            f"same direction: {same}"
        )
    slo = {p: statistics.median(rr[p]["slo_attainment"] for rr in per_round) for p in POLICIES}
    checks.append(f"SLO attainment (JCT <= {slo_scale:g} x isolated): seallm {slo['seallm']:.3f}, "
                  f"fcfs {slo['fcfs']:.3f}")  # fmt: skip
    cfg = {
        **config.as_dict(), "duration": duration, "prompt_tokens": prompt, "long_tokens": lengths[LONG],
        "short_tokens": lengths[SHORT], "batch": batch, "load": load, "slo_scale": slo_scale,
        "rounds": rounds, "isolated_exec_s": exec_s,
    }  # fmt: skip
    return BenchReport("real-sharing", cfg, results, checks)
