"""Prometheus metrics of the router (``tessera_router_`` prefix), served at its ``/metrics``.

What the clients saw, per model and class kind: answers by HTTP status (the router's own 4xx/503
included; a stream that broke off or ended with an error event counts as 502, one whose client left
as 499), time to the last byte, and for streams the time to the first token chunk (the client-side
TTFT, the router's overhead included). Requests an instance failed (refused connection, or broken off
while answering) count per instance. The instances' state (in the rotation, outstanding requests,
batch size, estimated wait) is read from the router state at scrape time, so a scrape always shows
the current view.

Label values stay bounded: a request for a model the router does not serve is counted with
``model=""`` (the client chooses that string), and ``kind=""`` until the class is known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
MK = ("model", "kind")

# The instance rows of ``RouterState.status()["instances"]``.
InstanceRows = Callable[[], list[dict[str, Any]]]


class _InstanceCollector(Collector):
    """Gauges of every instance, read from the router state when Prometheus scrapes."""

    def __init__(self, rows: InstanceRows) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["instance", "model", "role"]
        up = GaugeMetricFamily(
            "tessera_router_instance_ready", "1 while the instance is in the rotation.", labels=labels
        )
        outstanding = GaugeMetricFamily(
            "tessera_router_outstanding",
            "Requests this router has outstanding on the instance.",
            labels=labels,
        )
        batch = GaugeMetricFamily(
            "tessera_router_batch_size", "The instance's batch size as last polled.", labels=labels
        )
        wait = GaugeMetricFamily(
            "tessera_router_estimated_wait_seconds",
            "QLM-estimated waiting time of a new request on the instance (what the route compares).",
            labels=labels,
        )
        blocks = GaugeMetricFamily(
            "tessera_router_cached_prefix_blocks",
            "Prompt blocks the router believes the instance holds in its prefix cache (cache-aware routes).",
            labels=labels,
        )
        prompt = CounterMetricFamily(
            "tessera_router_prefix_prompt_tokens",
            "Estimated prompt tokens a cache-aware route sent to the instance.",
            labels=labels,
        )
        cached = CounterMetricFamily(
            "tessera_router_prefix_cached_tokens",
            "Of those, the tokens the route expected the instance to hold cached (hit estimate).",
            labels=labels,
        )
        for row in self.rows():
            key = [row["instance"], row["model"], row["role"]]
            up.add_metric(key, 1.0 if row["healthy"] else 0.0)
            outstanding.add_metric(key, float(row["outstanding"]))
            batch.add_metric(key, float(row["batchSize"]))
            wait.add_metric(key, float(row["estimatedWaitSeconds"]))
            blocks.add_metric(key, float(row["cachedPrefixBlocks"]))
            prompt.add_metric(key, float(row["prefixPromptTokens"]))
            cached.add_metric(key, float(row["prefixCachedTokens"]))
        yield from (up, outstanding, batch, wait, blocks, prompt, cached)


class RouterMetrics:
    """The router's metric families in their own registry (several routers can share a process)."""

    def __init__(self, instances: InstanceRows) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tessera_router_requests",
            "Requests answered, by model, class kind and HTTP status.",
            [*MK, "code"],
            registry=r,
        )
        self.duration = Histogram(
            "tessera_router_request_seconds",
            "Arrival at the router to the last byte relayed.",
            MK,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tessera_router_ttft_seconds",
            "Streamed requests: arrival at the router to the first token chunk relayed.",
            MK,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_failures = Counter(
            "tessera_router_upstream_failures",
            "Requests an instance failed: it refused the connection or broke off while answering "
            "(the request went to another instance, or its stream ended with an error event).",
            ["instance"],
            registry=r,
        )
        r.register(_InstanceCollector(instances))

    def answered(self, model: str, kind: str, code: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        self.requests.labels(model, kind, str(code)).inc()
        self.duration.labels(model, kind).observe(seconds)

    def rejected(self, code: int) -> None:
        """Count a request refused before it reached the application (its head too large, too slow or
        malformed): no model, class or duration is known."""
        self.requests.labels("", "", str(code)).inc()

    def exposition(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
