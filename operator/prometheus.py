"""The operator's MetricsSource over a Prometheus server (prometheus-api-client): sends the queries of
``tessera.control.metrics_queries`` and parses their results there."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
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
    load_queries,
    loads_from_results,
    snapshot_from_results,
)
from tessera.core.planners import GroupPlan, MetricsSnapshot

log = logging.getLogger(__name__)
# After a failed query (the client has retried it for seconds), the queries of the next seconds give up at
# once: one pass then waits for an unreachable Prometheus once, not once per query.
GIVE_UP_S = 2.0


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

    def _run(self, queries: Mapping[str, str]) -> dict[str, list[dict[str, Any]]] | None:
        if time.monotonic() - self._failed_at < GIVE_UP_S:
            return None
        try:
            return {k: list(self.query(q)) for k, q in queries.items()}
        except Exception as err:  # an unreachable Prometheus must not stop the reconcile
            log.warning("Prometheus query failed: %s", err)
            self._failed_at = time.monotonic()
            return None

    def snapshot(
        self,
        namespace: str,
        pool: str,
        group: GroupPlan,
        kinds: Mapping[str, str],
        deadlines: Mapping[str, float],
        now: float,
    ) -> MetricsSnapshot | None:
        """The group's measurements now; None when Prometheus has none (or cannot be reached)."""
        results = self._run(group_queries(namespace, pool, group.name, kinds, self.window))
        return snapshot_from_results(results, group, deadlines, now) if results else None

    def attainment(self, namespace: str, pool: str, model: str) -> list[dict[str, Any]] | None:
        """Measured SLO attainment per class of one served model; None when unknown."""
        results = self._run(attainment_queries(namespace, pool, model, self.window))
        return attainment_from_results(results) if results else None

    def loads(self, namespace: str, pool: str, window_s: float) -> dict[str, ModelLoad] | None:
        """Every model's load in the pool over the last ``window_s`` seconds, every query evaluated at the
        same instant (now); None when Prometheus cannot be reached."""
        results = self._run(load_queries(namespace, pool, window_s, at=time.time()))
        return loads_from_results(results) if results is not None else None

    def batch_sizes(self, namespace: str, pool: str) -> dict[str, int] | None:
        """Each group's batch size (the mean over its pods and models); None when unknown."""
        results = self._run({"batch": batch_size_query(namespace, pool)})
        return batch_sizes_from_result(results["batch"]) if results is not None else None
