"""Scenario ``fair-share``: one tenant floods, the other keeps its share (VTC, ``tessera.core.fair_share``).

Workload: two tenants of one interactive class (TTFT SLO ``ttft_slo``, default 2 s), lengths from the
Azure 2023 conversation trace (or ``--trace``: any trace of requests, see
``tessera.bench.runner.bench_trace``; its arrivals are not used). Tenant ``a`` sends ``requests``
(default 300) Poisson arrivals at its fair share, half the instance's measured capacity (FCFS with
every request at once; ``--load X``: X × capacity instead, ``--rate R``: R requests/s); tenant ``b``
sends ``flood`` (default 10) times a's rate over the same time, ``flood`` × as many requests, from the
next rows of the trace. The instance thus serves about twice a's load, while b alone asks five times
what it can serve.

Rows (the inner policy ``policy``, default fcfs): ``<policy>:tenants=a`` (a alone),
``<policy>:tenants=a+b`` (both, no fair share) and ``<policy>:tenants=a+b:vtc`` (both, the policy inside
VTC with weights ``input_weight`` 1 and ``output_weight`` 2). The contract's metrics are tenant a's;
``b_p99_ttft_s``, ``b_slo_attainment`` and ``b_output_tokens_per_s`` are b's. The VTC row also reports
``max_service_gap`` (the largest difference in weighted service between a and b over an interval both
were backlogged, at the wrapper's decision points) and ``vtc_bound`` (the paper's 2U: twice the largest
weighted tokens of one request).

Checks: with VTC, a's TTFT p99 within ``ttft_factor`` (1.2) × alone and its SLO attainment within
``slo_points`` (3) points of alone; the same for the row without VTC (expected to fail: the flood
takes the queue); the service gap within the bound.

Options (``--set``): requests, flood, ttft_slo, policy, input_weight, output_weight, ttft_factor,
slo_points, and the cluster options of ``tessera.bench.runner.CLUSTER_OPTIONS`` (max_batch default 32).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, cluster_config_from, option, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import saturation_rate
from tessera.core.fair_share import FairShare
from tessera.core.policy import Policy
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import summarize
from tessera.sim.workloads import poisson_arrivals

DESCRIPTION = (
    "Two tenants of one class, a at its fair share and b at ten times it: a's TTFT and SLO alone, "
    "beside b, and beside b under VTC fair share; VTC's service gap against its bound"
)


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run tenant a alone, both tenants, and both under VTC, on the same requests."""
    opts = config.options
    n_a = option(opts, "requests", 300, int)
    flood = option(opts, "flood", 10.0, float)
    slo = option(opts, "ttft_slo", 2.0, float)
    inner = option(opts, "policy", "fcfs", str)
    w_in, w_out = option(opts, "input_weight", 1.0, float), option(opts, "output_weight", 2.0, float)
    factor, points = option(opts, "ttft_factor", 1.2, float), option(opts, "slo_points", 3.0, float)
    if n_a < 2 or not flood > 0 or not slo > 0:
        raise ValueError(f"requests must be >= 2, flood and ttft_slo > 0; got {n_a}, {flood}, {slo}")
    make_policy(inner)  # an unknown policy fails before anything runs
    cluster = cluster_config_from(opts, max_batch=32)
    n_b = math.ceil(n_a * flood)
    base = trace_requests(config, AZURE_CONV, n_a + n_b)
    if len(base) < n_a + n_b:
        raise ValueError(
            f"the trace has {len(base)} requests; requests={n_a} and flood={flood:g} need {n_a + n_b}"
        )
    capacity = saturation_rate(base[:n_a], cluster)
    rate_a = config.rate if config.rate is not None else capacity * (config.load or 0.5)
    chat = ServiceClass("chat", kind="interactive", ttft_slo_s=slo)
    rng = np.random.default_rng(config.seed + 43)
    tenant_a = _tenant(base[:n_a], "a", poisson_arrivals(n_a, rate_a, rng), chat)
    tenant_b = _tenant(base[n_a:], "b", poisson_arrivals(n_b, rate_a * flood, rng), chat)
    both = sorted(tenant_a + tenant_b, key=lambda r: r.arrival)
    progress(0, total=n_a * 2 + n_b * 2)
    built: list[FairShare] = []

    def vtc() -> Policy:
        built.append(FairShare(make_policy(inner), input_weight=w_in, output_weight=w_out))
        return built[-1]

    rows = [
        _row(f"{inner}:tenants=a", tenant_a, lambda: make_policy(inner), cluster, progress),
        _row(f"{inner}:tenants=a+b", both, lambda: make_policy(inner), cluster, progress),
        _row(f"{inner}:tenants=a+b:vtc", both, vtc, cluster, progress),
    ]
    (policy,) = built
    bound = 2 * max(w_in * r.prompt_tokens + w_out * r.target_output_tokens for r in both)
    rows[2]["max_service_gap"] = policy.max_service_gap
    rows[2]["vtc_bound"] = bound
    alone = rows[0]
    checks = [_check(row, alone, factor, points) for row in rows[1:]]
    verdict = "PASS" if policy.max_service_gap <= bound else "FAIL"
    checks.append(f"{rows[2]['policy']} largest service gap of a and b both backlogged "
                  f"{policy.max_service_gap:.0f} vs VTC's bound 2U {bound:.0f}: {verdict}")  # fmt: skip
    cfg = {**config.as_dict(), "requests": n_a, "flood": flood, "ttft_slo": slo, "policy": inner,
           "input_weight": w_in, "output_weight": w_out, "capacity_rps": capacity, "rate_a_rps": rate_a,
           "cluster": {"instances": cluster.instances, "max_batch": cluster.engine.max_batch,
                       "profile": next(iter(cluster.profiles.values())).name}}  # fmt: skip
    return BenchReport("fair-share", cfg, rows, checks)


def _tenant(rows: list[Request], tenant: str, arrivals: np.ndarray, cls: ServiceClass) -> list[Request]:
    """The trace's lengths as ``tenant``'s requests at ``arrivals``, all of class ``cls``."""
    return [
        Request(
            f"{tenant}{i}",
            float(t),
            r.prompt_tokens,
            r.max_tokens,
            r.model,
            cls,
            r.true_output_tokens,
            tenant=tenant,
        )
        for i, (r, t) in enumerate(zip(rows, arrivals, strict=True))
    ]


def _row(
    name: str, requests: list[Request], factory: Any, cluster: Any, progress: Progress
) -> dict[str, Any]:
    """Tenant a's metrics (the contract's keys) and b's TTFT, SLO and output rate, under one policy."""
    done, metrics = run_one(requests, factory, cluster, progress=progress)
    mine = [r for r in done if r.tenant == "a"]
    span = max(r.finished_at or 0.0 for r in done) - min(r.arrival for r in done)
    row: dict[str, Any] = {"policy": name, **summarize(mine, makespan_s=span)}
    row["wall_s"] = metrics["wall_s"]
    others = [r for r in done if r.tenant == "b"]
    if others:
        b = summarize(others, makespan_s=span, qoe=False)
        row.update(b_p99_ttft_s=b["p99_ttft_s"], b_slo_attainment=b.get("slo_attainment"),
                   b_output_tokens_per_s=b["output_tokens_per_s"], b_requests=len(others))  # fmt: skip
    return row


def _check(row: dict[str, Any], alone: dict[str, Any], factor: float, points: float) -> str:
    """a's TTFT p99 and SLO attainment in ``row`` against a alone."""
    ttft, base = row["p99_ttft_s"], alone["p99_ttft_s"]
    slo, base_slo = row["slo_attainment"], alone["slo_attainment"]
    ok = ttft <= factor * base and slo >= base_slo - points / 100
    return (f"{row['policy']}: a's TTFT p99 {ttft:.3f}s vs alone {base:.3f}s ({ttft / base:.2f}x, target <= "
            f"{factor:g}x); SLO attainment {slo:.1%} vs alone {base_slo:.1%} (target within {points:g} "
            f"points): {'PASS' if ok else 'FAIL'}")  # fmt: skip


__all__ = ["DESCRIPTION", "run"]
