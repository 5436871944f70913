"""Local mode's measurements: the operator's Prometheus queries, answered from direct scrapes.

Without a Prometheus server, local mode scrapes every worker's ``/metrics`` itself and turns the
samples into the results the operator's queries would return (``tessera.control.metrics_queries.
group_queries``: the same names and shapes), so the operator's own ``snapshot_from_results`` builds the
autoscaler's snapshot and both paths read the workers the same way. The one difference: the batch
token rate and the interactive request rate are taken over the time since the previous scrape, not
Prometheus' 2-minute window. The batch component's backlog gauges (``tessera.api.batch_link``) come
from its own ``/metrics`` (``batch_results``).

Pure: scrape texts, the previous counters and the time come in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tessera.api.batch_link import DEADLINE_METRIC, OUTPUT_MEAN_METRIC, OUTPUT_STD_METRIC, PENDING_METRIC

Results = dict[str, list[dict[str, Any]]]
Counters = dict[str, tuple[float, float, float]]  # pod -> (time, batch ITL, interactive TTFT samples)


def _sample(value: float, now: float, **labels: str) -> dict[str, Any]:
    """One instant-vector element as the Prometheus HTTP API returns it."""
    return {"metric": labels, "value": [now, repr(float(value))]}


def results_from_scrapes(
    scrapes: Mapping[str, str | None], kinds: Mapping[str, str], previous: Counters,
    now: float, held: Mapping[str, int] | None = None,
) -> tuple[Results, Counters]:  # fmt: skip
    """The results of ``group_queries`` for one group's pods (``scrapes``: pod name -> its /metrics
    text, None when the scrape failed), and the counters to pass as ``previous`` next time.

    ``kinds`` maps the group's class names to ``interactive`` / ``batch``; samples of other classes are
    ignored, as the queries' class regexes ignore them. ``held``: the batch requests of the group's
    models that the router's Chiron dispatch keeps back, by class name (read from the router in process).
    """
    up, busy = [], []
    interactive_queued = batch_running = tokens_per_s = requests_per_s = 0.0
    measured = False  # a rate needs a pod scraped before
    batch_queued: dict[str, float] = {}
    counters: Counters = {}
    for pod, text in sorted(scrapes.items()):
        up.append(_sample(0.0 if text is None else 1.0, now, pod=pod))
        if text is None:
            continue
        inflight = itl_count = ttft_count = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                kind = kinds.get(s.labels.get("class", ""))
                if kind is None:
                    continue
                if s.name == "tessera_inflight":
                    if kind == "interactive":
                        inflight += s.value
                    else:
                        batch_running += s.value
                elif s.name == "tessera_queue_length":
                    if kind == "interactive":
                        interactive_queued += s.value
                    else:
                        batch_queued[s.labels["class"]] = batch_queued.get(s.labels["class"], 0.0) + s.value
                elif s.name == "tessera_itl_seconds_count" and kind == "batch":
                    itl_count += s.value
                elif s.name == "tessera_ttft_seconds_count" and kind == "interactive":
                    ttft_count += s.value
        busy.append(_sample(inflight, now, pod=pod))
        counters[pod] = (now, itl_count, ttft_count)
        last = previous.get(pod)
        if last is not None and now > last[0]:
            # A counter that went down means the worker restarted: all of it is new (Prometheus' rate).
            grew = itl_count - last[1] if itl_count >= last[1] else itl_count
            tokens_per_s += grew / (now - last[0])
            started = ttft_count - last[2] if ttft_count >= last[2] else ttft_count
            requests_per_s += started / (now - last[0])
            measured = True
    results: Results = {
        "up": up,
        "interactive_inflight": busy,
        "interactive_queued": [_sample(interactive_queued, now)],
        "batch_queued": [_sample(v, now, **{"class": c}) for c, v in sorted(batch_queued.items())],
        "batch_running": [_sample(batch_running, now)],
        "batch_tokens": [_sample(tokens_per_s, now)],
        "interactive_rate": [_sample(requests_per_s, now)] if measured else [],
        "held": [_sample(n, now, **{"class": c}) for c, n in sorted((held or {}).items()) if c in kinds],
    }
    return results, counters


def batch_results(
    text: str | None, models: Collection[str], kinds: Mapping[str, str], now_unix: float, now: float
) -> Results:
    """The results of ``group_queries``' batch-component queries (``batch_pending``,
    ``batch_pending_left``, ``batch_output_mean``, ``batch_output_std``) for a group serving ``models``
    with the classes ``kinds``, from the batch component's /metrics ``text`` (None: not scraped, so
    none). ``now_unix``: the Unix time of the scrape, for the seconds left before each deadline."""
    if text is None:
        return {}
    pending: dict[str, float] = {}
    left: dict[str, float] = {}
    means: list[float] = []
    stds: list[float] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.labels.get("class", "")
            if s.labels.get("model") not in models or kinds.get(name) != "batch":
                continue
            if s.name == PENDING_METRIC:
                pending[name] = pending.get(name, 0.0) + s.value
            elif s.name == DEADLINE_METRIC:
                left[name] = min(left.get(name, s.value - now_unix), s.value - now_unix)
            elif s.name == OUTPUT_MEAN_METRIC:
                means.append(s.value)
            elif s.name == OUTPUT_STD_METRIC:
                stds.append(s.value)
    return {
        "batch_pending": [_sample(v, now, **{"class": c}) for c, v in sorted(pending.items())],
        "batch_pending_left": [_sample(v, now, **{"class": c}) for c, v in sorted(left.items())],
        "batch_output_mean": [_sample(max(means), now)] if means else [],
        "batch_output_std": [_sample(max(stds), now)] if stds else [],
    }
