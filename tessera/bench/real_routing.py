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
``vllm:prefix_cache_queries`` (prompt tokens) of both servers during the runs; the busiest server's share
of the prompt tokens (median over the rounds), and the hit rate the router believed it got (its
``/router/status`` at the end of each run: the cached tokens it counted where it sent each prompt).
Checks: per round the paired ratios combined / round-robin of TTFT mean and p99, and their medians (PASS
below 1).

``--set compare=precise`` compares instead precise prefix affinity (``precise-prefix``: the router
subscribes to each server's KV events and knows which blocks each engine holds) with approximate
affinity (``prefix``: the router remembers where it sent each prompt's blocks, with least recently used
eviction at the instance's configured KV capacity), round-robin as reference, on caches small enough
that vLLM evicts during the run: each server gets ``kv_blocks`` KV blocks (``--num-gpu-blocks-override``,
17 by default, the least vLLM accepts for a 2048-token context: it keeps one block aside, so 16 blocks
or 2048 tokens hold prompts) and its worker's ``kvCapacityTokens`` says so (the approximate index's
capacity). Its defaults are 12 sessions and 3 rounds: the sessions' last turns hold 44-50 full
128-token blocks (seeds 0-2), 22-25 a server when split evenly, against 16 a server, all sessions live at
once (they start within 33 s and last about 70). Checks: the paired ratios precise-prefix / prefix,
precise-prefix / round-robin and prefix / round-robin; and the hit rate a cache that never evicts would
give with each session on one server (every turn reusing the full blocks of the previous turn's
prompt), the ceiling evictions keep the rows under.

Options (``--set``): compare (combined | precise), sessions (4; precise 12), turns (4), rounds (2;
precise 3), reply_chars (600), max_tokens (4), session_gap (3.0), turn_gap (20.0: think times uniform in
0.5-1.5x), ttft_slo (3.0), batch (4), kv_blocks (unset: vLLM's 1 GiB; precise 17). Sized for a few
minutes on an idle 2-core machine (about 20 on one loaded by other work).
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
from dataclasses import dataclass
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
from tessera.core.routing import ROUTES as ROUTE_SPECS
from tessera.core.routing import uses_engine_blocks
from tessera.local.load import load_client
from tessera.worker.engines.vllm_process import VLLMServer, free_port

MODEL = "smollm2"
MAX_MODEL_LEN = 2048
CPU_BLOCK_TOKENS = 128  # vLLM's KV block size on CPUs
HITS, QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
READY_TIMEOUT_S = 180.0  # a router process seeing both workers ready
START_TIMEOUT_S = 900.0  # a vLLM start; on a busy 2-core machine it took more than 300 s


@dataclass(frozen=True, slots=True)
class Comparison:
    """The rows one ``compare`` runs (row -> the router's route), the paired ratios it checks
    (numerator row, denominator row) and its own defaults."""

    rows: dict[str, str]
    pairs: tuple[tuple[str, str], ...]
    sessions: int
    rounds: int
    kv_blocks: int | None  # None: vLLM's KV space (1 GiB), which these sessions never fill


COMPARISONS = {
    "combined": Comparison({"combined": "slo-prefix", "round-robin": "round-robin"},
                           (("combined", "round-robin"),), sessions=4, rounds=2, kv_blocks=None),
    "precise": Comparison({"precise-prefix": "precise-prefix", "prefix": "prefix",
                           "round-robin": "round-robin"},
                          (("precise-prefix", "prefix"), ("precise-prefix", "round-robin"),
                           ("prefix", "round-robin")), sessions=12, rounds=3, kv_blocks=17),
}  # fmt: skip
# vLLM refuses a cache that cannot hold one context, and one block of its pool is never used (its null
# block): with 16 blocks it refused to start, estimating the longest context at 1920 tokens
MIN_KV_BLOCKS = MAX_MODEL_LEN // CPU_BLOCK_TOKENS + 1


@dataclass(frozen=True, slots=True)
class RealRoutingOptions:
    """The ``--set`` options of the real part, checked."""

    compare: str
    sessions: int
    turns: int
    rounds: int
    reply_chars: int
    max_tokens: int
    session_gap: float
    turn_gap: float
    slo: float
    batch: int
    kv_blocks: int | None

    @property
    def comparison(self) -> Comparison:
        return COMPARISONS[self.compare]


def parse_options(opts: dict[str, Any]) -> RealRoutingOptions:
    """The real part's options with their defaults (some depend on ``compare``); ValueError naming the
    bad one."""
    compare = str(opts.get("compare", "combined"))
    if compare not in COMPARISONS:
        raise ValueError(f"--set compare= must be one of {', '.join(COMPARISONS)}, got {compare!r}")
    comparison = COMPARISONS[compare]
    kv_blocks = option(opts, "kv_blocks", comparison.kv_blocks, int)
    parsed = RealRoutingOptions(
        compare=compare,
        sessions=option(opts, "sessions", comparison.sessions, int),
        turns=option(opts, "turns", 4, int),
        rounds=option(opts, "rounds", comparison.rounds, int),
        reply_chars=option(opts, "reply_chars", 600, int),
        max_tokens=option(opts, "max_tokens", 4, int),
        session_gap=option(opts, "session_gap", 3.0, float),
        turn_gap=option(opts, "turn_gap", 20.0, float),
        slo=option(opts, "ttft_slo", 3.0, float),
        batch=option(opts, "batch", 4, int),
        kv_blocks=kv_blocks,
    )
    if min(parsed.rounds, parsed.max_tokens, parsed.batch) < 1 or parsed.slo <= 0:
        raise ValueError("--set rounds, max_tokens and batch must be >= 1 and ttft_slo > 0")
    if kv_blocks is not None and kv_blocks < MIN_KV_BLOCKS:
        raise ValueError(f"--set kv_blocks must be >= {MIN_KV_BLOCKS} (vLLM needs room for one "
                         f"{MAX_MODEL_LEN}-token context in {CPU_BLOCK_TOKENS}-token blocks plus one it "
                         f"keeps aside), "
                         f"got {kv_blocks}")  # fmt: skip
    return parsed


def reuse_ceiling(prompt_lengths: dict[str, list[int]]) -> float:
    """The prefix hit rate (prompt tokens) with a cache that never evicts and each session on one
    server: every turn reuses the full blocks of the previous turn's prompt, which its own starts with.
    ``prompt_lengths``: each session's prompt tokens, turn by turn."""
    total = sum(sum(turns) for turns in prompt_lengths.values())
    reused = sum(
        prev // CPU_BLOCK_TOKENS * CPU_BLOCK_TOKENS
        for turns in prompt_lengths.values()
        for prev in turns[:-1]
    )
    return reused / total if total else 0.0


def _prompt_lengths(model_dir: Path, turns: list[ChatTurn], max_tokens: int) -> dict[str, list[int]]:
    """Each session's prompt tokens, turn by turn, as vLLM renders its chats (the model's template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lengths: dict[str, list[int]] = {}
    for turn in sorted(turns, key=lambda t: (t.session, t.turn)):
        text = tokenizer.apply_chat_template(chat_body(MODEL, turn, max_tokens)["messages"], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        lengths.setdefault(turn.session, []).append(len(ids))
    return lengths


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


def worker_config(
    url: str, model_dir: Path, profile: dict[str, float], slo: float, batch: int, kv_blocks: int | None
) -> dict[str, Any]:
    # a cache of kv_blocks: the worker and the router's approximate index (its capacity) know the tokens
    # it holds (one block is vLLM's null block)
    capacity = {} if kv_blocks is None else {"kvCapacityTokens": (kv_blocks - 1) * CPU_BLOCK_TOKENS}
    return {
        "models": [{"name": MODEL, "url": url, "tokenizer": str(model_dir), "maxModelLen": MAX_MODEL_LEN,
                    "defaultClass": "chat", "sleepMode": "off", "profile": profile, **capacity}],
        "classes": {"chat": {"slo": {"ttftSeconds": slo}}},
        "scheduling": {"policy": "fcfs", "batch": {"min": 1, "max": batch}},
    }  # fmt: skip


def backends_document(
    urls: list[str], configs: list[dict[str, Any]], feeds: list[str | None]
) -> dict[str, Any]:
    """The router's backends file: one mixed instance per worker (its url and configuration), with its
    vLLM's KV-event publisher where it has one (``feeds``: None for a server without events)."""
    return {"backends": [
        {"name": f"vllm-{i}", "url": url, "role": "mixed", "config": config,
         "kvEvents": [] if feed is None else [{"model": MODEL, "endpoint": feed}]}
        for i, (url, config, feed) in enumerate(zip(urls, configs, feeds, strict=True))
    ]}  # fmt: skip


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
    async with load_client() as client:
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
        instances = httpx.get(f"{router.url}/router/status", timeout=10.0).json()["instances"]
    finally:
        router.stop()
    after = [prefix_counters(httpx.get(f"{s.url}/metrics", timeout=10.0).text) for s in servers]
    ttfts = np.array([s.ttft for s in stats])
    queried = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return {
        "requests": len(stats),
        "mean_ttft_s": float(ttfts.mean()),
        "p99_ttft_s": float(np.percentile(ttfts, 99)),
        "mean_jct_s": float(np.mean([s.jct for s in stats])),
        "prefix_hit_tokens": sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
        "prefix_query_tokens": sum(queried),
        # how unevenly the route spread the prompt tokens (0.5: evenly over two servers)
        "busiest_share": max(queried) / max(sum(queried), 1.0),
        # what the router believed cached where it sent each prompt (its own record, or the engines'
        # events on precise-prefix), against which vLLM's own hits tell what was still there
        "believed_hit_tokens": sum(x["prefixCachedTokens"] for x in instances),
        "believed_prompt_tokens": sum(x["prefixPromptTokens"] for x in instances),
    }


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """The comparison's routes on the same sessions in every round, on two real vLLM servers."""
    from tessera.models.cache import resolve_model

    o = parse_options(config.options)
    rows = o.comparison.rows
    answers = load_answers()
    plans = [chat_sessions(answers, o.sessions, o.turns, seed=config.seed + r, reply_chars=o.reply_chars,
                           session_gap_s=o.session_gap, turn_gap_s=o.turn_gap, prefix=f"r{r}s")
             for r in range(o.rounds)]  # fmt: skip
    resolved = resolve_model(MODEL)
    model_dir = resolved.path
    dtype = resolved.known.dtype if resolved.known is not None else "auto"
    ceilings = [reuse_ceiling(_prompt_lengths(model_dir, plan, o.max_tokens)) for plan in plans]
    events = any(uses_engine_blocks(ROUTE_SPECS[route]) for route in rows.values())
    cache_args = [] if o.kv_blocks is None else ["--num-gpu-blocks-override", str(o.kv_blocks)]
    progress(0, total=2 + len(rows) * o.rounds)
    per_round: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="tessera-real-routing-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        servers = [
            VLLMServer(model_dir, served_model_name=MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=o.batch,
                       dtype=dtype, extra_args=["--enforce-eager", *cache_args], dev_mode=True,
                       kv_events_port=0 if events else None,
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
        configs = [worker_config(s.url, model_dir, profile, o.slo, o.batch, o.kv_blocks) for s in servers]
        workers = []
        for each in configs:
            worker = WorkerChild(each, tmp, ready_timeout_s=START_TIMEOUT_S)
            stack.callback(worker.stop)
            workers.append(worker)
        backends = tmp / "backends.json"
        feeds = [s.kv_events_endpoint for s in servers]
        backends.write_text(json.dumps(backends_document([w.url for w in workers], configs, feeds)))
        for r, plan in enumerate(plans):
            names = list(rows)
            order = names[r % len(names) :] + names[: r % len(names)]  # each row leads in turn
            for row in order:
                per_round[row].append(_run_route(servers, backends, rows[row], plan, o.max_tokens,
                                                 tmp / "router.log"))  # fmt: skip
                progress(1)
        load = watch.describe_load()
    results = [_row(row, runs) for row, runs in per_round.items()]
    checks = _checks(per_round, o.comparison.pairs)
    each = ", ".join(f"{c:.1%}" for c in ceilings)
    checks.append(f"hit rate ceiling per round (no eviction, each session on one server): {each}")
    tokens = None if o.kv_blocks is None else (o.kv_blocks - 1) * CPU_BLOCK_TOKENS
    cache = "vLLM's 1 GiB" if o.kv_blocks is None else f"{o.kv_blocks} blocks ({tokens} tokens usable)"
    checks.append(f"{load} during the runs; KV cache per server {cache}; workers' profile measured on the "
                  f"first server: {profile}")  # fmt: skip
    cfg = {**config.as_dict(), "engine": "vllm", "model": MODEL, "compare": o.compare, "sessions": o.sessions,
           "turns": o.turns, "rounds": o.rounds, "reply_chars": o.reply_chars, "max_tokens": o.max_tokens,
           "session_gap_s": o.session_gap, "turn_gap_s": o.turn_gap, "ttft_slo_s": o.slo, "batch": o.batch,
           "kv_blocks": o.kv_blocks, "routes": rows}  # fmt: skip
    return BenchReport("routing", cfg, results, checks)


def _row(row: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    hits = sum(r["prefix_hit_tokens"] for r in runs)
    queries = sum(r["prefix_query_tokens"] for r in runs)
    believed = sum(r["believed_hit_tokens"] for r in runs)
    prompts = sum(r["believed_prompt_tokens"] for r in runs)
    return {
        "policy": f"{row}:vllm",
        "rounds": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "mean_ttft_s": statistics.median(r["mean_ttft_s"] for r in runs),
        "p99_ttft_s": statistics.median(r["p99_ttft_s"] for r in runs),
        "mean_jct_s": statistics.median(r["mean_jct_s"] for r in runs),
        "cache_hit_rate": hits / queries if queries else 0.0,
        "prefill_tokens": int(queries - hits),
        "busiest_share": statistics.median(r["busiest_share"] for r in runs),
        "router_believed_hit_rate": believed / prompts if prompts else 0.0,
    }


def _checks(per_round: dict[str, list[dict[str, Any]]], pairs: tuple[tuple[str, str], ...]) -> list[str]:
    """Per pair the ratios numerator / denominator of each round, and their medians (PASS below 1)."""
    lines = []
    for num, den in pairs:
        for key in ("mean_ttft_s", "p99_ttft_s"):
            ratios = [a[key] / max(b[key], 1e-9) for a, b in zip(per_round[num], per_round[den], strict=True)]
            median = statistics.median(ratios)
            each = ", ".join(f"{x:.2f}" for x in ratios)
            lines.append(f"{num} / {den} {key}: median x{median:.2f} (rounds: {each}): "
                         f"{'PASS' if median < 1 else 'FAIL'}")  # fmt: skip
    for row, runs in per_round.items():
        each = ", ".join(f"{r['prefix_hit_tokens'] / max(r['prefix_query_tokens'], 1):.1%}" for r in runs)
        busiest = ", ".join(f"{r['busiest_share']:.0%}" for r in runs)
        lines.append(f"{row}: vLLM prefix hit rate per round {each}; busiest server's prompt share {busiest}")
    return lines


__all__ = [
    "COMPARISONS",
    "backends_document",
    "parse_options",
    "prefix_counters",
    "reuse_ceiling",
    "run",
    "worker_config",
]
