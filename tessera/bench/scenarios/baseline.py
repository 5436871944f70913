"""Scenario ``baseline``: vLLM-FCFS, EDF, a tuned priority queue and the oracle bounds SJF / SRTF at
several loads.

Workload: the Azure 2023 conversation trace (or ``--trace``: any trace of requests, a rate series
whose arrivals the Azure requests take, or a lengths file whose lengths they take: see
``tessera.bench.runner.bench_trace``), first ``requests``
rows, arrivals rescaled to ``load`` × the cluster's measured capacity (FCFS on the
same requests all arriving at once). Each request is drawn (seeded) into one of two
classes, as QLM and Chiron define them (docs/papers.md, "Chiron: request classes": interactive
10 s / 200 ms; batch 1 h / 2 s):

- ``interactive``: TTFT SLO ``ttft_slo`` (default 10 s, Chiron's value);
- ``batch`` (share ``batch_share``, default 0.5): completion deadline ``batch_deadline``
  after arrival. CHOICE: 600 s by default instead of Chiron's 1 h, so that a replay of a
  few thousand requests can miss it under overload (the papers' "minutes to hours" range).

EDF then orders by real differences in slack, so it differs from FCFS; every row reports
``slo_attainment_by_class``. ``edf:late=last`` is EDF with ``lateLast``: requests already past
their deadline wait behind those still on time. ``priority`` (interactive ahead of batch) runs at each
of ``priority_delays`` and the best (highest SLO attainment) is kept: the tuned priority queue. Of
fcfs, the two edf rows and that row, the one of highest SLO attainment at each load is labelled
``(strongest baseline)``.

Checks: the oracle bounds never lose to FCFS on mean JCT, EDF's attainment per class, the strongest
simple baseline at each load, and every row against ``fcfs`` at its load on throughput and p99 JCT
(no worse than ``tolerance``).

Options (``--set``): requests (2000), loads ("0.5,0.8,1.0,1.2"), ttft_slo (10.0),
batch_deadline (600.0), batch_share (0.5), tolerance (0.10), priority_delays ("strict,30,300"),
rate_dist (a rate series' arrivals: poisson | gamma), and the cluster options of
``tessera.bench.runner.CLUSTER_OPTIONS`` (max_batch default 32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, cluster_config_from, option, run_policies, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import (
    STRONGEST,
    baseline_checks,
    label_baseline,
    parse_loads,
    plot_metric_vs_load,
    priority_delays,
    rate_points,
    saturation_rate,
    strongest,
    tolerance,
    tuned_priority,
    with_rate,
)
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.workloads import Mix

DESCRIPTION = (
    "FCFS, EDF, a tuned priority queue and the oracle bounds SJF/SRTF on the Azure conversation trace at "
    "several loads"
)
WRITES_REQUESTS_CSV = True  # --requests-csv: one line per request and row
POLICIES = ("fcfs", "edf", "sjf-oracle", "srtf-oracle")
EDF_LATE_LAST = "edf:late=last"  # edf with lateLast: the requests already past their deadline last


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run every baseline at every load on the same requests."""
    opts = config.options
    n = option(opts, "requests", 2000, int)
    loads = parse_loads(config.load if config.load is not None else opts.get("loads"), (0.5, 0.8, 1.0, 1.2))
    classes = class_mix(
        option(opts, "ttft_slo", 10.0, float),
        option(opts, "batch_deadline", 600.0, float),
        option(opts, "batch_share", 0.5, float),
    )
    tol = tolerance(opts)
    cluster = cluster_config_from(opts, max_batch=32)
    base = trace_requests(config, AZURE_CONV, n)
    assign_classes(base, classes, np.random.default_rng(config.seed + 7))
    capacity = saturation_rate(base, cluster)
    rates, labels = rate_points(config.rate, loads, capacity)
    delays = priority_delays(opts)
    progress(0, total=n * (len(POLICIES) + 1 + len(delays)) * len(rates))
    rows = []
    for rate, label in zip(rates, labels, strict=True):
        reqs = with_rate(base, rate)
        policies = {f"{p}:{label}": (lambda p=p: make_policy(p)) for p in POLICIES}
        policies[f"{EDF_LATE_LAST}:{label}"] = lambda: make_policy("edf", late_last=True)
        got = run_policies(reqs, policies, cluster, progress, requests_csv=config.requests_csv)

        def priority(
            variant: str, delay: float | None, reqs: list[Request] = reqs, label: str = label
        ) -> dict[str, Any]:
            name = f"priority:delay={variant}:{label}"
            policy = {name: lambda: make_policy("priority", batch_delay_s=delay)}
            return run_policies(reqs, policy, cluster, progress)[0]

        got.append(tuned_priority(priority, delays))
        rows += got
    checks = []
    for label in labels:
        by = {r["policy"].removesuffix(":" + label): r for r in rows if r["policy"].endswith(":" + label)}
        by["priority"] = next(r for name, r in by.items() if name.startswith("priority:"))
        for bound in ("sjf-oracle", "srtf-oracle"):
            mine, fcfs = by[bound]["mean_jct_s"], by["fcfs"]["mean_jct_s"]
            ok = mine <= fcfs * 1.001
            checks.append(
                f"{bound}:{label} mean JCT {mine:.2f}s vs fcfs {fcfs:.2f}s "
                f"(bound must not be worse): {'PASS' if ok else 'FAIL'}"
            )
        edf, fcfs_cls = (
            by["edf"].get("slo_attainment_by_class", {}),
            by["fcfs"].get("slo_attainment_by_class", {}),
        )
        if "interactive" in edf:
            checks.append(
                f"edf:{label} interactive SLO attainment {edf['interactive']:.1%} vs fcfs "
                f"{fcfs_cls['interactive']:.1%}; batch {edf.get('batch', float('nan')):.1%} vs "
                f"{fcfs_cls.get('batch', float('nan')):.1%}"
            )
        best = strongest([by[p] for p in ("fcfs", "edf", EDF_LATE_LAST, "priority")])
        label_baseline(best, STRONGEST)
        checks.append(
            f"{label}: strongest simple baseline {best['policy']} (SLO attainment "
            f"{best['slo_attainment']:.1%}; fcfs {by['fcfs']['slo_attainment']:.1%})"
        )
        others = (*POLICIES, EDF_LATE_LAST, "priority")
        checks += baseline_checks([by[p] for p in others if p != "fcfs"], by["fcfs"], tol)
    cfg = {**config.as_dict(), "requests": n, "capacity_rps": capacity, "rates": rates, "tolerance": tol}
    cfg["cluster"] = {
        "instances": cluster.instances,
        "max_batch": cluster.engine.max_batch,
        "profile": next(iter(cluster.profiles.values())).name,
    }
    return BenchReport("baseline", cfg, rows, checks)


def class_mix(ttft_slo: float, batch_deadline: float, batch_share: float) -> Mix:
    """The interactive/batch mix of this scenario, validated."""
    if ttft_slo <= 0 or batch_deadline <= 0:
        raise ValueError(f"ttft_slo and batch_deadline must be > 0 seconds, got {ttft_slo}, {batch_deadline}")
    if not 0 <= batch_share <= 1:
        raise ValueError(f"batch_share must be in [0, 1], got {batch_share}")
    interactive = ServiceClass(name="interactive", kind="interactive", ttft_slo_s=ttft_slo)
    batch = ServiceClass(name="batch", kind="batch", deadline_s=batch_deadline)
    return Mix(classes=((interactive, 1.0 - batch_share), (batch, batch_share)))


def assign_classes(requests: list[Request], mix: Mix, rng: np.random.Generator) -> None:
    """Give each request a class drawn from ``mix`` (in place)."""
    classes, _ = mix.draw(len(requests), rng)
    for req, cls in zip(requests, classes, strict=True):
        req.service_class = cls


def plot(report: BenchReport, out_dir: Path) -> list[Path]:
    """Mean JCT, p99 TTFT and SLO attainment against load."""
    return plot_metric_vs_load(report.results, out_dir, ("mean_jct_s", "p99_ttft_s", "slo_attainment"))


__all__ = ["DESCRIPTION", "plot", "run"]
