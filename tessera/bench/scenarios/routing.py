"""Scenario ``routing``: the router's routes on prefix-sharing traffic, with prefix caching on.

Workload: the Mooncake synthetic trace (multi-turn prefix sharing; ``--trace`` takes any file in its
format: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks; or
a rate series, whose sampled arrivals (``rate_dist``: poisson | gamma) the Mooncake requests take, or
a lengths file with output lengths only, which they take),
first ``requests`` rows, arrivals rescaled to ``load`` × the cluster's capacity measured without a
prefix cache (FCFS, every request at once). Every instance caches prompt blocks (the simulator's
prefix cache: a prompt's leading blocks it holds are not prefilled again; least recently used blocks
go first when the KV cache is full). Every request is interactive with the TTFT SLO ``ttft_slo``.

Rows (route:load), each the route of ``tessera.core.routing`` the live router runs with
``tessera router --route``: ``round-robin``, ``least-loaded``, ``wait`` (``least-wait``: QLM's
estimated wait), ``prefix`` (cached prompt blocks alone, as the router estimates them: where it sent
each prompt), ``precise-prefix`` (cached prompt blocks alone, as each engine holds them: what vLLM's KV
events report, here each simulated instance's own prefix cache, without the events' delay),
``cache-aware`` (the expected time to the first token: wait plus the prefill still ahead there plus
the uncached prompt's prefill) and ``combined``
(``slo-prefix``: among the instances where that expected time meets the class's TTFT SLO, the one
where it is least; ties to the session's instance, then to the one holding most of the prompt).
Each reports TTFT mean and p99, SLO attainment, the prompt tokens prefilled and the prefix-cache hit
rate (prompt tokens served from the cache over all prompt tokens).

Checks: ``combined`` against every baseline route on SLO attainment and TTFT p99 (against
``precise-prefix`` and ``cache-aware`` the figures are only reported, as ``precise-prefix`` against
``prefix``), and every route against ``least-loaded`` (the cluster's default route) on throughput and
TTFT p99: no worse than ``tolerance``.

``--set workload=chat`` replaces the Mooncake trace by multi-turn chat sessions built from AlpacaEval
prompts and recorded answers (``tessera.bench.chat_sessions.sim_chat_requests``: each turn sends the
conversation so far; its prefix blocks are vLLM's hash chain over the real prompt's tokens in blocks
of 16; ``turns`` per session, 5).

Options (``--set``): requests (2000), loads ("0.5,0.7,0.9"), ttft_slo (3.0), instances (8), rate_dist,
tolerance (0.10), workload (mooncake | chat), turns (chat: 5), and the cluster options of
``tessera.bench.runner.CLUSTER_OPTIONS``.

``--set engine=vllm`` runs the real part instead (``tessera.bench.real_routing``): the combined route
against round-robin on two real vLLM servers behind the live router, on multi-turn chat sessions, as
paired ratios over interleaved rounds (its own options are listed there); with ``--set compare=precise``
``precise-prefix`` against ``prefix`` (round-robin as reference) on KV caches small enough that vLLM
evicts during the run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tessera.bench.chat_sessions import sim_chat_requests
from tessera.bench.runner import SHARED_DATA, cluster_config_from, option, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import (
    baseline_checks,
    parse_loads,
    plot_metric_vs_load,
    rate_points,
    saturation_rate,
    tolerance,
    with_rate,
)
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.cluster import RouteRouter

DESCRIPTION = (
    "Router routes (round-robin, least-loaded, wait, prefix, precise-prefix, combined) on prefix-sharing "
    "traffic"
)
MOONCAKE = SHARED_DATA / "mooncake_fast25_synthetic_trace.jsonl.gz"
ROWS = {
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
    "wait": "least-wait",
    "prefix": "prefix",
    "precise-prefix": "precise-prefix",
    "cache-aware": "cache-aware",
    "combined": "slo-prefix",
}
BASELINES = ("round-robin", "least-loaded", "wait", "prefix")


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every route at every load on the same requests (``engine=vllm``: the real part)."""
    opts = config.options
    engine = str(opts.get("engine", "sim"))
    if engine == "vllm":
        if config.trace is not None or config.rate is not None or config.load is not None:
            raise ValueError(
                "--set engine=vllm replays chat sessions built from AlpacaEval; size them with "
                "--set sessions=, turns=, session_gap=, turn_gap= (no --trace, --rate or --load)"
            )
        from tessera.bench.real_routing import run as run_real

        return run_real(config, progress)
    if engine != "sim":
        raise ValueError(f"--set engine= must be 'sim' or 'vllm', got {engine!r}")
    n = option(opts, "requests", 2000, int)
    loads = parse_loads(config.load if config.load is not None else opts.get("loads"), (0.5, 0.7, 0.9))
    slo = option(opts, "ttft_slo", 3.0, float)
    if slo <= 0:
        raise ValueError(f"ttft_slo must be > 0 seconds, got {slo}")
    cached = cluster_config_from(opts, instances=8)
    cached = replace(cached, engine=replace(cached.engine, prefix_caching=True))
    workload = str(opts.get("workload", "mooncake"))
    if workload == "chat":
        if config.trace is not None:
            raise ValueError("--set workload=chat builds its sessions from AlpacaEval: leave out --trace "
                             "(it goes with workload=mooncake)")  # fmt: skip
        turns = option(opts, "turns", 5, int)
        if turns < 1:
            raise ValueError(f"--set turns must be >= 1, got {turns}")
        base = sim_chat_requests(n, turns, config.seed)
    elif workload == "mooncake":
        base = trace_requests(config, MOONCAKE, n)
    else:
        raise ValueError(f"--set workload= must be 'mooncake' or 'chat', got {workload!r}")
    if not any(r.prefix_blocks for r in base):
        raise ValueError(
            "the trace has no hash_ids: routing needs a Mooncake-format trace with prompt blocks, or a "
            "rate series (window_start_s,rate_rps[,cv]) whose arrivals the Mooncake requests take"
        )
    interactive = ServiceClass(name="interactive", kind="interactive", ttft_slo_s=slo)
    for r in base:
        r.service_class = interactive
    capacity = saturation_rate(base, replace(cached, engine=replace(cached.engine, prefix_caching=False)))
    rates, labels = rate_points(config.rate, loads, capacity)
    progress(0, total=len(base) * len(ROWS) * len(rates))
    rows: list[dict[str, Any]] = []
    for rate, label in zip(rates, labels, strict=True):
        reqs = with_rate(base, rate)
        for row, route in ROWS.items():
            done, metrics = run_one(reqs, lambda: make_policy("fcfs"), cached, router=RouteRouter(route),
                                    progress=progress)  # fmt: skip
            rows.append({"policy": f"{row}:{label}", **metrics, **_cache_metrics(done)})
    cfg = {**config.as_dict(), "requests": n, "capacity_rps": capacity, "rates": rates, "ttft_slo_s": slo,
           "workload": workload}  # fmt: skip
    cfg["cluster"] = {"instances": cached.instances, "max_batch": cached.engine.max_batch,
                      "profile": next(iter(cached.profiles.values())).name}  # fmt: skip
    tol = tolerance(opts)
    cfg["tolerance"] = tol
    return BenchReport("routing", cfg, rows, _checks(rows, labels, tol))


def _cache_metrics(requests: list[Request]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in requests)
    hit = sum(r.cached_prompt_tokens for r in requests)
    return {"prefill_tokens": prompt - hit, "cache_hit_rate": hit / prompt if prompt else 0.0}


def _checks(rows: list[dict[str, Any]], labels: list[str], tol: float) -> list[str]:
    """The goal: combined beats every baseline route on SLO attainment and TTFT p99 at each load;
    against cache-aware (its own ablation without the SLO filter) and precise-prefix (prefix affinity
    on what the engines hold, which combined does not read) the figures are only reported, as are
    precise-prefix's against prefix's (the same affinity on the router's estimate). Then every route
    against least-loaded on throughput and TTFT p99 (``tol``)."""
    checks = []
    for label in labels:
        by = {r["policy"].split(":")[0]: r for r in rows if r["policy"].endswith(":" + label)}
        mine = by["combined"]
        for name, other in (("combined", "cache-aware"), ("combined", "precise-prefix"),
                            ("precise-prefix", "prefix")):  # fmt: skip
            a, b = by[name], by[other]
            checks.append(
                f"{name} vs {other}:{label}: SLO {a['slo_attainment']:.1%} vs {b['slo_attainment']:.1%}, "
                f"TTFT p99 {a['p99_ttft_s']:.2f}s vs {b['p99_ttft_s']:.2f}s, cache hits "
                f"{a['cache_hit_rate']:.1%} vs {b['cache_hit_rate']:.1%}"
            )
        for other in BASELINES:
            row = by[other]
            slo_ok = mine["slo_attainment"] >= row["slo_attainment"] - 1e-9
            p99_ok = mine["p99_ttft_s"] <= row["p99_ttft_s"] + 1e-9
            checks.append(
                f"combined vs {other}:{label}: SLO {mine['slo_attainment']:.1%} vs "
                f"{row['slo_attainment']:.1%}, TTFT p99 {mine['p99_ttft_s']:.2f}s vs "
                f"{row['p99_ttft_s']:.2f}s: {'PASS' if slo_ok and p99_ok else 'FAIL'}"
            )
        others = [row for name, row in by.items() if name != "least-loaded"]
        checks += baseline_checks(others, by["least-loaded"], tol, metric="p99_ttft_s")
    return checks


def plot(report: BenchReport, out_dir: Path) -> list[Path]:
    """TTFT p99, SLO attainment and cache hit rate against load."""
    return plot_metric_vs_load(report.results, out_dir, ("p99_ttft_s", "slo_attainment", "cache_hit_rate"))


__all__ = ["DESCRIPTION", "plot", "run"]
