"""Local mode's measurements: the operator's Prometheus queries, answered from direct scrapes.

Without a Prometheus server, local mode scrapes every worker's ``/metrics`` itself and turns the
samples into the results the operator's queries would return (``tessera.control.metrics_queries.
group_queries``: the same names and shapes), so the operator's own ``snapshot_from_results`` builds the
autoscaler's snapshot and both paths read the workers the same way. The one difference: the batch
token rate and the interactive request rate are taken over the time since the previous scrape, not
Prometheus' 2-minute window.

Pure: scrape texts, the previous counters and the time come in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

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
