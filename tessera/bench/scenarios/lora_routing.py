"""Scenario ``lora-routing``: adapter-affinity routing against round-robin and least-loaded, on many
LoRA adapters of one base whose engines hold few of them at once.

Cluster: ``instances`` (4) instances of the base (``profile``, h100-llama3-8b), each serving every one of
``adapters`` (32) adapters on its one engine (``tessera.sim.engine``: one KV pool, one batch) with
``max_loras`` (8) GPU slots, so that one batch mixes at most 8 adapters and a request whose adapter finds
no slot waits, and an adapter cache of ``max_cpu_loras`` adapters (default ``max_loras``, vLLM's own
default) whose misses load the adapter (``load_s``, ``tessera.core.lora.ADAPTER_LOAD_S``: a CHOICE until
measured) before the engine's next step. Steps holding adapter requests take ``1 + lora_overhead`` times
the base's (``LORA_STEP_OVERHEAD``, ASSUMED).

Workload: the Azure 2023 conversation trace (``--trace`` replaces it), first ``requests`` rows, arrivals
rescaled to ``load`` × the cluster's capacity serving one adapter (FCFS, every request at once: the
LoRA step overhead paid, no slot ever waited for), each request drawn (seeded) to one adapter with Zipf
popularity: adapter k (0-based) has weight ``1 / (k + 1) ** zipf`` (CHOICE: ``zipf`` 1.0, a few popular
fine-tunes and a long tail; 0 is uniform). Every request is interactive with the TTFT SLO ``ttft_slo`` (2 s).

Rows (route:load), each a route of ``tessera.core.routing`` on the same requests, FCFS in every pod:
``adapter-affinity`` (the estimated wait plus the adapter's cost there, its scorer's ``load_seconds`` the
engines' ``load_s``), ``round-robin`` and ``least-loaded``. Each reports TTFT mean and p99, SLO
attainment and the adapter loads per request.

Check at each load: adapter-affinity's TTFT p99 at most ``goal_ratio`` (0.5) × round-robin's; against
least-loaded the figures are reported.

Options (``--set``): requests (2000), instances (4), adapters (32), max_loras (8), max_cpu_loras
(max_loras), zipf (1.0), loads ("0.5,0.7,0.9"), ttft_slo (2.0), load_s (0.1), lora_overhead (0.2),
goal_ratio (0.5), and the cluster options of ``tessera.bench.runner.CLUSTER_OPTIONS`` (profile
h100-llama3-8b).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, cluster_config_from, option, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import parse_loads, rate_points, saturation_rate, with_rate
from tessera.core.lora import ADAPTER_LOAD_S, LORA_STEP_OVERHEAD, LoraCost
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.cluster import ClusterConfig, RouteRouter

DESCRIPTION = "Adapter-affinity routing against round-robin and least-loaded: 32 LoRA adapters, 8 slots each"
BASE = "base"
ROWS = ("adapter-affinity", "round-robin", "least-loaded")
__all__ = ["DESCRIPTION", "adapter_weights", "run"]


def adapter_weights(count: int, zipf: float) -> np.ndarray:
    """Each adapter's share of the requests: ``1 / (k + 1) ** zipf``, normalised."""
    weights = 1.0 / np.arange(1, count + 1) ** zipf
    return weights / weights.sum()


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every route at every load on the same requests."""
    opts = config.options
    n = option(opts, "requests", 2000, int)
    count = option(opts, "adapters", 32, int)
    slots = option(opts, "max_loras", 8, int)
    held = option(opts, "max_cpu_loras", slots, int)
    zipf = option(opts, "zipf", 1.0, float)
    slo = option(opts, "ttft_slo", 2.0, float)
    load_s = option(opts, "load_s", ADAPTER_LOAD_S, float)
    overhead = option(opts, "lora_overhead", LORA_STEP_OVERHEAD, float)
    goal = option(opts, "goal_ratio", 0.5, float)
    loads = parse_loads(config.load if config.load is not None else opts.get("loads"), (0.5, 0.7, 0.9))
    if count < 1 or slots < 1 or held < slots or zipf < 0 or slo <= 0 or goal <= 0:
        raise ValueError(
            f"need adapters >= 1, max_loras >= 1, max_cpu_loras >= max_loras, zipf >= 0 and positive "
            f"ttft_slo and goal_ratio; got adapters={count}, max_loras={slots}, max_cpu_loras={held}, "
            f"zipf={zipf}, ttft_slo={slo}, goal_ratio={goal}"
        )
    cluster = cluster_config_from(opts, profile="h100-llama3-8b", instances=4)
    profile = next(iter(cluster.profiles.values()))
    names = [f"adapter-{k:02d}" for k in range(count)]
    cost = LoraCost(load_s, overhead)
    engine = replace(cluster.engine, max_loras=slots, max_cpu_loras=held, lora_cost=cost)
    cluster = replace(cluster, profiles={BASE: profile}, engine=engine, adapters=dict.fromkeys(names, BASE))
    base = trace_requests(config, AZURE_CONV, n)
    chat = ServiceClass(name="chat", kind="interactive", ttft_slo_s=slo)
    for r in base:
        r.model = names[0]
        r.service_class = chat
    capacity = saturation_rate(base, cluster)
    rng = np.random.default_rng(config.seed)
    for r, k in zip(base, rng.choice(count, size=len(base), p=adapter_weights(count, zipf)), strict=True):
        r.model = names[k]
    rates, labels = rate_points(config.rate, loads, capacity)
    progress(0, total=len(base) * len(ROWS) * len(rates))
    rows: list[dict[str, Any]] = []
    for rate, label in zip(rates, labels, strict=True):
        reqs = with_rate(base, rate)
        for route in ROWS:
            rows.append({"policy": f"{route}:{label}", **_run_route(reqs, cluster, route, load_s, progress)})
    cfg = {**config.as_dict(), "requests": n, "instances": cluster.instances, "adapters": count,
           "max_loras": slots, "max_cpu_loras": held, "zipf": zipf, "ttft_slo_s": slo, "load_s": load_s,
           "lora_overhead": overhead, "goal_ratio": goal, "capacity_rps": capacity, "rates": rates,
           "profile": profile.name}  # fmt: skip
    return BenchReport("lora-routing", cfg, rows, _checks(rows, labels, goal))


def _run_route(
    reqs: list[Request], cluster: ClusterConfig, route: str, load_s: float, progress: Progress
) -> dict[str, Any]:
    """One route's metrics on ``reqs`` (adapter-affinity prices a load as the engines charge it)."""
    settings = {"adapter-affinity": {"load_seconds": load_s}} if route == "adapter-affinity" else {}
    router = RouteRouter(route, **settings)
    _, metrics = run_one(reqs, lambda: make_policy("fcfs"), cluster, router=router, progress=progress)
    return metrics


def _checks(rows: list[dict[str, Any]], labels: list[str], goal: float) -> list[str]:
    """adapter-affinity's TTFT p99 against ``goal`` × round-robin's at each load; least-loaded's reported."""
    checks = []
    for label in labels:
        by = {r["policy"].split(":")[0]: r for r in rows if r["policy"].endswith(":" + label)}
        mine, rr, ll = by["adapter-affinity"], by["round-robin"], by["least-loaded"]
        ratio = mine["p99_ttft_s"] / rr["p99_ttft_s"] if rr["p99_ttft_s"] > 0 else float("inf")
        checks.append(
            f"adapter-affinity vs round-robin:{label}: TTFT p99 {mine['p99_ttft_s']:.2f}s vs "
            f"{rr['p99_ttft_s']:.2f}s ({ratio:.2f}x, goal <= {goal:g}x), adapter loads per request "
            f"{mine['adapter_loads_per_request']:.3f} vs {rr['adapter_loads_per_request']:.3f}: "
            f"{'PASS' if ratio <= goal else 'FAIL'}"
        )
        checks.append(
            f"adapter-affinity vs least-loaded:{label}: TTFT p99 {mine['p99_ttft_s']:.2f}s vs "
            f"{ll['p99_ttft_s']:.2f}s, SLO {mine['slo_attainment']:.1%} vs {ll['slo_attainment']:.1%}, "
            f"adapter loads per request {mine['adapter_loads_per_request']:.3f} vs "
            f"{ll['adapter_loads_per_request']:.3f}"
        )
    return checks
