"""The operator's MetricsSource over a Prometheus server (prometheus-api-client): sends the queries of
``tessera.control.metrics_queries`` and parses their results there."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tessera.control.metrics_queries import (
    DEFAULT_WINDOW,
    ModelLoad,
    Query,
    attainment_from_results,
    attainment_queries,
    batch_size_query,
    batch_sizes_from_result,
    group_queries,
    idle_from_results,
    idle_queries,
    load_queries,
    load_step_s,
    loads_from_results,
    snapshot_from_results,
)
from tessera.core.planners import GroupPlan, MetricsSnapshot

log = logging.getLogger(__name__)
# After a failed query (the client has retried it for seconds), the queries of the next seconds give up at
# once: one pass then waits for an unreachable Prometheus once, not once per query.
GIVE_UP_S = 2.0
# After Prometheus answers again, how long its first scrapes may take (CHOICE: its discovery hands targets
# to the scrape loops every 5 s, and the first scrape follows within a scrape interval): a window of loads
# starts no earlier (or a step later, when longer), so that its baseline is a new sample.
RESCRAPE_S = 10.0


class PrometheusMetrics:
    """The operator's MetricsSource over a Prometheus server."""

    def __init__(self, url: str, window: str = DEFAULT_WINDOW, query: Query | None = None) -> None:
        if query is None:
            from prometheus_api_client import PrometheusConnect

            connection = PrometheusConnect(url=url, disable_ssl=True, timeout=10)
            query = connection.custom_query
        self.query = query
        self.window = window
        self._failed_at = -math.inf
        # Whether the last query failed, and when (Unix time) Prometheus answered again after one.
        self._failing = False
        self._recovered_at = -math.inf

    def _run(self, queries: Mapping[str, str]) -> dict[str, list[dict[str, Any]]] | None:
        if time.monotonic() - self._failed_at < GIVE_UP_S:
            return None
        try:
            results = {k: list(self.query(q)) for k, q in queries.items()}
        except Exception as err:  # an unreachable Prometheus must not stop the reconcile
            log.warning("Prometheus query failed: %s", err)
            self._failed_at = time.monotonic()
            self._failing = True
            return None
        if self._failing:
            self._failing = False
            self._recovered_at = time.time()
        return results

    def snapshot(
        self,
        namespace: str,
        pool: str,
        group: GroupPlan,
        kinds: Mapping[str, str],
        deadlines: Mapping[str, float],
        now: float,
        models: Sequence[str] = (),
    ) -> MetricsSnapshot | None:
        """The group's measurements now (the requests the router holds for ``models`` included);
        None when Prometheus has none (or cannot be reached)."""
        results = self._run(group_queries(namespace, pool, group.name, kinds, self.window, models))
        return snapshot_from_results(results, group, deadlines, now) if results else None

    def attainment(self, namespace: str, pool: str, model: str) -> list[dict[str, Any]] | None:
        """Measured SLO attainment per class of one served model; None when unknown."""
        results = self._run(attainment_queries(namespace, pool, model, self.window))
        return attainment_from_results(results) if results else None

    def loads(self, namespace: str, pool: str, window_s: float) -> dict[str, ModelLoad] | None:
        """Every model's load in the pool over the last ``window_s`` seconds, every query evaluated at the
        same instant (now); None when Prometheus cannot be reached, or has not answered for the whole
        window (with its baseline step, and ``RESCRAPE_S`` or a step for the first scrapes) since a failed
        query.

        Prometheus has no samples for the time it was down, and a query fills such a gap with the last
        sample before it (its lookback): the counters stand still there, and a window over the gap reads
        as no traffic (0 requests per second measured at the boundary after a 16 s outage), or, when its
        baseline is the last sample before the gap, as the gap's requests arriving in one step (3 times
        the offered rate measured)."""
        at = time.time()
        step = load_step_s(window_s)
        if self._failing or at - window_s - step - max(step, RESCRAPE_S) < self._recovered_at:
            return None
        results = self._run(load_queries(namespace, pool, window_s, at=at))
        return loads_from_results(results) if results is not None else None

    def batch_sizes(self, namespace: str, pool: str) -> dict[str, int] | None:
        """Each group's batch size (the mean over its pods and models); None when unknown."""
        results = self._run({"batch": batch_size_query(namespace, pool)})
        return batch_sizes_from_result(results["batch"]) if results is not None else None

    def idle(self, namespace: str, pool: str, group: str, window_s: float) -> bool | None:
        """Whether the group's workers saw no request over the last ``window_s`` seconds; None when
        unknown (Prometheus unreachable, or the workers not scraped over the whole window)."""
        results = self._run(idle_queries(namespace, pool, group, window_s))
        return idle_from_results(results) if results is not None else None
