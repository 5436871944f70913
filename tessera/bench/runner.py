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
from pathlib import Path
from typing import Any

import numpy as np

from tessera.api.traces import load_trace
from tessera.bench.scenarios import BenchConfig, Progress
from tessera.core.policy import Policy
from tessera.core.profiles import DEFAULT_PROFILE, load_profile
from tessera.core.request import Request
from tessera.core.slo import jct, mean_itl, slo_met, summarize, ttft
from tessera.sim.cluster import Cluster, ClusterConfig, ClusterController, ClusterRouter
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import copy_requests, requests_from_trace

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


def trace_requests(
    config: BenchConfig, default_trace: Path, limit: int | None, rate: float | None = None
) -> list[Request]:
    """Requests replaying ``--trace`` (or ``default_trace``), first ``limit`` rows, at ``rate`` if given."""
    rows = load_trace(config.trace or default_trace)
    rng = np.random.default_rng(config.seed)
    return requests_from_trace(rows, rng, rate=rate, limit=limit)


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

    ``progress`` advances by one per finished request of every policy; the caller may set its total
    to ``len(requests) * len(policies)`` (done here when it is called with ``total=``).
    """
    progress(0, total=len(requests) * len(policies))
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
