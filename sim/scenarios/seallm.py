"""`tessera bench seallm`: SeaLLM placement + DB scheduling vs dedicated GPUs and round-robin sharing.

Workload (seallm_spec §9.3, PROPOSALs): 16 services, each a model (7B-class or 13B-class, spec part C
profiles) with a ShareGPT-like (short prompt, long output) or LongBench-like (long prompt, short output)
length profile; arrivals from a synthetic MAF-like trace (64 functions, lognormal base rates, per-minute
jitter and bursts, functions round-robin to services), scaled to ``--rate`` (default 8 req/s).

Rows (same requests, seed and group simulator):
- ``seallm``: SeaLLM placement planned on a warm-up window of history, DB scheduling, unified KV;
- ``dedicated``: one group per service, GPUs split evenly, FCFS (SeaLLM's vLLM baseline);
- ``round-robin``: every GPU shared by two services assigned round-robin, services alternate iterations.

Requests of a service are split over its replicas statically round-robin (spec §6 speed-up). The
placement is computed once (no re-placement during the window). ``--set part=planner`` instead times
the planner on 32 services over 64 GPUs and reports the greedy's gap to the exact MILP on a small case.
Options (``--set``): services=16, gpus=32, minutes=5, warmup_minutes=2, slo_scale=5, part=serve|planner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.operator.planners import (
    HistoryRequest,
    LatencyModel,
    PlacementPlan,
    PoolInput,
    ServiceInput,
    plan_placement,
)
from tessera.operator.planners.group_sim import RequestOutcome, Scheduler, service_stats, simulate_group
from tessera.operator.planners.naming import group_name
from tessera.operator.planners.placement import fits
from tessera.operator.planners.types import GroupPlan, RoleCounts
from tessera.sim.scenarios import BenchConfig, BenchReport, Progress

DESCRIPTION = "SeaLLM placement + DB scheduling vs dedicated GPUs and round-robin sharing (16 services)"
GIB = 2**30

# Spec part C (A100/A800-class) linear step models: c0, c1, c2 (per context token), p0, p1 (per prompt token).
MODELS: dict[str, tuple[LatencyModel, int, int]] = {
    "7b": (LatencyModel(0.0075, 2e-5, 6.6e-8, 0.005, 8e-5), int(13.5e9), 512 * 1024),
    "13b": (LatencyModel(0.013, 2e-5, 4e-7, 0.008, 1.4e-4), int(26e9), 800 * 1024),
}
# (mean prompt, cv prompt, mean output, cv output) — Tab. 1 means, spec §9.3 CVs.
PROFILES = {"sharegpt": (73.0, 1.0, 427.0, 1.0), "longbench": (13187.0, 0.5, 21.0, 1.0)}


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    sigma = math.sqrt(math.log(1 + cv * cv))
    return np.maximum(1, rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)).round().astype(int)


def maf_like_counts(
    rng: np.random.Generator, n_services: int, minutes: int, functions: int = 64
) -> np.ndarray:
    """Per-service, per-minute relative rates of a synthetic MAF-like trace (spec §9.3 PROPOSAL)."""
    base = rng.lognormal(0.0, 2.0, functions)
    rates = np.zeros((n_services, minutes))
    order = np.argsort(-base)  # functions in a fixed order (by size), round-robin to services
    for rank, f in enumerate(order):
        burst_left = 0
        for m in range(minutes):
            r = base[f] * rng.lognormal(0.0, 0.5)
            if burst_left == 0 and rng.random() < 0.05:
                burst_left = int(rng.geometric(1 / 3))
                mult = rng.uniform(3, 10)
            if burst_left > 0:
                r *= mult
                burst_left -= 1
            rates[rank % n_services, m] += r
    return rates


def build_workload(
    seed: int, n_services: int, rate: float, minutes: int, warmup: int, slo_scale: float
) -> tuple[list[ServiceInput], dict[str, list[HistoryRequest]]]:
    """Services (with warm-up history) and the requests of the evaluation window (times from 0)."""
    rng = np.random.default_rng(seed)
    total = minutes + warmup
    rates = maf_like_counts(rng, n_services, total)
    rates *= rate / (rates.sum() / total)  # rates are req/s per minute; mean total = rate
    services, window = [], {}
    for i in range(n_services):
        model = "13b" if i % 4 == 3 else "7b"
        profile = "longbench" if i % 2 else "sharegpt"
        lm, weights, kvb = MODELS[model]
        mp, cvp, mo, cvo = PROFILES[profile]
        arrivals = []
        for m in range(total):
            n = rng.poisson(rates[i, m] * 60.0)
            arrivals.extend(sorted(60.0 * m + rng.uniform(0, 60.0, n)))
        n = len(arrivals)
        prompts = _lognormal(rng, mp, cvp, n)
        outputs = _lognormal(rng, mo, cvo, n)
        reqs = [
            HistoryRequest(float(a) - warmup * 60.0, int(p), int(o))
            for a, p, o in zip(arrivals, prompts, outputs, strict=True)
        ]
        hist = tuple(r for r in reqs if r.arrival < 0)
        name = f"{profile}-{model}-{i:02d}"
        services.append(
            ServiceInput(
                name=name,
                weights_bytes=weights,
                kv_bytes_per_token=kvb,
                latency=lm,
                request_rate=len(hist) / (warmup * 60.0),
                mean_prompt_tokens=float(np.mean([h.prompt_tokens for h in hist])) if hist else mp,
                mean_output_tokens=float(np.mean([h.output_tokens for h in hist])) if hist else mo,
                p99_context_tokens=int(mp * 3 + mo * 3),
                slo_scale=slo_scale,
                history=hist,
            )
        )
        window[name] = [r for r in reqs if r.arrival >= 0]
    return services, window


def round_robin_plan(pool: PoolInput, services: Sequence[ServiceInput]) -> PlacementPlan:
    """Every GPU hosts two services, paired round-robin (s_i with s_{i+n/2}); pairs share the GPUs evenly."""
    half = (len(services) + 1) // 2
    pairs = [
        tuple(sorted({services[i].name, services[(i + half) % len(services)].name})) for i in range(half)
    ]
    by = {s.name: s for s in services}
    per = pool.max_gpus // len(pairs)
    groups = []
    for p in pairs:
        tp = max(by[n].tp_min for n in p)
        while not fits(pool, [by[n] for n in p], tp):  # two large models need a larger TP to share
            tp *= 2
        groups.append(GroupPlan(group_name(p, tp), p, tp, RoleCounts(interactive=max(1, per // tp))))
    return PlacementPlan("round-robin", tuple(groups))


def serve_plan(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    plan: PlacementPlan,
    window: dict[str, list[HistoryRequest]],
    scheduler: Scheduler,
    horizon: float,
) -> list[RequestOutcome]:
    """Simulate every instance of ``plan``; a service's requests go round-robin over its instances."""
    by = {s.name: s for s in services}
    stats = service_stats(services)
    instances: list[tuple[GroupPlan, list[tuple[str, HistoryRequest]]]] = []
    slots: dict[str, list[int]] = {}
    for gp in plan.groups:
        for _ in range(gp.replicas.total):
            for n in gp.services:
                slots.setdefault(n, []).append(len(instances))
            instances.append((gp, []))
    for name, reqs in window.items():
        for i, r in enumerate(reqs):
            instances[slots[name][i % len(slots[name])]][1].append((name, r))
    outcomes: list[RequestOutcome] = []
    for gp, reqs in instances:
        res = simulate_group(
            pool, [by[n] for n in gp.services], gp.tp, reqs, scheduler=scheduler, horizon=horizon, stats=stats
        )
        outcomes.extend(res.outcomes)
    return outcomes


def metrics(outcomes: Sequence[RequestOutcome], gpus: int, horizon: float) -> dict[str, Any]:
    """Contract metrics of one row."""
    lat = np.array([o.latency for o in outcomes])
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    by_service: dict[str, list[bool]] = {}
    for o in outcomes:
        by_service.setdefault(o.service, []).append(o.slo_met)
    return {
        "normalized_latency_mean": float(np.mean([o.norm_latency for o in outcomes])),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "mean_jct_s": float(lat.mean()),
        "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
        "slo_attainment": float(np.mean([o.slo_met for o in outcomes])),
        "slo_attainment_by_class": {k: float(np.mean(v)) for k, v in sorted(by_service.items())},
        "min_service_slo_attainment": float(min(np.mean(v) for v in by_service.values())),
        "unfinished": int(sum(not o.finished for o in outcomes)),
        "requests": len(outcomes),
        "gpu_seconds": gpus * horizon,
    }


def _opt(config: BenchConfig, key: str, default: float) -> float:
    value = config.options.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--set {key}= must be a number, got {value!r}") from exc
    if out <= 0:
        raise ValueError(f"--set {key}= must be > 0, got {value!r}")
    return out


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run the scenario (serving comparison, or the planner timing with ``--set part=planner``)."""
    part = str(config.options.get("part", "serve"))
    if part == "planner":
        return run_planner(config, progress)
    if part != "serve":
        raise ValueError(f"--set part= must be 'serve' or 'planner', got {part!r}")
    if config.trace is not None:
        raise ValueError(
            "bench seallm builds its MAF-like multi-service trace; --trace is not supported here"
        )
    n = int(_opt(config, "services", 16))
    gpus = int(_opt(config, "gpus", 32))
    minutes = int(_opt(config, "minutes", 5))
    warmup = int(_opt(config, "warmup_minutes", 2))
    rate = config.rate if config.rate is not None else 8.0
    slo_scale = _opt(config, "slo_scale", 5.0)
    services, window = build_workload(config.seed, n, rate, minutes, warmup, slo_scale)
    pool = PoolInput("bench", "A800", 80 * GIB, gpus)
    horizon = minutes * 60.0 * 3  # drain time after the window; requests left then are censored
    progress(0, total=3)
    rows = []
    t = time.perf_counter()
    seallm_plan = plan_placement(pool, services, strategy="seallm", now=0.0)
    plan_s = time.perf_counter() - t
    setups: list[tuple[str, PlacementPlan, Scheduler]] = [
        ("seallm", seallm_plan, "db"),
        ("dedicated", plan_placement(pool, services, strategy="dedicated", now=0.0), "fcfs"),
        ("round-robin", round_robin_plan(pool, services), "rr"),
    ]
    for name, plan, sched in setups:
        t = time.perf_counter()
        out = serve_plan(pool, services, plan, window, sched, horizon)
        row = {"policy": name, **metrics(out, plan.gpus, minutes * 60.0), "wall_s": time.perf_counter() - t}
        row["groups"] = len(plan.groups)
        if name == "seallm":
            row["plan_wall_s"] = plan_s
            row["plan"] = [f"{'+'.join(g.services)} x{g.replicas.total} tp{g.tp}" for g in plan.groups]
        rows.append(row)
        progress(1)
    best = min(rows[1:], key=lambda r: r["normalized_latency_mean"])
    best_slo = max(r["slo_attainment"] for r in rows[1:])
    s = rows[0]
    ratio = best["normalized_latency_mean"] / s["normalized_latency_mean"]
    checks = [
        f"seallm mean normalized latency {ratio:.2f}x lower than the better baseline ({best['policy']}) "
        f"(target >= 3x): {'PASS' if ratio >= 3 else 'FAIL'}",
        f"seallm SLO attainment {s['slo_attainment']:.3f} vs best baseline {best_slo:.3f} (target higher): "
        f"{'PASS' if s['slo_attainment'] > best_slo else 'FAIL'}",
    ]
    cfg = {
        **config.as_dict(),
        "services": n,
        "gpus": gpus,
        "minutes": minutes,
        "rate": rate,
        "slo_scale": slo_scale,
    }
    return BenchReport("seallm", cfg, rows, checks)


def run_planner(config: BenchConfig, progress: Progress) -> BenchReport:
    """Planner timing (32 services over 64 GPUs) and the greedy's gap to the MILP on a small partition."""
    from tessera.operator.planners.placement import generate_groups, greedy_allocate
    from tessera.operator.planners.placement_ilp import max_utilization, solve_partition

    n = int(_opt(config, "services", 32))
    gpus = int(_opt(config, "gpus", 64))
    rate = config.rate if config.rate is not None else 16.0
    services, _ = build_workload(config.seed, n, rate, 1, 2, 5.0)
    pool = PoolInput("bench", "A800", 80 * GIB, gpus)
    progress(0, total=2)
    t = time.perf_counter()
    plan = plan_placement(pool, services, strategy="seallm", now=0.0)
    wall = time.perf_counter() - t
    progress(1)
    rows: list[dict[str, Any]] = [
        {
            "policy": f"seallm:services={n},gpus={gpus}",
            "wall_s": wall,
            "groups": len(plan.groups),
            "gpus_used": plan.gpus,
            "estimated_slo_attainment": plan.estimated_slo_attainment,
            "estimated_norm_latency": plan.estimated_norm_latency,
        }
    ]
    small = services[:5]
    small_pool = PoolInput("small", "A800", 80 * GIB, 4, gpus_per_node=4)
    groups = generate_groups(small_pool, small, 1)
    greedy_allocate(small_pool, small, groups, 2)
    t = time.perf_counter()
    ilp = solve_partition(small_pool, small, generate_groups(small_pool, small, 1), 2)
    ilp_wall = time.perf_counter() - t
    u_greedy = max_utilization(small, groups)
    gap = u_greedy / ilp.max_utilization - 1 if ilp.max_utilization > 0 else 0.0
    rows.append(
        {
            "policy": "seallm-ilp:services=5,gpus=4",
            "wall_s": ilp_wall,
            "max_utilization_ilp": ilp.max_utilization,
            "max_utilization_greedy": u_greedy,
            "greedy_gap": gap,
        }
    )
    progress(1)
    checks = [
        f"plan of {n} services over {gpus} GPUs in {wall:.2f} s (target <= 10 s): "
        f"{'PASS' if wall <= 10 else 'FAIL'}",
        f"greedy max utilization {gap:.1%} above the MILP optimum on 5 services / 4 GPUs (reported gap)",
    ]
    return BenchReport("seallm", {**config.as_dict(), "part": "planner"}, rows, checks)
