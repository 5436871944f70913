"""The Prometheus queries over the workers' ``tessera_*`` metrics, and their results parsed.

Scrape contract: every worker target carries the labels ``namespace``, ``pod``, ``pool`` and ``group``
(the manifests' scrape config relabels them from the pod's namespace, name and its ``tessera.dev/pool``
and ``tessera.dev/group`` labels). The worker exports ``tessera_inflight`` and ``tessera_queue_length``
gauges, ``tessera_slo_met`` / ``tessera_slo_missed`` counters and ``tessera_ttft_seconds`` /
``tessera_itl_seconds`` histograms, labelled ``model`` and ``class`` (``tessera.worker.metrics``).

Pure: the operator's ``PrometheusMetrics`` (``tessera.operator.prometheus``) sends the queries; local
mode reads the same series from direct scrapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tessera.core.planners import ROLES, BatchGroup, GroupPlan, MetricsSnapshot, RoleCounts

Query = Callable[[str], list[dict[str, Any]]]
DEFAULT_WINDOW = "2m"


def selector(**labels: str) -> str:
    """A PromQL label selector; values are quoted and escaped."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def class_regex(names: Sequence[str]) -> str:
    """A PromQL regex matching exactly the given class names (no name matches nothing)."""
    return "|".join(re.escape(n) for n in sorted(names)) if names else "$^"


def role_of(ordinal: int, roles: RoleCounts) -> str | None:
    """The Chiron role of a group's pod by StatefulSet ordinal: interactive, then mixed, then batch."""
    bound = 0
    for role in ROLES:
        bound += roles.get(role)
        if ordinal < bound:
            return role
    return None


def _ordinal(pod: str) -> int | None:
    tail = pod.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _value(sample: Mapping[str, Any]) -> float:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return math.nan
    return value


def _total(result: list[dict[str, Any]]) -> float:
    values = [v for v in (_value(s) for s in result) if not math.isnan(v)]
    return sum(values)


def group_queries(
    namespace: str, pool: str, group: str, kinds: Mapping[str, str], window: str
) -> dict[str, str]:
    """The PromQL queries of one group's snapshot, by purpose."""
    sel = selector(namespace=namespace, pool=pool, group=group)
    interactive = class_regex([c for c, k in kinds.items() if k == "interactive"])
    batch = class_regex([c for c, k in kinds.items() if k == "batch"])
    return {
        "up": f"up{{{sel}}}",
        "interactive_inflight": f'sum by (pod) (tessera_inflight{{{sel},class=~"{interactive}"}})',
        "interactive_queued": f'sum(tessera_queue_length{{{sel},class=~"{interactive}"}})',
        "batch_queued": f'sum by (class) (tessera_queue_length{{{sel},class=~"{batch}"}})',
        "batch_running": f'sum(tessera_inflight{{{sel},class=~"{batch}"}})',
        # One ITL sample per output token after the first: its rate is the decode token rate.
        "batch_tokens": f'sum(rate(tessera_itl_seconds_count{{{sel},class=~"{batch}"}}[{window}]))',
    }


def snapshot_from_results(
    results: Mapping[str, list[dict[str, Any]]],
    group: GroupPlan,
    deadlines: Mapping[str, float],
    now: float,
) -> MetricsSnapshot | None:
    """A group's MetricsSnapshot from the query results of ``group_queries``.

    Pods count as ready when their scrape is up; the rest of the group's planned pods are pending.
    Batch groups: the worker exports queue lengths, not arrival times, so each batch class is one
    request group whose deadline is ``now`` plus the class deadline (optimistic for requests that
    already waited). Returns None when no worker of the group was scraped yet.
    """
    up = results.get("up") or []
    if not up:
        return None
    ready = {r: 0 for r in ROLES}
    for sample in up:
        ordinal = _ordinal(sample.get("metric", {}).get("pod", ""))
        role = role_of(ordinal, group.replicas) if ordinal is not None else None
        if role is not None and _value(sample) == 1:
            ready[role] += 1
    ready_counts = RoleCounts(**ready)
    pending = RoleCounts(**{r: max(0, group.replicas.get(r) - ready[r]) for r in ROLES})
    busy = sum(1 for s in results.get("interactive_inflight") or [] if _value(s) > 0)
    batch_queue = tuple(
        BatchGroup(count=int(_value(s)), deadline=now + deadlines[s["metric"]["class"]])
        for s in results.get("batch_queued") or []
        if _value(s) > 0 and s.get("metric", {}).get("class") in deadlines
    )
    tokens = _total(results.get("batch_tokens") or [])
    return MetricsSnapshot(
        ready=ready_counts,
        pending=pending,
        instances_with_interactive=busy,
        interactive_queued=int(_total(results.get("interactive_queued") or [])),
        batch_queue=batch_queue,
        batch_running=int(_total(results.get("batch_running") or [])),
        batch_tokens_per_s=tokens if tokens > 0 else None,
        batch_instance_tokens_per_s=tokens / ready_counts.batch
        if tokens > 0 and ready_counts.batch
        else None,
    )


def attainment_queries(namespace: str, pool: str, model: str, window: str) -> dict[str, str]:
    """The PromQL queries of one served model's SLO attainment per class."""
    sel = selector(namespace=namespace, pool=pool, model=model)
    return {
        "met": f"sum by (class) (increase(tessera_slo_met_total{{{sel}}}[{window}]))",
        "missed": f"sum by (class) (increase(tessera_slo_missed_total{{{sel}}}[{window}]))",
        "p99_ttft": (
            "histogram_quantile(0.99, sum by (class, le) "
            f"(rate(tessera_ttft_seconds_bucket{{{sel}}}[{window}])))"
        ),
        "itl_sum": f"sum by (class) (rate(tessera_itl_seconds_sum{{{sel}}}[{window}]))",
        "itl_count": f"sum by (class) (rate(tessera_itl_seconds_count{{{sel}}}[{window}]))",
    }


def attainment_from_results(results: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """ClassAttainment JSON (LLMService status) per class with finished requests in the window."""

    def by_class(key: str) -> dict[str, float]:
        out = {}
        for sample in results.get(key) or []:
            value = _value(sample)
            name = sample.get("metric", {}).get("class")
            if name and not math.isnan(value):
                out[name] = value
        return out

    met, missed = by_class("met"), by_class("missed")
    p99, itl_sum, itl_count = by_class("p99_ttft"), by_class("itl_sum"), by_class("itl_count")
    rows = []
    for name in sorted(set(met) | set(missed)):
        finished = met.get(name, 0.0) + missed.get(name, 0.0)
        if finished <= 0:
            continue
        row: dict[str, Any] = {
            "name": name,
            "attainment": min(1.0, max(0.0, met.get(name, 0.0) / finished)),
            "requests": round(finished),
        }
        if name in p99 and math.isfinite(p99[name]):
            row["p99TtftSeconds"] = p99[name]
        if itl_count.get(name):
            row["meanItlSeconds"] = itl_sum.get(name, 0.0) / itl_count[name]
        rows.append(row)
    return rows
