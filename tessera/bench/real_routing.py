"""``tessera bench routing --set engine=vllm``: the combined route against round-robin on real vLLM.

Two vLLM servers on this machine's CPU serve SmolLM2-135M-Instruct (``tessera models pull smollm2``)
with prefix caching on, ``--enforce-eager`` and the smallest KV space (1 GiB), each server's compute
threads pinned to a core of its own where there are two. A ``tessera worker`` (FCFS, tokenizing with
the model's own tokenizer) stands in front of each, and ``tessera router --route R`` in front of both.

Workload: multi-turn chat sessions built from AlpacaEval prompts and recorded answers
(``tessera.bench.chat_sessions``): ``sessions`` sessions of ``turns`` turns, each turn sending the whole
conversation so far with the session as the OpenAI ``user`` field, ``max_tokens`` tokens answered;
sessions start ``session_gap`` s apart and send a turn about every ``turn_gap`` s. vLLM on the CPU
caches blocks of 128 tokens, so a turn reuses only the full blocks of the previous turn's prompt.

Rounds: each round builds new sessions and runs both routes on them, the order alternating from round
to round, so the machine's drifting load hits both alike. Before each run both servers' prefix caches
are emptied (vLLM's ``/reset_prefix_cache``, served in its dev mode) and a fresh router starts, so each
run begins cold. Before the rounds, the workers' step profile (what ``expected-ttft`` and the SLO
filter of the combined route estimate with) is measured on the first server.

Rows ``combined:vllm`` (``slo-prefix``) and ``round-robin:vllm``: client TTFT mean and p99 (medians over
the rounds), and the prefix hit rate measured by vLLM itself: ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries`` (prompt tokens) of both servers during the runs. Checks: per round the
paired ratios combined / round-robin of TTFT mean and p99, and their medians (PASS below 1).

Options (``--set``): sessions (4), turns (4), rounds (2), reply_chars (600), max_tokens (4),
session_gap (3.0), turn_gap (20.0: think times uniform in 0.5-1.5x), ttft_slo (3.0), batch (4). Sized
for a few minutes on an idle 2-core machine (about 20 on one loaded by other work).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tessera.bench.chat_sessions import ChatTurn, chat_body, chat_sessions, load_answers
from tessera.bench.harness import StreamStat, WorkerChild, stream_one
from tessera.bench.machine import MachineWatch
from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.worker.engines.vllm_process import VLLMServer, free_port

MODEL = "smollm2"
ROUTES = {"combined": "slo-prefix", "round-robin": "round-robin"}
MAX_MODEL_LEN = 2048
HITS, QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
READY_TIMEOUT_S = 180.0  # a router process seeing both workers ready
START_TIMEOUT_S = 900.0  # a vLLM start; on a busy 2-core machine it took more than 300 s


def _cores(n: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND of each of ``n`` servers: a core each while there are enough."""
    cpus = sorted(os.sched_getaffinity(0))
    return [str(cpus[i]) for i in range(n)] if len(cpus) >= n else ["nobind"] * n


def prefix_counters(metrics_text: str) -> tuple[float, float]:
    """``(hits, queries)`` of vLLM's prefix cache, in prompt tokens, from its /metrics (summed over
    engines)."""
    totals = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    return totals[HITS], totals[QUERIES]


def _measure_profile(server: VLLMServer, model_dir: Path) -> dict[str, float]:
    """The worker's step profile (camelCase, as the worker configuration takes it) measured on
    ``server``: lone prefills of two prompt lengths, decode at two batch sizes and two contexts."""
    from tessera.bench.measure import measure
    from tessera.core.profiles import fit_profile

    vocab = min(1000, int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
    m = asyncio.run(measure(server.url, MODEL, vocab=vocab, prompt_lengths=(64, 512), batches=(1, 2),
                            decode_prompts=(32, 512), decode_tokens=16, repeats=1))  # fmt: skip
    p = fit_profile(m, "smollm2-cpu", kv_capacity_tokens=MAX_MODEL_LEN)
    floor = 1e-4  # the configuration wants positive fixed costs; a fit may give 0
    return {"decodeC0": max(floor, p.decode_c0), "decodeC1": p.decode_c1, "decodeC2": p.decode_c2,
            "prefillP0": max(floor, p.prefill_p0), "prefillP1": p.prefill_p1}  # fmt: skip


def _worker_config(
    url: str, model_dir: Path, profile: dict[str, float], slo: float, batch: int
) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "url": url, "tokenizer": str(model_dir), "maxModelLen": MAX_MODEL_LEN,
                    "defaultClass": "chat", "sleepMode": "off", "profile": profile}],
        "classes": {"chat": {"slo": {"ttftSeconds": slo}}},
        "scheduling": {"policy": "fcfs", "batch": {"min": 1, "max": batch}},
    }  # fmt: skip


class RouterChild:
    """``tessera router --backends FILE --route ROUTE`` on a free loopback port, ready once every
    backend is in its rotation; ``stop`` ends it."""

    def __init__(self, backends: Path, route: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tessera", "router", "--backends", str(backends), "--route", route,
               "--host", "127.0.0.1", "--port", str(self.port), "--poll-interval", "0.5"]  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tessera router exited:\n{log.read_text()[-3000:]}")
            try:
                status = httpx.get(f"{self.url}/router/status", timeout=2.0).json()
                if status["instances"] and all(x["healthy"] for x in status["instances"]):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tessera router did not see every worker ready in {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _replay(url: str, turns: list[ChatTurn], max_tokens: int) -> list[StreamStat]:
    """Send every turn at its time through ``url`` (streamed chat); what the client saw of each."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(turn: ChatTurn) -> StreamStat:
            await asyncio.sleep(max(0.0, start + turn.at - time.perf_counter()))
            return await stream_one(
                client, url, chat_body(MODEL, turn, max_tokens), path="/v1/chat/completions"
            )

        return list(await asyncio.gather(*(one(t) for t in turns)))


def _run_route(servers: list[VLLMServer], backends: Path, route: str, turns: list[ChatTurn], max_tokens: int,
               log: Path) -> dict[str, Any]:  # fmt: skip
    """One cold run of ``turns`` through a fresh router with ``route``."""
    for s in servers:
        resp = httpx.post(f"{s.url}/reset_prefix_cache", timeout=30.0)
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM at {s.url} did not empty its prefix cache: HTTP {resp.status_code}")
    before = [prefix_counters(httpx.get(f"{s.url}/metrics", timeout=10.0).text) for s in servers]
    router = RouterChild(backends, route, log)
    try:
        stats = asyncio.run(_replay(router.url, turns, max_tokens))
    finally:
        router.stop()
    after = [prefix_counters(httpx.get(f"{s.url}/metrics", timeout=10.0).text) for s in servers]
    ttfts = np.array([s.ttft for s in stats])
    return {
        "requests": len(stats),
        "mean_ttft_s": float(ttfts.mean()),
        "p99_ttft_s": float(np.percentile(ttfts, 99)),
        "mean_jct_s": float(np.mean([s.jct for s in stats])),
        "prefix_hit_tokens": sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
        "prefix_query_tokens": sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
    }


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Both routes on the same sessions in every round, on two real vLLM servers."""
    from tessera.models.cache import resolve_model

    opts = config.options
    sessions = option(opts, "sessions", 4, int)
    turns = option(opts, "turns", 4, int)
    rounds = option(opts, "rounds", 2, int)
    reply_chars = option(opts, "reply_chars", 600, int)
    max_tokens = option(opts, "max_tokens", 4, int)
    session_gap = option(opts, "session_gap", 3.0, float)
    turn_gap = option(opts, "turn_gap", 20.0, float)
    slo = option(opts, "ttft_slo", 3.0, float)
    batch = option(opts, "batch", 4, int)
    if min(rounds, max_tokens, batch) < 1 or slo <= 0:
        raise ValueError("--set rounds, max_tokens and batch must be >= 1 and ttft_slo > 0")
    answers = load_answers()
    plans = [chat_sessions(answers, sessions, turns, seed=config.seed + r, reply_chars=reply_chars,
                           session_gap_s=session_gap, turn_gap_s=turn_gap, prefix=f"r{r}s")
             for r in range(rounds)]  # fmt: skip
    resolved = resolve_model(MODEL)
    model_dir = resolved.path
    dtype = resolved.known.dtype if resolved.known is not None else "auto"
    progress(0, total=2 + 2 * rounds)
    per_round: dict[str, list[dict[str, Any]]] = {row: [] for row in ROUTES}
    with tempfile.TemporaryDirectory(prefix="tessera-real-routing-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        servers = [
            VLLMServer(model_dir, served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=batch,
                       dtype=dtype, extra_args=["--enforce-eager"], dev_mode=True,
                       env={"VLLM_CPU_OMP_THREADS_BIND": core}, start_timeout_s=START_TIMEOUT_S)
            for core in _cores(2)
        ]  # fmt: skip
        for s in servers:  # both start at once
            stack.callback(s.stop)
            s.launch()
        for s in servers:
            s.wait_healthy()
        watch = stack.enter_context(MachineWatch())
        progress(1)
        profile = _measure_profile(servers[0], model_dir)
        progress(1)
        workers = []
        for s in servers:
            worker = WorkerChild(_worker_config(s.url, model_dir, profile, slo, batch), tmp,
                                 ready_timeout_s=START_TIMEOUT_S)  # fmt: skip
            stack.callback(worker.stop)
            workers.append(worker)
        backends = tmp / "backends.json"
        backends.write_text(json.dumps({"backends": [
            {"name": f"vllm-{i}", "url": w.url, "role": "mixed",
             "config": _worker_config(s.url, model_dir, profile, slo, batch)}
            for i, (w, s) in enumerate(zip(workers, servers, strict=True))
        ]}))  # fmt: skip
        for r, plan in enumerate(plans):
            order = list(ROUTES) if r % 2 == 0 else list(reversed(ROUTES))
            for row in order:
                per_round[row].append(_run_route(servers, backends, ROUTES[row], plan, max_tokens,
                                                 tmp / "router.log"))  # fmt: skip
                progress(1)
        load = watch.describe_load()
    results = [_row(row, runs) for row, runs in per_round.items()]
    checks = _checks(per_round)
    checks.append(f"{load} during the runs; workers' profile measured on the first server: {profile}")
    cfg = {**config.as_dict(), "engine": "vllm", "model": MODEL, "sessions": sessions, "turns": turns,
           "rounds": rounds, "reply_chars": reply_chars, "max_tokens": max_tokens,
           "session_gap_s": session_gap, "turn_gap_s": turn_gap, "ttft_slo_s": slo, "batch": batch,
           "routes": ROUTES}  # fmt: skip
    return BenchReport("routing", cfg, results, checks)


def _row(row: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    hits = sum(r["prefix_hit_tokens"] for r in runs)
    queries = sum(r["prefix_query_tokens"] for r in runs)
    return {
        "policy": f"{row}:vllm",
        "rounds": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "mean_ttft_s": statistics.median(r["mean_ttft_s"] for r in runs),
        "p99_ttft_s": statistics.median(r["p99_ttft_s"] for r in runs),
        "mean_jct_s": statistics.median(r["mean_jct_s"] for r in runs),
        "cache_hit_rate": hits / queries if queries else 0.0,
        "prefill_tokens": int(queries - hits),
    }


def _checks(per_round: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Paired ratios combined / round-robin per round, and their medians."""
    lines = []
    for key in ("mean_ttft_s", "p99_ttft_s"):
        ratios = [c[key] / max(b[key], 1e-9)
                  for c, b in zip(per_round["combined"], per_round["round-robin"], strict=True)]  # fmt: skip
        median = statistics.median(ratios)
        each = ", ".join(f"{x:.2f}" for x in ratios)
        lines.append(f"combined / round-robin {key}: median x{median:.2f} (rounds: {each}): "
                     f"{'PASS' if median < 1 else 'FAIL'}")  # fmt: skip
    for row, runs in per_round.items():
        each = ", ".join(f"{r['prefix_hit_tokens'] / max(r['prefix_query_tokens'], 1):.1%}" for r in runs)
        lines.append(f"{row}: vLLM prefix hit rate per round {each}")
    return lines


__all__ = ["prefix_counters", "run"]
