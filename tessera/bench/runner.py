"""Shared helpers for bench scenarios: run policies side by side on identical requests.

Typical scenario::

    cfg = cluster_config_from(config.options)            # profile, instances, max_batch, ...
    reqs = trace_requests(config, default_trace=AZURE_CONV)
    rows = run_policies(reqs, {"fcfs": lambda: make_policy("fcfs")}, cfg, progress)

Every policy gets fresh copies of the same requests (same arrivals, lengths,
classes), the same cluster configuration and the same seed.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tessera.api.traces import RateSeries, TraceRow, load_trace, read_trace
from tessera.bench.scenarios import BenchConfig, Progress
from tessera.core.policy import Policy
from tessera.core.profiles import DEFAULT_PROFILE, load_profile
from tessera.core.request import Request
from tessera.core.slo import jct, mean_itl, slo_met, summarize, ttft
from tessera.sim.cluster import Cluster, ClusterConfig, ClusterController, ClusterRouter
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import SERIES_DISTRIBUTIONS, copy_requests, requests_from_trace, series_arrivals

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"  # beside the repository
AZURE_CONV = SHARED_DATA / "azure_llm_2023_conv.csv"
AZURE_CODE = SHARED_DATA / "azure_llm_2023_code.csv"

# --set keys understood by cluster_config_from, with their defaults.
CLUSTER_OPTIONS: dict[str, Any] = {
    "profile": DEFAULT_PROFILE,
    "instances": 1,
    "max_batch": 256,
    "chunked_prefill": False,
    "token_budget": None,
    "preempt_mode": "recompute",
    "router": "least-loaded",
}


def require_positive(**values: int) -> None:
    """ValueError naming the first ``--set key=value`` below 1 (counts a bench needs at least one of)."""
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"--set {key}={value}: must be >= 1")


def option(options: dict[str, Any], key: str, default: Any, kind: type | None = None) -> Any:
    """``options[key]`` converted to ``kind`` (the default's type), with a clear error."""
    if key not in options or options[key] is None:
        return default
    value = options[key]
    kind = kind or (type(default) if default is not None else None)
    if kind is None or isinstance(value, kind):
        return value
    try:
        if kind is bool:
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text in ("true", "1", "yes")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--set {key}={value!r}: expected {kind.__name__}") from exc


def cluster_config_from(options: dict[str, Any], **defaults: Any) -> ClusterConfig:
    """A cluster configuration from ``--set`` options (scenario defaults override CLUSTER_OPTIONS)."""
    base = {**CLUSTER_OPTIONS, **defaults}

    def get(key: str, kind: type | None = None) -> Any:
        return option(options, key, base[key], kind)

    profile = load_profile(str(get("profile")))
    budget = get("token_budget", int)
    engine = EngineConfig(
        max_batch=get("max_batch", int),
        chunked_prefill=get("chunked_prefill", bool),
        token_budget=budget,
        preempt_mode=get("preempt_mode", str),
    )
    return ClusterConfig(
        profiles={"default": profile},
        instances=get("instances", int),
        engine=engine,
        router=get("router", str),
    )


@dataclass(frozen=True, slots=True)
class BenchTrace:
    """The rows a scenario replays and where they came from."""

    rows: list[TraceRow]
    label: str  # the file's name without its suffixes ("azure_llm_2023_conv")
    series: bool  # arrivals sampled from a rate series; lengths (and the rest) from the default trace


def trace_label(path: Path) -> str:
    """A trace file's name without its suffixes, for row names."""
    return path.name.split(".")[0]


def bench_trace(config: BenchConfig, default_trace: Path, limit: int | None = None) -> BenchTrace:
    """The one trace loader of the scenarios: ``--trace`` (or ``default_trace``), first ``limit`` rows.

    A trace of requests (any format of ``tessera.api.traces``) gives its rows. A rate series
    (``window_start_s, rate_rps[, cv]``) gives the arrivals: ``default_trace``'s rows keep their
    lengths (and prompt blocks, models, classes) and take arrival times sampled from the series by
    ``--set rate_dist``: ``poisson``, or ``gamma`` with each window's cv (the default when the series
    has a cv column). A lengths file (no arrival times) gives the lengths, in its order: output tokens,
    and input tokens where it has them; the rest comes from ``default_trace``'s rows.
    """
    trace = read_trace(config.trace or default_trace)
    if trace.rows is not None:
        return BenchTrace(trace.rows[:limit] if limit else trace.rows, trace_label(trace.path), False)
    rows = load_trace(default_trace)
    rows = rows[:limit] if limit else rows
    if trace.lengths is not None:
        rows = rows if limit else rows[: len(trace.lengths)]
        if len(trace.lengths) < len(rows):
            raise ValueError(f"--trace {trace.path} has {len(trace.lengths)} lengths; this run needs "
                             f"{len(rows)} (lower --set requests)")  # fmt: skip
        rows = [  # new prompt lengths no longer match the default's prompt blocks: those go
            replace(r, output_tokens=o)
            if i is None
            else replace(r, input_tokens=i, output_tokens=o, hash_ids=None)
            for r, (i, o) in zip(rows, trace.lengths, strict=False)
        ]
        return BenchTrace(rows, trace_label(trace.path), False)
    assert trace.series is not None
    times = _series_times(config, trace.series, len(rows), config.seed)
    rows = [replace(r, arrival=float(t - times[0])) for r, t in zip(rows, times, strict=True)]
    return BenchTrace(rows, trace_label(trace.path), True)


def _series_times(config: BenchConfig, series: RateSeries, n: int, seed: int) -> np.ndarray:
    """``n`` arrivals sampled from ``series`` by ``--set rate_dist`` (default: gamma where the series
    has a cv column, else poisson), from an RNG of their own so that the draws that follow (classes,
    lengths) stay those of the default workload."""
    dist = option(config.options, "rate_dist", "gamma" if series.has_cv else "poisson", str)
    if dist not in SERIES_DISTRIBUTIONS:
        raise ValueError(f"--set rate_dist={dist}: one of {', '.join(SERIES_DISTRIBUTIONS)}")
    return series_arrivals(series, n, np.random.default_rng([seed, 2]), dist)


def trace_arrivals(config: BenchConfig, n: int, seed: int | None = None) -> np.ndarray | None:
    """Arrival times (the first at 0) of ``n`` requests from ``--trace``, for a scenario whose requests
    come from elsewhere: a trace's first ``n`` rows, or ``n`` sampled from a rate series (``rate_dist``,
    seeded by ``seed``, default ``--seed``). None without ``--trace``."""
    if config.trace is None:
        return None
    trace = read_trace(config.trace)
    if trace.lengths is not None:
        raise ValueError(f"--trace {config.trace} has request lengths but no arrival times; this run takes "
                         "its arrivals from --trace: give a trace of requests or a rate series")  # fmt: skip
    if trace.rows is not None:
        if len(trace.rows) < n:
            raise ValueError(f"--trace {config.trace} has {len(trace.rows)} requests; this run needs {n} "
                             "arrivals (lower --set requests)")  # fmt: skip
        times = np.array([r.arrival for r in trace.rows[:n]])
    else:
        assert trace.series is not None
        times = _series_times(config, trace.series, n, config.seed if seed is None else seed)
    return times - times[0]


def trace_requests(
    config: BenchConfig, default_trace: Path, limit: int | None, rate: float | None = None
) -> list[Request]:
    """Requests replaying ``--trace`` (or ``default_trace``; see ``bench_trace``), first ``limit``
    rows, at ``rate`` if given."""
    rows = bench_trace(config, default_trace, limit).rows
    rng = np.random.default_rng(config.seed)
    return requests_from_trace(rows, rng, rate=rate)


def run_one(
    requests: Sequence[Request],
    policy_factory: Callable[[], Policy],
    cluster_config: ClusterConfig,
    *,
    router: ClusterRouter | None = None,
    controller: ClusterController | None = None,
    progress: Progress | None = None,
) -> tuple[list[Request], dict[str, Any]]:
    """Simulate one policy on fresh copies of ``requests``; returns the copies and their metrics."""
    reqs = copy_requests(requests)
    cluster = Cluster(cluster_config, policy_factory, router=router, controller=controller)
    result = cluster.run(reqs, progress)
    metrics = summarize(
        reqs,
        gpu_seconds=result.gpu_seconds,
        makespan_s=result.makespan_s,
        swaps=result.model_swaps,
        wall_s=result.wall_s,
    )
    metrics["kv_swaps"] = result.kv_swaps
    metrics["preemptions"] = result.preemptions
    metrics["events"] = result.events
    metrics["cpu_s"] = result.cpu_s
    metrics["iterations"] = result.iterations
    if cluster_config.adapters:  # LoRA adapters: loads of adapters the engines did not hold
        metrics["adapter_loads"] = result.adapter_loads
        metrics["adapter_loads_per_request"] = result.adapter_loads / len(reqs)
    return reqs, metrics


def run_policies(
    requests: Sequence[Request],
    policies: dict[str, Callable[[], Policy]],
    cluster_config: ClusterConfig,
    progress: Progress,
    *,
    router_factory: Callable[[], ClusterRouter] | None = None,
    controller_factory: Callable[[], ClusterController] | None = None,
    requests_csv: Path | None = None,
) -> list[dict[str, Any]]:
    """One result row per policy (``{"policy": row_name, <metrics>}``), all on the same requests.

    ``progress`` advances by one per finished request of every policy; the caller sets the bar's
    total (``len(requests) * len(policies)`` per call) once for all its calls.
    """
    rows = []
    for name, factory in policies.items():
        reqs, metrics = run_one(
            requests,
            factory,
            cluster_config,
            router=router_factory() if router_factory else None,
            controller=controller_factory() if controller_factory else None,
            progress=progress,
        )
        if requests_csv is not None:
            write_requests_csv(reqs, requests_csv, policy=name)
        rows.append({"policy": name, **metrics})
    return rows


CSV_FIELDS = (
    "id",
    "model",
    "class",
    "instance",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "ttft_s",
    "mean_itl_s",
    "jct_s",
    "finished_at_s",
    "preemptions",
    "swaps",
    "slo_met",
)


def write_requests_csv(requests: Sequence[Request], path: Path | str, policy: str | None = None) -> None:
    """One line per request (and per policy when ``policy`` is given, as the first column)."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        writer = csv.writer(fh)
        if new:
            writer.writerow((("policy",) if policy is not None else ()) + CSV_FIELDS)
        for r in requests:
            met = slo_met(r)
            writer.writerow(
                ((policy,) if policy is not None else ())
                + (
                    r.id,
                    r.model,
                    r.service_class.name,
                    r.instance or "",
                    f"{r.arrival:.6f}",
                    r.prompt_tokens,
                    r.generated,
                    f"{ttft(r):.6f}",
                    "" if (itl := mean_itl(r)) is None else f"{itl:.6f}",
                    f"{jct(r):.6f}",
                    f"{r.finished_at:.6f}",
                    r.preemptions,
                    r.swaps,
                    "" if met is None else int(met),
                )
            )
