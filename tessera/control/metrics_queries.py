"""The Prometheus queries over the workers' ``tessera_*`` metrics, and their results parsed.

Scrape contract: every worker target carries the labels ``namespace``, ``pod``, ``pool`` and ``group``
(the manifests' scrape config relabels them from the pod's namespace, name and its ``tessera.dev/pool``
and ``tessera.dev/group`` labels). The worker exports ``tessera_inflight`` and ``tessera_queue_length``
gauges, ``tessera_slo_met`` / ``tessera_slo_missed`` counters and ``tessera_ttft_seconds`` /
``tessera_itl_seconds`` histograms, labelled ``model`` and ``class`` (``tessera.worker.metrics``).

Placement reads each model's load over the last re-placement interval from the same worker series
(``load_queries``): the counters sampled at a fixed step by a subquery, their increases per step
computed here (a counter that drops was reset: it counts from zero; a series that appears later is a
new pod or class: it counts from zero too), and the queue and in-flight gauges at each step, so that
arrivals count the requests still held as well as those that ended. The router's ``tessera_router_*``
series are not used there: they carry no pool label, and a model name is only unique within a pool. The
one the autoscaler reads is what the router's Chiron dispatch holds (``tessera_router_chiron_held_requests``,
by model and class): the router itself serves a model name as one model over every pool it routes to. So
are the batch component's gauges of the lines it has not sent yet (``tessera.api.batch_link``), by model
and class, with their earliest expiry and the output lengths of their jobs' answered lines. Prompt
lengths come from the workers' ``tessera_prompt_tokens`` counter (prompt tokens of finished requests).

Pure: the operator's ``PrometheusMetrics`` (``tessera.operator.prometheus``) sends the queries; local
mode reads the same series from direct scrapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.api.batch_link import DEADLINE_METRIC, OUTPUT_MEAN_METRIC, OUTPUT_STD_METRIC, PENDING_METRIC
from tessera.core.planners import ROLES, BatchGroup, GroupPlan, MetricsSnapshot, Role, RoleCounts

Query = Callable[[str], list[dict[str, Any]]]
DEFAULT_WINDOW = "2m"


def selector(**labels: str) -> str:
    """A PromQL label selector; values are quoted and escaped."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def class_regex(names: Sequence[str]) -> str:
    """A PromQL regex matching exactly the given names (no name matches nothing), escaped for a
    double-quoted PromQL string: Python's ``re.escape`` writes ``\\-`` and ``\\.``, escape sequences that
    PromQL's strings refuse (a class or model name with a hyphen or a dot failed every query)."""
    return _escape("|".join(re.escape(n) for n in sorted(names))) if names else "$^"


def pod_ordinal(pod: str) -> int | None:
    """A StatefulSet pod's ordinal, from its name (``<statefulset>-<ordinal>``); None for another name."""
    tail = pod.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def role_of(ordinal: int | None, roles: Sequence[Role]) -> Role | None:
    """The Chiron role of a group's pod by StatefulSet ordinal (``GroupPlan.roles``); None past the
    group's pods or without an ordinal."""
    return roles[ordinal] if ordinal is not None and 0 <= ordinal < len(roles) else None


def _pod_role(sample: Mapping[str, Any], roles: Sequence[Role]) -> Role | None:
    return role_of(pod_ordinal(sample.get("metric", {}).get("pod", "")), roles)


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
    namespace: str,
    pool: str,
    group: str,
    kinds: Mapping[str, str],
    window: str,
    models: Sequence[str] = (),
) -> dict[str, str]:
    """The PromQL queries of one group's snapshot, by purpose. ``models``: the models the group serves,
    whose requests the router's Chiron dispatch holds (labelled by model: the router serves each
    model name once, whichever namespace its pool is in)."""
    sel = selector(namespace=namespace, pool=pool, group=group)
    interactive = class_regex([c for c, k in kinds.items() if k == "interactive"])
    batch = class_regex([c for c, k in kinds.items() if k == "batch"])
    jobs = f'model=~"{class_regex(models)}",class=~"{batch}"'
    return {
        "batch_pending": f"sum by (class) ({PENDING_METRIC}{{{jobs}}})",
        # Seconds left, so that the snapshot puts the deadline on the autoscaler's own clock.
        "batch_pending_left": f"min by (class) ({DEADLINE_METRIC}{{{jobs}}}) - time()",
        # The longest mean of the group's models and classes: the estimate errs towards launching early.
        "batch_output_mean": f"max({OUTPUT_MEAN_METRIC}{{{jobs}}})",
        "batch_output_std": f"max({OUTPUT_STD_METRIC}{{{jobs}}})",
        "held": (
            f'sum by (class) (tessera_router_chiron_held_requests{{model=~"{class_regex(models)}",'
            f'class=~"{class_regex(list(kinds))}"}})'
        ),
        "up": f"up{{{sel}}}",
        "interactive_inflight": f'sum by (pod) (tessera_inflight{{{sel},class=~"{interactive}"}})',
        "interactive_queued": f'sum(tessera_queue_length{{{sel},class=~"{interactive}"}})',
        "batch_queued": f'sum by (class) (tessera_queue_length{{{sel},class=~"{batch}"}})',
        "batch_running": f'sum(tessera_inflight{{{sel},class=~"{batch}"}})',
        # One ITL sample per output token after the first: its rate is the decode token rate.
        "batch_tokens": f'sum(rate(tessera_itl_seconds_count{{{sel},class=~"{batch}"}}[{window}]))',
        # One TTFT sample per started request: the interactive arrival rate that load forecasting reads.
        "interactive_rate": (
            f'sum(rate(tessera_ttft_seconds_count{{{sel},class=~"{interactive}"}}[{window}]))'
        ),
    }


def snapshot_from_results(
    results: Mapping[str, list[dict[str, Any]]],
    group: GroupPlan,
    deadlines: Mapping[str, float],
    now: float,
) -> MetricsSnapshot | None:
    """A group's MetricsSnapshot from the query results of ``group_queries``.

    Pods count as ready when their scrape is up; the rest of the group's planned pods are pending. A
    pod's role is its ordinal's in ``GroupPlan.roles``.
    Batch groups: the workers export queue lengths and the router the requests its Chiron dispatch keeps
    back, not arrival times, so each batch class is one request group (both counts together) whose
    deadline is ``now`` plus the class deadline (optimistic for requests that already waited). The
    lines the batch component has not sent yet are one more group per class, due at their earliest
    expiry (``batch_pending_left`` seconds from ``now``), and their jobs' answered lines give the mean
    and spread of the output length. Returns None when no worker of the group was scraped yet.
    """
    up = results.get("up") or []
    if not up:
        return None
    ready = {r: 0 for r in ROLES}
    for sample in up:
        role = _pod_role(sample, group.roles)
        if role is not None and _value(sample) == 1:
            ready[role] += 1
    ready_counts = RoleCounts(**ready)
    pending = RoleCounts(**{r: max(0, group.replicas.get(r) - ready[r]) for r in ROLES})
    # Busy: interactive or mixed pods with interactive work (IBP's numerator over their count); a batch
    # pod's interactive requests (routed there while no other role existed, or from before a re-role) are
    # not interactive capacity in use.
    inflight = results.get("interactive_inflight") or []
    busy = sum(1 for s in inflight if _value(s) > 0 and _pod_role(s, group.roles) not in ("batch", None))
    queued: dict[str, float] = {}
    held_interactive = 0.0
    for s in (results.get("batch_queued") or []) + (results.get("held") or []):
        name = s.get("metric", {}).get("class")
        if name in deadlines and _value(s) > 0:
            queued[name] = queued.get(name, 0.0) + _value(s)
        elif name not in deadlines and _value(s) > 0:  # a held interactive request (the query's classes)
            held_interactive += _value(s)
    batch_queue = tuple(
        BatchGroup(count=int(n), deadline=now + deadlines[name]) for name, n in sorted(queued.items())
    )
    left = _by_class(results.get("batch_pending_left") or [])
    unsent = _by_class(results.get("batch_pending") or [])
    batch_queue += tuple(
        BatchGroup(count=int(n), deadline=now + left[name])
        for name, n in sorted(unsent.items())
        if n >= 1 and name in deadlines and name in left
    )
    output_mean = _total(results.get("batch_output_mean") or [])
    output_std = _total(results.get("batch_output_std") or [])
    tokens = _total(results.get("batch_tokens") or [])
    rate = results.get("interactive_rate")
    return MetricsSnapshot(
        ready=ready_counts,
        pending=pending,
        instances_with_interactive=busy,
        interactive_queued=int(_total(results.get("interactive_queued") or []) + held_interactive),
        batch_queue=batch_queue,
        batch_running=int(_total(results.get("batch_running") or [])),
        batch_tokens_per_s=tokens if tokens > 0 else None,
        batch_instance_tokens_per_s=tokens / ready_counts.batch
        if tokens > 0 and ready_counts.batch
        else None,
        interactive_arrival_rps=_total(rate) if rate else None,
        mean_output_tokens=output_mean if results.get("batch_output_mean") else None,
        std_output_tokens=output_std if results.get("batch_output_std") else None,
    )


def _by_class(result: list[dict[str, Any]]) -> dict[str, float]:
    """A ``by (class)`` result as class -> value (samples without a class or a number left out)."""
    out: dict[str, float] = {}
    for sample in result:
        name, value = sample.get("metric", {}).get("class"), _value(sample)
        if name and not math.isnan(value):
            out[name] = value
    return out


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
        return _by_class(results.get(key) or [])

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


# Counters whose increases make up a model's load: every request a worker accepts ends in exactly one
# of the first three (finished, refused, failed), so together they count arrivals.
LOAD_COUNTERS = {
    "finished": "tessera_e2e_seconds_count",
    "rejected": "tessera_rejected_total",
    "failed": "tessera_failed_total",
    # One ITL sample per output token after the first (see group_queries).
    "later_tokens": "tessera_itl_seconds_count",
    "e2e_seconds": "tessera_e2e_seconds_sum",
    "prompt_tokens": "tessera_prompt_tokens_total",
    "slo_met": "tessera_slo_met_total",
    "slo_missed": "tessera_slo_missed_total",
}
# Gauges of the requests a model holds (waiting in the worker's queue, running in the engine): with the
# counters of requests that ended they give arrivals, so an overloaded model's demand is counted, not
# only its throughput (see loads_from_results).
LOAD_GAUGES = {"queued": "tessera_queue_length", "running": "tessera_inflight"}
MAX_BIN_S = 60.0  # SeaLLM's estimator bins history per minute (tessera.control.placement.BIN_S)
BINS_PER_WINDOW = 5  # short windows get shorter bins, so a 10 s interval still has a rate history


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """What a pool's workers measured of one model over a window, per step of the subqueries.

    ``arrivals`` and ``finished`` are per step (oldest first); ``span_s`` is how long the model's
    workers were seen in the window (a new service is measured over its own life); ``outstanding`` the
    requests its workers held (queued or running) at the window's end."""

    model: str
    step_s: float
    span_s: float
    arrivals: tuple[float, ...]
    finished: tuple[float, ...]
    output_tokens: tuple[float, ...]
    prompt_tokens: tuple[float, ...]  # of the requests that finished in each step
    e2e_seconds: float
    slo_met: float
    slo_missed: float
    outstanding: float = 0.0

    @property
    def requests(self) -> float:
        """Requests that arrived in the window."""
        return sum(self.arrivals)

    @property
    def finished_total(self) -> float:
        """Requests that finished in the window."""
        return sum(self.finished)

    @property
    def rate(self) -> float:
        """Arrivals per second over the span the model was seen."""
        return self.requests / self.span_s

    @property
    def mean_output_tokens(self) -> float | None:
        """Mean output tokens of the finished requests; None when none finished."""
        done = self.finished_total
        return sum(self.output_tokens) / done if done > 0 else None

    @property
    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt tokens of the finished requests; None when none finished or the workers count no
        prompt tokens (an image older than the counter)."""
        done, tokens = self.finished_total, sum(self.prompt_tokens)
        return tokens / done if done > 0 and tokens > 0 else None


def load_step_s(window_s: float) -> float:
    """The subqueries' step for a window: a fifth of it, at most a minute, at least a second."""
    return float(max(1, min(MAX_BIN_S, math.floor(window_s / BINS_PER_WINDOW))))


def load_queries(namespace: str, pool: str, window_s: float, at: float | None = None) -> dict[str, str]:
    """The PromQL subqueries of every model's load in a pool over the last ``window_s`` seconds: each
    counter sampled every step, one step before the window included (the baseline of the first step).

    ``at`` (Unix seconds) evaluates every subquery at that instant (the ``@`` modifier). Without it each
    is evaluated when Prometheus receives it, and one sent after a step boundary that an earlier one did
    not cross samples a grid shifted by a step: ``loads_from_results`` then finds its series missing at
    the first point of the union grid, takes them for series new in the window, and counts their whole
    value as the first step's increase."""
    sel = selector(namespace=namespace, pool=pool)
    step = load_step_s(window_s)
    span = f"[{int(math.ceil(window_s / step) * step + step)}s:{int(step)}s]"
    if at is not None:
        span += f" @ {at:.3f}"
    queries = {key: f"{name}{{{sel}}}{span}" for key, name in (LOAD_COUNTERS | LOAD_GAUGES).items()}
    # Present from a worker's start (unlike the counters, created on first use): which models were up.
    queries["up"] = f"tessera_batch_size{{{sel}}}{span}"
    return queries


def _points(sample: Mapping[str, Any]) -> list[tuple[float, float]]:
    out = []
    for point in sample.get("values") or []:
        try:
            out.append((float(point[0]), float(point[1])))
        except (IndexError, TypeError, ValueError):
            continue
    return sorted(p for p in out if not math.isnan(p[1]))


def _increases(samples: Sequence[Mapping[str, Any]], grid: Sequence[float]) -> dict[str, list[float]]:
    """Per model, the counters' increase at each grid point after the first (reset-aware)."""
    index = {t: i for i, t in enumerate(grid)}
    out: dict[str, list[float]] = {}
    for sample in samples:
        model = (sample.get("metric") or {}).get("model")
        points = _points(sample)
        if not model or not points:
            continue
        row = out.setdefault(model, [0.0] * max(0, len(grid) - 1))
        previous: float | None = None if points[0][0] > grid[0] else points[0][1]
        for t, value in points:
            i = index.get(t)
            if i is None or i == 0:
                continue
            if previous is None or value < previous:  # a new series or a reset counts from zero
                row[i - 1] += value
            else:
                row[i - 1] += value - previous
            previous = value
    return out


def _levels(samples: Sequence[Mapping[str, Any]], grid: Sequence[float]) -> dict[str, list[float]]:
    """Per model, the gauges' sum at each grid point (a series absent at a point adds nothing there)."""
    index = {t: i for i, t in enumerate(grid)}
    out: dict[str, list[float]] = {}
    for sample in samples:
        model = (sample.get("metric") or {}).get("model")
        if not model:
            continue
        row = out.setdefault(model, [0.0] * len(grid))
        for t, value in _points(sample):
            i = index.get(t)
            if i is not None:
                row[i] += value
    return out


def demand(ended: Sequence[float], held: Sequence[float]) -> list[float]:
    """Arrivals per step: the requests that ended in the step plus the growth of those held (queued or
    running) over it, ``held`` having one point more than ``ended`` (the first step's baseline).

    Counting only ended requests measures throughput, which caps an overloaded model's rate at what its
    instances served, so placement would see no reason to give it more. A step whose gauges lag its
    counters can come out negative; the deficit is carried into the next steps, which keeps the total
    exact (unless it is negative) and every step non-negative; a deficit left at the end comes off the
    latest steps."""
    out, carry = [], 0.0
    for i, done in enumerate(ended):
        value = done + held[i + 1] - held[i] + carry
        carry = min(0.0, value)
        out.append(max(0.0, value))
    for i in reversed(range(len(out))):
        take = min(out[i], -carry)
        out[i] -= take
        carry += take
    return out


def loads_from_results(results: Mapping[str, list[dict[str, Any]]]) -> dict[str, ModelLoad]:
    """Every model's ModelLoad from the results of ``load_queries``; models whose workers were seen at
    fewer than two steps are left out (not measured yet). Arrivals are the requests that ended
    (finished, refused, failed) plus the growth of those held (``demand``)."""
    grid = sorted({t for samples in results.values() for s in samples for t, _ in _points(s)})
    if len(grid) < 2:
        return {}
    step = grid[1] - grid[0]
    seen: dict[str, set[float]] = {}
    for sample in results.get("up") or []:
        model = (sample.get("metric") or {}).get("model")
        if model:
            seen.setdefault(model, set()).update(t for t, _ in _points(sample))
    counters = {key: _increases(results.get(key) or [], grid) for key in LOAD_COUNTERS}
    gauges = {key: _levels(results.get(key) or [], grid) for key in LOAD_GAUGES}
    empty = [0.0] * (len(grid) - 1)
    loads = {}
    for model, times in sorted(seen.items()):
        if len(times) < 2:
            continue

        def row(key: str, model: str = model) -> list[float]:
            return counters[key].get(model, empty)

        ended = [sum(v) for v in zip(row("finished"), row("rejected"), row("failed"), strict=True)]
        zero = [0.0] * len(grid)
        held = [sum(v) for v in zip(*(gauges[key].get(model, zero) for key in LOAD_GAUGES), strict=True)]
        arrivals = demand(ended, held)
        finished = row("finished")
        loads[model] = ModelLoad(
            model=model,
            step_s=step,
            # The steps counted: each whose end point saw the model. A model first seen after the window's
            # start has its series' whole value counted in the step that ends there, so that step counts
            # too (max - min of the points left it out, and a new model's rate read a step short).
            span_s=step * sum(1 for t in grid[1:] if t in times),
            arrivals=tuple(arrivals),
            finished=tuple(finished),
            output_tokens=tuple(f + t for f, t in zip(finished, row("later_tokens"), strict=True)),
            prompt_tokens=tuple(row("prompt_tokens")),
            e2e_seconds=sum(row("e2e_seconds")),
            slo_met=sum(row("slo_met")),
            slo_missed=sum(row("slo_missed")),
            outstanding=held[-1],
        )
    return loads


def batch_size_query(namespace: str, pool: str) -> str:
    """The PromQL query of each group's batch size: the mean over its pods and models."""
    return f"avg by (group) (tessera_batch_size{{{selector(namespace=namespace, pool=pool)}}})"


def batch_sizes_from_result(result: list[dict[str, Any]]) -> dict[str, int]:
    """Group name -> its mean batch size rounded (at least 1), from ``batch_size_query``'s result."""
    out = {}
    for sample in result:
        group = (sample.get("metric") or {}).get("group")
        value = _value(sample)
        if group and math.isfinite(value):
            out[group] = max(1, round(value))
    return out


# Counters of requests that ended at a worker (finished, refused at admission, failed): any change over a
# group's idle time means it was not idle.
ENDED_COUNTERS = ("tessera_e2e_seconds_count", "tessera_rejected_total", "tessera_failed_total")


def idle_queries(namespace: str, pool: str, group: str, window_s: float) -> dict[str, str]:
    """The PromQL queries of whether a group's workers were idle over the last ``window_s`` seconds
    (``idle_from_results``).

    Each ended-request counter is read two ways: its ``increase`` (which misses a series' first value),
    and its sum now against its sum ``window_s`` ago (which sees a series created in the window: a first
    request ever; a pod restart reads as a change too, on the safe side). The queue and in-flight gauges'
    highest value in the window catches a request that arrived and is still held. The batch-size gauge,
    present from a worker's start, says the workers were scraped now and at the window's start."""
    sel = "{" + selector(namespace=namespace, pool=pool, group=group) + "}"
    w = f"{max(1, math.ceil(window_s))}s"
    queries: dict[str, str] = {}
    for name in ENDED_COUNTERS:
        queries[f"increase:{name}"] = f"sum(increase({name}{sel}[{w}]))"
        queries[f"change:{name}"] = (
            f"(sum({name}{sel}) or vector(0)) - (sum({name}{sel} offset {w}) or vector(0))"
        )
    for key, name in LOAD_GAUGES.items():
        queries[f"held:{key}"] = f"sum(max_over_time({name}{sel}[{w}]))"
    queries["up:now"] = f"count(tessera_batch_size{sel})"
    queries["up:before"] = f"count(tessera_batch_size{sel} offset {w})"
    return queries


def idle_from_results(results: Mapping[str, list[dict[str, Any]]]) -> bool | None:
    """Whether the group was idle (``idle_queries``): no request ended or was held in the window. None
    (unknown) when its workers were not scraped both now and at the window's start."""
    if _total(results.get("up:now", [])) <= 0 or _total(results.get("up:before", [])) <= 0:
        return None
    activity = [_total(r) for key, r in results.items() if not key.startswith("up:")]
    return all(v == 0 for v in activity)
