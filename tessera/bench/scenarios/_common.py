"""Helpers shared by the scenarios of this package (loads, capacity, seed means, plots)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tessera.bench.runner import run_one
from tessera.core.registry import make_policy
from tessera.core.request import Request
from tessera.core.slo import summarize
from tessera.sim.cluster import ClusterConfig
from tessera.sim.workloads import copy_requests

T = TypeVar("T")


def parse_loads(text: str | float | None, default: Sequence[float]) -> list[float]:
    """Loads from ``--load X`` or ``--set loads=0.5,0.8``; each must be > 0."""
    if text is None:
        return list(default)
    parts = [text] if isinstance(text, int | float) else str(text).split(",")
    try:
        loads = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"loads must be numbers separated by commas, got {text!r}") from exc
    if not loads or any(x <= 0 for x in loads):
        raise ValueError(f"loads must be > 0, got {text!r}")
    return loads


def saturation_rate(requests: Sequence[Request], cluster: ClusterConfig) -> float:
    """Measured capacity (requests/s): FCFS with every request arriving at once, n / makespan."""
    burst = copy_requests(requests)
    for r in burst:
        r.arrival = 0.0
    _, metrics = run_one(burst, lambda: make_policy("fcfs"), cluster)
    return float(metrics["throughput_rps"])


def slo_capacity(
    make: Callable[[float], list[Request]],
    cluster: ClusterConfig,
    attainment: float,
    limit: float,
    steps: int = 14,
) -> float:
    """The largest rate (requests/s) up to ``limit`` at which FCFS meets the SLO of at least
    ``attainment`` of the requests ``make(rate)`` builds at that rate, by bisection. ``limit`` is the
    saturated throughput (``saturation_rate``): past it the queue grows without end, whatever a run
    too short to show it measures. ``make`` should scale one arrival pattern (same seed), so that
    attainment falls as the rate grows."""
    if not 0 < attainment <= 1 or not limit > 0:
        raise ValueError(f"an SLO capacity needs 0 < attainment <= 1 and limit > 0; got {attainment}, "
                         f"{limit}")  # fmt: skip

    def meets(rate: float) -> bool:
        done, _ = run_one(make(rate), lambda: make_policy("fcfs"), cluster)
        met = summarize(done, qoe=False).get("slo_attainment")
        if met is None:
            raise ValueError("an SLO capacity needs requests whose class sets an SLO")
        return bool(met >= attainment)

    if meets(limit):
        return limit
    lo, hi = 0.0, limit
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    if lo == 0.0:
        raise ValueError(f"FCFS misses {attainment:.1%} of the SLO at every rate down to {hi:.3g} req/s")
    return lo


def rate_points(rate: float | None, loads: Sequence[float], capacity: float) -> tuple[list[float], list[str]]:
    """The rates (requests/s) a load sweep runs and their row labels: ``--rate R`` alone, else each
    load as a fraction of ``capacity``."""
    if rate is not None:
        return [rate], [f"rate={rate:g}"]
    return [x * capacity for x in loads], [f"load={x:g}" for x in loads]


def with_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """Copies with arrivals rescaled to ``rate`` requests/s (shape of the trace kept)."""
    from tessera.sim.workloads import scale_to_rate

    reqs = copy_requests(requests)
    times = scale_to_rate([r.arrival for r in reqs], rate)
    for r, t in zip(reqs, times, strict=True):
        r.arrival = float(t)
    return reqs


def plot_metric_vs_load(results: list[dict[str, Any]], out_dir: Path, metrics: Sequence[str]) -> list[Path]:
    """One PNG per metric: value against load, one line per policy (rows named ``policy:load=X``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in results:
        name, _, variant = row["policy"].partition(":load=")
        if variant and row.get(metrics[0]) is not None:
            series.setdefault(name, [])
    paths = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in series:
            pts = sorted(
                (float(r["policy"].split(":load=")[1]), r[metric])
                for r in results
                if r["policy"].startswith(name + ":load=") and r.get(metric) is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("load (fraction of measured capacity)")
        ax.set_ylabel(metric)
        ax.legend()
        ax.grid(alpha=0.3)
        path = out_dir / f"{metric}_vs_load.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def mean_row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The mean over ``rows`` of every metric that is a number in all of them."""
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    out: dict[str, Any] = {"policy": name, "seeds": len(rows)}
    for key in keys:
        values = [row.get(key) for row in rows]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = float(np.mean(values))
    return out


def seed_checks(
    items: Sequence[T],
    seeds: Sequence[int],
    check: Callable[[T], list[str]],
    per_seed_check: Callable[[T], list[str]] | None = None,
) -> list[str]:
    """The targets on the seed means (the verdict), then per seed for information.

    ``items``: one per seed, the seed means last; ``check`` turns one into check lines,
    ``per_seed_check`` (default ``check``) the lines listed for each seed."""
    *per_seed, means = items
    out = [f"mean of seeds {seeds[0]}..{seeds[-1]}: {line}" for line in check(means)]
    if len(per_seed) > 1:
        out += [
            f"  seed {seed}: {line}"
            for seed, item in zip(seeds, per_seed, strict=True)
            for line in (per_seed_check or check)(item)
        ]
    return out


TOLERANCE = 0.10  # default of --set tolerance: how much worse than the baseline a row may be


def tolerance(options: dict[str, Any]) -> float:
    """``--set tolerance`` (default 0.10): the share by which a row may trail its baseline on
    throughput and exceed it on p99 JCT."""
    from tessera.bench.runner import option

    value = option(options, "tolerance", TOLERANCE, float)
    if not 0 <= value < 1:
        raise ValueError(f"--set tolerance={value}: must be >= 0 and < 1 (0.10 = 10%)")
    return value


def baseline_checks(
    rows: Sequence[dict[str, Any]], baseline: dict[str, Any], tol: float, metric: str = "p99_jct_s"
) -> list[str]:
    """One line per row: throughput no more than ``tol`` below ``baseline``'s and ``metric`` (a tail,
    default p99 JCT) no more than ``tol`` above it, PASS/FAIL. A metric either row lacks is skipped."""
    out = []
    base_name = baseline["policy"]
    for row in rows:
        parts, ok = [], True
        for key, label, worse in (
            ("throughput_rps", "throughput", -1),
            (metric, metric.removesuffix("_s"), 1),
        ):
            mine, theirs = row.get(key), baseline.get(key)
            if not isinstance(mine, int | float) or not isinstance(theirs, int | float) or theirs <= 0:
                continue
            change = mine / theirs - 1
            ok &= worse * change <= tol + 1e-12
            parts.append(f"{label} {change:+.1%}")
        if parts:
            out.append(
                f"{row['policy']} vs {base_name}: {', '.join(parts)} (no worse than {tol:.0%}): "
                + ("PASS" if ok else "FAIL")
            )
    return out


PAPER = "paper baseline"
STRONGEST = "strongest baseline"
PRIORITY_DELAYS = "strict,30,300"  # default of --set priority_delays: the tuned priority queue's sweep


def label_baseline(row: dict[str, Any], label: str) -> None:
    """Add ``label`` (``PAPER``, ``STRONGEST``) to the row's ``baseline`` field (the table prints it
    after the row's name)."""
    row["baseline"] = f"{row['baseline']}, {label}" if row.get("baseline") else label


def strongest(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row of highest SLO attainment (ties: higher goodput, then throughput)."""
    return max(rows, key=lambda r: (r["slo_attainment"], r.get("goodput_rps", 0.0), r["throughput_rps"]))


def priority_delays(options: dict[str, Any]) -> dict[str, float | None]:
    """``--set priority_delays`` (default ``strict,30,300``): the ``batch_delay_s`` values the tuned
    priority queue is chosen from, by variant name (``strict``: interactive always first)."""
    from tessera.bench.runner import option

    text = str(option(options, "priority_delays", PRIORITY_DELAYS, str))
    out: dict[str, float | None] = {}
    for part in (p.strip() for p in text.split(",")):
        if part == "strict":
            out["strict"] = None
            continue
        try:
            delay = float(part)
        except ValueError:
            delay = -1.0
        if delay < 0:
            raise ValueError(
                f"--set priority_delays={text!r}: comma-separated seconds >= 0 (a batch request's "
                "set-back behind interactive ones) or strict (interactive always first)"
            )
        out[f"{delay:g}s"] = delay
    return out


def tuned_priority(
    run: Callable[[str, float | None], dict[str, Any]], delays: dict[str, float | None]
) -> dict[str, Any]:
    """Run the ``priority`` queue at each of ``delays`` (``run(variant, batch_delay_s)`` gives a row)
    and return the row of the best (``strongest``), with the sweep recorded in ``tuned_over``."""
    best = strongest([run(name, delay) for name, delay in delays.items()])
    best["tuned_over"] = list(delays)
    return best
