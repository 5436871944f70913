"""Prometheus metrics of the router (``tessera_router_`` prefix), served at its ``/metrics``.

What the clients saw, per model and class kind: answers by HTTP status (the router's own 4xx/503
included; a stream that broke off or ended with an error event counts as 502, one whose client left
as 499) and time to the last byte. Per model and request class, the SLO as the client sees it, the
router's own time included (the worker's ``tessera_ttft_seconds`` and ``tessera_slo_met`` start at the
worker): TTFT from the request's arrival at the router to the first token chunk relayed (a
non-streamed answer: to the answer, the client's first token), a stream's mean gap between token
chunks, and whether the class's SLO was met (``tessera_router_slo_met`` / ``_missed``, judged by
``tessera.core.slo.delivered_slo_met``; /router/status shows the same counts). Requests an instance
failed (refused connection, or broken off while answering) count per instance. The instances' state
(in the rotation, outstanding requests, batch size, estimated wait) is read from the router state at
scrape time, so a scrape always shows the current view.

With API keys, per tenant (``tessera_router_tenant_``): answers by status, tokens used, refusals by
reason and SLO verdicts; tenants are the keys file's, a bounded set.

Label values stay bounded: a request for a model the router does not serve is counted with
``model=""`` (the client chooses that string), and ``kind=""`` until the class is known; ``class``
takes only the configured class names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)  # the worker's ITL buckets
MK = ("model", "kind")
MKC = ("model", "kind", "class")

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


@dataclass(slots=True)
class ClassDelivery:
    """What the clients of one model and class were delivered."""

    kind: str
    met: int = 0
    missed: int = 0
    first_tokens: int = 0  # answers with a TTFT
    ttft_sum_s: float = 0.0


class DeliveredSlo:
    """SLO verdicts and TTFTs per (model, class): counted here once, exported to Prometheus by
    ``_SloCollector`` and shown by /router/status (``rows``)."""

    def __init__(self) -> None:
        self.by_class: dict[tuple[str, str], ClassDelivery] = {}

    def record(self, model: str, kind: str, klass: str, met: bool | None, ttft_s: float | None) -> None:
        """Count one answer."""
        tally = self.by_class.get((model, klass))
        if tally is None:
            tally = self.by_class[(model, klass)] = ClassDelivery(kind)
        if met is not None:
            if met:
                tally.met += 1
            else:
                tally.missed += 1
        if ttft_s is not None:
            tally.first_tokens += 1
            tally.ttft_sum_s += ttft_s

    def rows(self) -> list[dict[str, Any]]:
        """One row per model and class: SLO met, missed, attainment (None before any judged answer) and
        the mean client-side TTFT."""
        out = []
        for (model, klass), t in sorted(self.by_class.items()):
            judged = t.met + t.missed
            out.append({
                "model": model, "class": klass, "kind": t.kind, "sloMet": t.met, "sloMissed": t.missed,
                "sloAttainment": t.met / judged if judged else None,
                "meanTtftSeconds": t.ttft_sum_s / t.first_tokens if t.first_tokens else None,
            })  # fmt: skip
        return out


class _SloCollector(Collector):
    """``tessera_router_slo_met`` / ``_missed`` counters from the ``DeliveredSlo`` counts."""

    def __init__(self, slo: DeliveredSlo) -> None:
        self.slo = slo

    def collect(self) -> Iterator[CounterMetricFamily]:
        met = CounterMetricFamily(
            "tessera_router_slo_met",
            "Answers that met their class's SLO as the client saw it (the router's time included).",
            labels=list(MKC),
        )
        missed = CounterMetricFamily(
            "tessera_router_slo_missed",
            "Answers that missed their class's SLO as the client saw it, failed answers (5xx, 429) included.",
            labels=list(MKC),
        )
        for (model, klass), t in list(self.slo.by_class.items()):
            met.add_metric([model, t.kind, klass], float(t.met))
            missed.add_metric([model, t.kind, klass], float(t.missed))
        yield from (met, missed)


class RouterMetrics:
    """The router's metric families in their own registry (several routers can share a process)."""

    def __init__(self, instances: InstanceRows, slo: DeliveredSlo | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.slo = slo if slo is not None else DeliveredSlo()
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
            "Answered requests: arrival at the router to the first token chunk relayed (a non-streamed "
            "answer: to the answer).",
            MKC,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tessera_router_mean_itl_seconds",
            "Streamed answers with two token chunks or more: the answer's mean gap between token chunks "
            "relayed (first to last over n - 1), what the class's ITL SLO is judged on.",
            MKC,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.upstream_failures = Counter(
            "tessera_router_upstream_failures",
            "Requests an instance failed: it refused the connection or broke off while answering "
            "(the request went to another instance, or its stream ended with an error event).",
            ["instance"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "tessera_router_tenant_requests",
            "Requests of each tenant answered, by HTTP status (API keys on).",
            ["tenant", "code"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "tessera_router_tenant_tokens",
            "Tokens each tenant used by kind (prompt, completion), as its answers' usage counts them (a "
            "stream: the prompt as estimated at admission and the token chunks relayed).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_refused = Counter(
            "tessera_router_tenant_refused",
            "Requests of each tenant the router refused, by reason: requests, tokens, concurrency "
            "(over its quota: 429), request_too_large (429), model_not_allowed, class_not_allowed (403).",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_slo = Counter(
            "tessera_router_tenant_slo",
            "Answers of each tenant judged against their class's SLO as the client saw it, by class and "
            "verdict (met: true, false).",
            ["tenant", "class", "met"],
            registry=r,
        )
        r.register(_InstanceCollector(instances))
        r.register(_SloCollector(self.slo))

    def answered(self, model: str, kind: str, code: int, seconds: float, tenant: str = "") -> None:
        """Count one answered request and its duration (and for its tenant, with API keys on)."""
        self.requests.labels(model, kind, str(code)).inc()
        self.duration.labels(model, kind).observe(seconds)
        if tenant:
            self.tenant_requests.labels(tenant, str(code)).inc()

    def delivered(
        self,
        model: str,
        kind: str,
        klass: str,
        met: bool | None,
        ttft_s: float | None,
        mean_itl_s: float | None,
        tenant: str = "",
    ) -> None:
        """Record what one answer of class ``klass`` delivered: its TTFT and mean ITL where it had them,
        and its SLO verdict (None: not judged), also for its ``tenant`` when known."""
        if tenant and met is not None:
            self.tenant_slo.labels(tenant, klass, "true" if met else "false").inc()
        labels = (model, kind, klass)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if mean_itl_s is not None:
            self.itl.labels(*labels).observe(mean_itl_s)
        self.slo.record(model, kind, klass, met, ttft_s)

    def rejected(self, code: int) -> None:
        """Count a request refused before it reached the application (its head too large, too slow or
        malformed): no model, class or duration is known."""
        self.requests.labels("", "", str(code)).inc()

    def exposition(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
