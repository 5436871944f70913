"""Autoscaling end to end: a real Prometheus (started here on loopback) scrapes real ``tessera worker``
processes in sim-engine mode, and the operator under kopf (against KMock's emulator) scales the
group's StatefulSet from what Prometheus measures — the production path: pool daemon tick ->
``Controller.reconcile_pool`` -> ``PrometheusMetrics.snapshot`` -> ``chiron_decide`` -> StatefulSet replicas.

The workers run the very configuration the operator wrote into the group's ConfigMap. Prometheus runs
the manifests' scrape job (``manifests/monitoring/prometheus-scrape-config.yaml``), whose relabelling
turns the pods' discovery labels into the ones the operator queries (namespace, pod, pool, group).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from prometheus_client import start_http_server

from tessera.batch.metrics import backlog_registry
from tessera.batch.store import BatchStore
from tessera.bench.cluster import (
    PROMETHEUS,
    SCRAPE_S,
    Harness,
    Prometheus,
    ReplicaLog,
    autoscaled_quickstart,
    emulated_cluster,
    placed_group,
    promql,
    serve_pods,
    until_scraped,
)
from tessera.bench.harness import WorkerChild, stream_one
from tessera.control.metrics_queries import group_queries
from tessera.core.chiron import autoscale as autoscale_module
from tessera.core.planners import GroupPlan, MetricsSnapshot, RoleCounts, ScalingDecision
from tessera.core.planners.chiron import chiron_decide
from tessera.operator.prometheus import PrometheusMetrics
from tessera.worker.engines.vllm_process import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (make sysdeps)"),
]

NAMESPACE = "autoscale"
INTERVAL_S = 2.0  # spec.autoscaling.intervalSeconds (Chiron T_eval)
COOLDOWN_S = 5.0  # spec.autoscaling.scaleDownCooldownSeconds
TICK_S = 0.25  # how often the pool daemons look whether the autoscaler is due
LOAD_S = 6.0  # length of the load step
STREAMS = 4  # concurrent streams of the load step
# Slack for a loaded 2-core machine (process scheduling, the emulator's answers) on top of the
# delays the design allows.
SLACK_S = 1.5


async def first_seen(url: str, query: str, timeout: float) -> float:
    """When ``query`` first returned a non-empty result (polled every 0.1 s)."""
    deadline = time.time() + timeout
    while not await promql(url, query):
        if time.time() > deadline:
            raise AssertionError(f"{query} stayed empty for {timeout}s")
        await asyncio.sleep(0.1)
    return time.time()


async def load_step(url: str, model: str, until: float) -> int:
    """``STREAMS`` clients streaming short completions back to back until ``until``; returns how
    many requests finished."""
    done = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.time() < until:
            body = {"model": model, "prompt": "tell me a story", "max_tokens": 64, "ignore_eos": True}
            stat = await stream_one(http, url, body, {"X-Tessera-Class": "chat"})
            assert stat.tokens == 64
            done += 1

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(STREAMS)))
    return done


Evaluation = tuple[float, MetricsSnapshot, ScalingDecision]


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[Evaluation]:
    """Every global autoscaler evaluation the operator makes: (its time, what it measured, what it
    decided). Recorded around the real ``chiron_decide``; nothing else changes."""
    seen: list[Evaluation] = []

    def recording(snapshot, state, settings, now):  # type: ignore[no-untyped-def]
        decision = chiron_decide(snapshot, state, settings, now)
        seen.append((now, snapshot, decision))
        return decision

    monkeypatch.setattr(autoscale_module, "chiron_decide", recording)
    return seen


def busy(snapshot: MetricsSnapshot) -> int:
    """Chiron's U: instances with interactive work (a queue counts as one more)."""
    return snapshot.instances_with_interactive + (1 if snapshot.interactive_queued else 0)


@pytest_asyncio.fixture(loop_scope="function")
async def operator_with_prometheus(evaluations: list[Evaluation]) -> AsyncIterator[tuple[Harness, int]]:
    port = free_port()
    metrics = PrometheusMetrics(f"http://127.0.0.1:{port}")
    async with emulated_cluster(metrics=metrics, tick_seconds=TICK_S) as harness:
        yield harness, port


async def test_load_step_scales_up_within_an_interval_and_down_after_the_cooldown(
    operator_with_prometheus: tuple[Harness, int], evaluations: list[Evaluation], tmp_path: Path
) -> None:
    harness, prom_port = operator_with_prometheus
    docs = autoscaled_quickstart(NAMESPACE, 2, INTERVAL_S, COOLDOWN_S)
    for doc in docs:
        await harness.create(doc)
    pool = next(d for d in docs if d["kind"] == "ServingPool")
    sts, children = await placed_group(harness, pool)

    # Two worker pods (ordinals 0 and 1) on the operator's configuration; Prometheus scrapes both.
    # Blocking starts run in threads: the emulator answers kopf from this event loop.
    workers: list[WorkerChild] = []
    phases = {"placed": time.time()}
    prom = Prometheus(prom_port, tmp_path)
    try:
        prom_ready = asyncio.create_task(asyncio.to_thread(prom.wait_ready))
        started, config = await serve_pods(prom, children, sts, 2, tmp_path)
        workers += started
        assert [m["engine"] for m in config["models"]] == ["sim"]
        model = config["models"][0]["name"]
        phases["workers up"] = time.time()
        await prom_ready
        await until_scraped(harness, prom, NAMESPACE, sts, 2)
        phases["scraped"] = time.time()
        replicas = ReplicaLog(harness, NAMESPACE, sts)
        # Idle: the autoscaler settles at the pool's one interactive instance.
        await replicas.wait_for(1, timeout=4 * INTERVAL_S + COOLDOWN_S + SLACK_S)
        idle_changes = len(replicas.changes)
        phases["idle at 1"] = time.time()

        # The load step on pod 0: instances with interactive work / instances = 1 > Θ_op + δ_op.
        start = time.time()
        load = asyncio.create_task(load_step(workers[0].url, model, start + LOAD_S))
        loaded = f'sum(tessera_inflight{{pod="{sts}-0"}}) > 0'
        seen = asyncio.create_task(first_seen(prom.url, loaded, timeout=LOAD_S))
        scaled_up = await replicas.wait_for(2, timeout=LOAD_S)
        visible = await seen
        finished = await load
        load_end = time.time()
        # Scale-down only after the cooldown and once Prometheus sees the group idle.
        scaled_down = await replicas.wait_for(1, timeout=COOLDOWN_S + 3 * INTERVAL_S + SLACK_S)
        phases["scaled down"] = time.time()
        await replicas.watch_until(time.time() + INTERVAL_S)  # and it stays
    finally:
        # The operator first: its passes would otherwise retry a stopped Prometheus while kopf waits.
        await harness.stop()
        await asyncio.to_thread(lambda: [w.stop() for w in workers] and None)
        await asyncio.to_thread(prom.stop)

    assert finished >= STREAMS
    # Prometheus shows the load within a scrape; the autoscaler evaluates once per interval, and the
    # first evaluation that sees the load scales up (none before it did, none after it flaps).
    measured_after = visible - start
    assert measured_after <= SCRAPE_S + SLACK_S
    during = [e for e in evaluations if start <= e[0] <= scaled_up]
    first = next(e for e in during if busy(e[1]) >= 1)
    assert first[2].desired.total == 2 and first[1].ready.total == 1, first
    assert first[0] - visible <= INTERVAL_S + TICK_S + SLACK_S
    times = [e[0] for e in evaluations]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= INTERVAL_S + TICK_S + SLACK_S and min(gaps) >= INTERVAL_S, gaps
    assert scaled_down - scaled_up >= COOLDOWN_S
    assert scaled_down >= load_end - SCRAPE_S  # never while the load was running
    # No flapping: after settling idle, exactly one scale-up and one scale-down.
    assert [r for _, r in replicas.changes[idle_changes - 1 :]] == [1, 2, 1], replicas.changes

    # The status records the same decisions, with Chiron's reasons.
    body = await harness.get(pool)
    history = body["status"]["scalingHistory"]
    ups = [h for h in history if h["toReplicas"] > h["fromReplicas"]]
    assert ups and "IBP" in ups[-1]["reason"]
    # and each pod's role by ordinal, as the ConfigMap gives it to the router
    (group,) = body["status"]["placement"]["groups"]
    assert group["roles"] == ["interactive"] * sum(group["replicas"].values()) == ["interactive"]
    print(
        f"load visible in Prometheus after {measured_after:.2f}s; first evaluation seeing it "
        f"{first[0] - visible:.2f}s later scaled 1 -> 2 (StatefulSet patched {scaled_up - start:.2f}s "
        f"after the load step); evaluation gaps {min(gaps):.2f}-{max(gaps):.2f}s (interval "
        f"{INTERVAL_S}s); scale-down {scaled_down - scaled_up:.2f}s after the scale-up (cooldown "
        f"{COOLDOWN_S}s), {scaled_down - load_end:.2f}s after the load ended; {finished} requests; "
        + ", ".join(f"{k} at {v - phases['placed']:.1f}s" for k, v in phases.items())
    )


async def test_every_snapshot_query_parses_for_names_with_hyphens_and_dots(tmp_path: Path) -> None:
    """Class and model names are escaped for PromQL's strings: ``re.escape`` writes ``\\-`` and ``\\.``,
    which a real Prometheus refuses (400) unless the backslash itself is escaped."""
    prom = Prometheus(free_port(), tmp_path)
    try:
        await asyncio.to_thread(prom.wait_ready)
        kinds = {"chat-fast": "interactive", "bulk.jobs": "batch"}
        queries = group_queries("ns", "p", "g", kinds, "2m", ("Qwen/Qwen2.5-0.5B-Instruct",))
        for name, query in queries.items():
            assert await promql(prom.url, query) is not None, name  # raises on a refused query
    finally:
        await asyncio.to_thread(prom.stop)


async def test_the_batch_components_backlog_reaches_the_operators_snapshot(
    tmp_path: Path, batch_job_store: Callable[..., BatchStore]
) -> None:
    """A real Prometheus scrapes the batch component's gauges (through the manifests' relabelling, as
    one more target), and the operator's own ``PrometheusMetrics.snapshot`` reads the unsent lines as a
    group due at the job's expiry on its own clock, with the answered lines' output length."""
    created = int(time.time())
    store = batch_job_store(100, answered=10, in_flight=5, created=created, window_s=300)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=backlog_registry(store))
    prom = Prometheus(free_port(), tmp_path)
    try:
        await asyncio.to_thread(prom.wait_ready)
        # The pod discovery labels of a worker pod of the group: the snapshot needs one scraped pod.
        labels = {"__meta_kubernetes_namespace": "ns", "__meta_kubernetes_pod_name": "p-g-0",
                  "__meta_kubernetes_pod_container_port_name": "http",
                  "__meta_kubernetes_pod_label_app_kubernetes_io_managed_by": "tessera-operator",
                  "__meta_kubernetes_pod_label_tessera_dev_pool": "p",
                  "__meta_kubernetes_pod_label_tessera_dev_group": "g",
                  "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
                  "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics"}  # fmt: skip
        prom.set_targets([(f"127.0.0.1:{server.server_port}", labels)])
        metrics = PrometheusMetrics(prom.url)
        group = GroupPlan("g", ("svc",), 1, RoleCounts(interactive=1))
        kinds, deadlines = {"chat": "interactive", "offline": "batch"}, {"offline": 3600.0}
        deadline = time.monotonic() + 20
        while True:
            snap = await asyncio.to_thread(
                metrics.snapshot, "ns", "p", group, kinds, deadlines, 1000.0, ("m",)
            )
            if snap is not None and snap.batch_queue:
                break
            assert time.monotonic() < deadline, "Prometheus never had the batch component's gauges"
            await asyncio.sleep(0.5)
        (unsent,) = snap.batch_queue
        assert unsent.count == 85
        assert 1000.0 + 300 - 25 < unsent.deadline <= 1000.0 + 300 - (time.time() - created) + 1
        assert (snap.mean_output_tokens, snap.std_output_tokens) == (200.0, 0.0)
    finally:
        server.shutdown()
        thread.join(5)
        await asyncio.to_thread(prom.stop)
