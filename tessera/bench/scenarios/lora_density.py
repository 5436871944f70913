"""Scenario ``lora-density``: GPUs needed to serve many LoRA adapters of one base model, shared against
dedicated.

Workload: the Azure 2023 conversation trace (or ``--trace``, see ``tessera.bench.runner.bench_trace``),
first ``requests`` rows at ``scales`` × the trace's own rate (``--rate`` replaces that rate), the
shape of its arrivals kept, each request drawn
(seeded, uniformly) to one of ``adapters`` adapters of one base, every one interactive with the TTFT
and ITL SLOs ``ttft_slo`` / ``itl_slo`` (the quickstart's chat class: 2 s, 0.2 s).

Rows (``shared:xS`` and ``dedicated:xS`` at each scale S), each with its GPU count and its worst
adapter's SLO attainment:

- ``shared``: every adapter served by the base's instances (what an adapter LLMService is: the base's
  vLLM servers with ``--enable-lora``), on the simulator's adapter engine (``tessera.sim.engine``: the
  adapters' requests in the base's one engine, KV pool and batch, at most ``max_loras`` adapters per
  batch, default the adapter count as the operator renders it, so no adapter waits for a slot; an
  adapter cache of ``max_cpu_loras`` adapters, default ``max_loras``, whose misses cost ``load_s``); the
  fewest instances of ``profile`` on which every adapter's SLO attainment is at least ``target``. A step
  whose batch holds adapter requests takes ``1 + lora_overhead`` times the base's step
  (``tessera.core.lora.LoraCost``; CHOICE: ``LORA_STEP_OVERHEAD``, 0.2, ASSUMED, not measured here: a
  rank-16 adapter adds under 1% of the base's FLOPs, batched multi-adapter kernels cost more than their
  FLOPs, and S-LoRA / Punica report per-token slowdowns of this order); ``--set lora_overhead=`` varies
  it, ``load_s`` (``ADAPTER_LOAD_S``, 0.1 s, a CHOICE until measured) the load.
- ``dedicated``: each adapter a deployment of its own (a full model per fine-tune, merged weights): for
  each adapter the fewest instances that hold its SLO attainment at ``target`` on its own requests,
  summed.

Both route with ``least-loaded`` and schedule FCFS (vLLM's order), so the figure is placement alone.
Check at each scale: the GPU-count ratio dedicated / shared, against the goal of at least 4x
(AIBrix reports 4.7x lower cost through adapter density). A dedicated deployment needs at least one
GPU per adapter, so the ratio is highest where each adapter's own load is far below a GPU's.

Options (``--set``): requests (2000), adapters (16), scales ("1,4,16,32,64"), ttft_slo (2.0), itl_slo
(0.2), target (0.95), lora_overhead (0.2), load_s (0.1), max_loras (adapters), max_cpu_loras
(max_loras), max_instances (64), and the cluster options of ``tessera.bench.runner.CLUSTER_OPTIONS``
(profile h100-llama3-8b).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, cluster_config_from, option, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import parse_loads, with_rate
from tessera.core.lora import ADAPTER_LOAD_S, LORA_STEP_OVERHEAD, LoraCost
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import slo_met
from tessera.sim.cluster import ClusterConfig

DESCRIPTION = "LoRA adapter density: GPUs for N adapters of one base, shared against one deployment each"
GOAL_RATIO = 4.0
__all__ = ["DESCRIPTION", "run"]


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """The fewest GPUs holding every adapter's SLO, shared on the base and dedicated per adapter, at
    each load scale."""
    opts = config.options
    n = option(opts, "requests", 2000, int)
    count = option(opts, "adapters", 16, int)
    target = option(opts, "target", 0.95, float)
    overhead = option(opts, "lora_overhead", LORA_STEP_OVERHEAD, float)
    load_s = option(opts, "load_s", ADAPTER_LOAD_S, float)
    limit = option(opts, "max_instances", 64, int)
    ttft, itl = option(opts, "ttft_slo", 2.0, float), option(opts, "itl_slo", 0.2, float)
    scales = parse_loads(opts.get("scales"), (1.0, 4.0, 16.0, 32.0, 64.0))
    if count < 1 or limit < 1 or not 0 < target <= 1 or ttft <= 0 or itl <= 0:
        raise ValueError(
            f"need adapters >= 1, max_instances >= 1, 0 < target <= 1 and positive SLOs; got "
            f"adapters={count}, max_instances={limit}, target={target}, ttft_slo={ttft}, itl_slo={itl}"
        )
    slots = option(opts, "max_loras", count, int)
    held = option(opts, "max_cpu_loras", slots, int)
    cluster = cluster_config_from(opts, profile="h100-llama3-8b")
    profile = next(iter(cluster.profiles.values()))
    names = [f"adapter-{a:02d}" for a in range(count)]
    engine = replace(
        cluster.engine, max_loras=slots, max_cpu_loras=held, lora_cost=LoraCost(load_s, overhead)
    )
    shared_cluster = replace(cluster, engine=engine, adapters=dict.fromkeys(names, "default"))
    chat = ServiceClass(name="chat", kind="interactive", ttft_slo_s=ttft, itl_slo_s=itl)
    base = trace_requests(config, AZURE_CONV, n, rate=config.rate)
    rng = np.random.default_rng(config.seed)
    adapter_of: dict[str, int] = {}
    for r, a in zip(base, rng.integers(0, count, len(base)), strict=True):
        r.service_class = chat
        adapter_of[r.id] = int(a)
    rate = _rate(base)
    progress(0, total=len(base) * 2 * len(scales))
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    for scale in scales:
        requests = with_rate(base, rate * scale)
        on_adapters = with_rate(base, rate * scale)
        for r in on_adapters:  # the shared engines serve each request under its adapter's name
            r.model = names[adapter_of[r.id]]
        shared = _fewest(on_adapters, shared_cluster, limit, target, adapter_of)
        progress(len(requests))
        dedicated: list[tuple[int | None, float]] = []
        for a in range(count):
            own = [r for r in requests if adapter_of[r.id] == a]
            dedicated.append(_fewest(own, cluster, limit, target, adapter_of) if own else (0, 1.0))
            progress(len(own))
        total = None if any(g is None for g, _ in dedicated) else sum(g or 0 for g, _ in dedicated)
        label = f"x{scale:g}"
        for name, instances, worst in (
            ("shared", shared[0], shared[1]),
            ("dedicated", total, min(w for _, w in dedicated)),
        ):
            rows.append(
                {"policy": f"{name}:{label}", "rate_rps": rate * scale,
                 "gpus": None if instances is None else instances * profile.gpus,
                 "worst_adapter_slo_attainment": worst}
            )  # fmt: skip
        checks.append(_check(label, rate * scale, shared[0], total, limit))
    cfg = {**config.as_dict(), "requests": n, "adapters": count, "target": target, "lora_overhead": overhead,
           "load_s": load_s, "max_loras": slots, "max_cpu_loras": held, "ttft_slo_s": ttft, "itl_slo_s": itl,
           "profile": profile.name, "trace_rate_rps": rate, "scales": list(scales)}  # fmt: skip
    return BenchReport("lora-density", cfg, rows, checks)


def _rate(requests: Sequence[Request]) -> float:
    """The requests' mean arrival rate (requests/s)."""
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: give --rate")
    return len(requests) / span


def _fewest(
    requests: Sequence[Request], cluster: ClusterConfig, limit: int, target: float, adapter_of: dict[str, int]
) -> tuple[int | None, float]:
    """The fewest instances (1 to ``limit``) on which every adapter among ``requests`` meets its SLO in at
    least ``target`` of its requests, and the worst adapter's attainment there (None and the attainment
    at ``limit`` when even that is short). Attainment grows with instances: bisection."""

    def worst(instances: int) -> float:
        done, _ = run_one(requests, lambda: make_policy("fcfs"), replace(cluster, instances=instances))
        met: dict[int, list[bool]] = {}
        for r in done:
            met.setdefault(adapter_of[r.id], []).append(bool(slo_met(r)))
        return min(sum(m) / len(m) for m in met.values())

    low, high = 1, limit
    at_high = worst(high)
    if at_high < target:
        return None, at_high
    best = (high, at_high)
    while low < high:
        mid = (low + high) // 2
        value = worst(mid)
        if value >= target:
            high, best = mid, (mid, value)
        else:
            low = mid + 1
    return best


def _check(label: str, rate: float, shared: int | None, dedicated: int | None, limit: int) -> str:
    """The GPU-count ratio at one load against the goal."""
    if shared is None or dedicated is None:
        who = "shared" if shared is None else "dedicated"
        return f"{label} ({rate:.1f} req/s): {who} holds the target on no count up to max_instances={limit}"
    ratio = dedicated / shared
    verdict = "PASS" if ratio >= GOAL_RATIO else "FAIL"
    return (
        f"{label} ({rate:.1f} req/s): dedicated {dedicated} vs shared {shared} instances, {ratio:.2f}x "
        f"fewer GPUs shared (goal >= {GOAL_RATIO:g}x): {verdict}"
    )
