"""The batch component's ``/metrics``: the backlog of the batches in progress, by model and class.

Read from the store at each scrape (``BatchStore.backlog``), so the figures are the database's and
survive a restart; the names are the contract in ``tessera.api.batch_link``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.api.batch_link import DEADLINE_METRIC, OUTPUT_MEAN_METRIC, OUTPUT_STD_METRIC, PENDING_METRIC
from tessera.batch.store import BatchStore

LABELS = ("model", "class")


class BacklogCollector(Collector):
    """The gauges of ``BatchStore.backlog``."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily(PENDING_METRIC, "Lines of the batches in progress not sent yet.",
                                    labels=LABELS)  # fmt: skip
        deadline = GaugeMetricFamily(DEADLINE_METRIC, "Unix time of the earliest expiry among the lines "
                                     "not sent yet.", labels=LABELS)  # fmt: skip
        mean = GaugeMetricFamily(OUTPUT_MEAN_METRIC, "Mean output tokens of the answered lines of the "
                                 "batches in progress.", labels=LABELS)  # fmt: skip
        std = GaugeMetricFamily(OUTPUT_STD_METRIC, "Standard deviation of their output tokens.",
                                labels=LABELS)  # fmt: skip
        for b in self.store.backlog():
            labels = [b.model, b.class_name]
            pending.add_metric(labels, b.pending)
            if b.earliest_deadline is not None:
                deadline.add_metric(labels, b.earliest_deadline)
            if b.mean_output_tokens is not None and b.std_output_tokens is not None:
                mean.add_metric(labels, b.mean_output_tokens)
                std.add_metric(labels, b.std_output_tokens)
        yield from (pending, deadline, mean, std)


def backlog_registry(store: BatchStore) -> CollectorRegistry:
    """A registry holding the backlog gauges of ``store`` (and nothing else)."""
    registry = CollectorRegistry()
    registry.register(BacklogCollector(store))
    return registry
