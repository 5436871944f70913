"""Placement from measured load, end to end: a real Prometheus scrapes real ``tessera worker`` processes
(sim engine) running the configurations the operator wrote, the operator under kopf (against KMock's
emulator) reads each model's load from Prometheus at the re-placement boundary, plans on it, and the
adaptive interval moves by SeaLLM's Eq. 8 from the estimate kept in status against what was measured.

The production path: pool daemon tick -> ``Controller.due`` (the boundary) -> ``reconcile_pool`` ->
``PrometheusMetrics.loads`` -> ``desired_pool`` (the planner's inputs) -> status.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from kmock_harness import Harness, emulated_cluster
from test_operator_autoscaling_prometheus import Prometheus, meta_labels, promql

from tessera.bench.harness import WorkerChild, stream_one
from tessera.control import pool_plan
from tessera.control.children import CONFIG_KEY
from tessera.core.planners import IntervalMetrics, ServiceInput
from tessera.core.planners.replacement import IntervalSettings, next_replacement_interval, prediction_error
from tessera.operator.prometheus import PrometheusMetrics
from tessera.worker.engines.vllm_process import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make sysdeps)"),
]

NAMESPACE, POOL = "replace", "pool"
MODELS = {"busy": "org/busy-8B", "quiet": "org/quiet-8B"}
STREAMS = {"busy": 4, "quiet": 1}  # concurrent clients streaming back to back
TOKENS = 16
INTERVAL = {"initialSeconds": 12, "minSeconds": 10, "maxSeconds": 30, "beta": 0.1}
TICK_S = 0.25


def docs() -> list[dict[str, Any]]:
    """One pool of two instances, two services on the sim engine, one interactive class."""

    def meta(name: str) -> dict[str, Any]:
        return {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "resourceVersion": "1"}

    pool = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {**meta(POOL), "annotations": {"tessera.dev/engine": "sim"}},
        "spec": {
            "gpu": {"type": "H100", "memory": "80Gi"},
            "instances": {"min": 1, "max": 2},
            "autoscaling": {"enabled": False},
            "placement": {"strategy": "seallm", "replacementInterval": INTERVAL},
        },
    }
    chat = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "RequestClass",
        "metadata": meta("chat"),
        "spec": {"kind": "interactive", "slo": {"ttftSeconds": 1, "itlSeconds": 0.1}},
    }
    services = [
        {
            "apiVersion": "tessera.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": meta(name),
            "spec": {
                "model": {"name": model},
                "poolRef": {"name": POOL},
                "requestClasses": [{"name": "chat"}],
                "scheduling": {"policy": "fcfs"},
                "replicas": {"min": 1, "max": 2},
            },
        }
        for name, model in MODELS.items()
    ]
    return [pool, chat, *services]


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, list[ServiceInput]]]:
    """Every placement the operator computes: (when, the planner's service inputs)."""
    seen: list[tuple[float, list[ServiceInput]]] = []
    plan = pool_plan.plan_placement

    def recording(pool, services, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((time.time(), list(services)))
        return plan(pool, services, **kwargs)

    monkeypatch.setattr(pool_plan, "plan_placement", recording)
    return seen


@pytest_asyncio.fixture(loop_scope="function")
async def operator_with_prometheus() -> AsyncIterator[tuple[Harness, int]]:
    port = free_port()
    async with emulated_cluster(
        metrics=PrometheusMetrics(f"http://127.0.0.1:{port}"), tick_seconds=TICK_S
    ) as h:
        yield h, port


async def clients(url: str, model: str, streams: int, until: float) -> int:
    """``streams`` clients streaming short completions back to back until ``until``; requests finished."""
    done = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.time() < until:
            body = {"model": model, "prompt": "tell me a story", "max_tokens": TOKENS, "ignore_eos": True}
            stat = await stream_one(http, url, body, {"X-Tessera-Class": "chat"})
            assert stat.tokens == TOKENS
            done += 1

    async with httpx.AsyncClient(timeout=30) as http:
        await asyncio.gather(*(client(http) for _ in range(streams)))
    return done


async def test_measured_rates_reach_placement_and_the_interval_adapts(
    operator_with_prometheus: tuple[Harness, int],
    planned: list[tuple[float, list[ServiceInput]]],
    tmp_path: Path,
) -> None:
    harness, prom_port = operator_with_prometheus
    documents = docs()
    pool, services_docs = documents[0], {name: documents[2 + i] for i, name in enumerate(MODELS)}
    # Prometheus first: the operator's first passes then find it (an unreachable one costs retries).
    prom = Prometheus(prom_port, tmp_path)
    workers: list[WorkerChild] = []
    try:
        await asyncio.to_thread(prom.wait_ready)
        for doc in documents:
            await harness.create(doc)

        async def placed() -> dict[str, Any] | None:
            body = await harness.get(pool)
            groups = ((body or {}).get("status") or {}).get("placement", {}).get("groups")
            children = await harness.children(NAMESPACE)
            bodies = [await harness.get(d) for d in services_docs.values()]
            if (
                groups
                and all(("ConfigMap", f"{POOL}-{g['name']}-worker") in children for g in groups)
                and all("load" in (b or {}).get("status", {}) for b in bodies)
            ):
                return {"status": body["status"], "children": children, "services": bodies}
            return None

        found = await harness.eventually(placed)
        first = found["status"]
        assert first["replacementIntervalSeconds"] == INTERVAL["initialSeconds"]
        for body in found["services"]:
            assert body["status"]["load"]["sources"]["requestsPerSecond"] == "default"

        # One worker per group (ordinal 0) on the operator's configuration; Prometheus scrapes them.
        targets = []
        url_of: dict[str, str] = {}
        for group in first["placement"]["groups"]:
            sts = f"{POOL}-{group['name']}"
            config = json.loads(found["children"][("ConfigMap", f"{sts}-worker")]["data"][CONFIG_KEY])
            worker = await asyncio.to_thread(WorkerChild, config, tmp_path)
            workers.append(worker)
            labels = meta_labels(found["children"][("StatefulSet", sts)], 0)
            targets.append((f"127.0.0.1:{worker.port}", labels))
            for model in config["models"]:
                url_of.setdefault(model["name"], worker.url)
        prom.set_targets(targets)

        # Load over two boundaries: the busy service at four times the quiet one's streams.
        start = time.time()
        load = {
            name: asyncio.create_task(clients(url_of[MODELS[name]], MODELS[name], STREAMS[name], start + 60))
            for name in MODELS
        }

        async def adapted() -> dict[str, Any] | None:
            # The pass patches the pool's status, then the services': wait for both.
            body = await harness.get(pool)
            status = (body or {}).get("status") or {}
            bodies = [await harness.get(d) for d in services_docs.values()]
            sources = [((b or {}).get("status") or {}).get("load", {}).get("sources", {}) for b in bodies]
            measured = all(s.get("requestsPerSecond") == "measured" for s in sources)
            return status if "estimateError" in status and measured else None

        status = await harness.eventually(adapted, timeout=40)
        boundary = time.time()
        services = {name: await harness.get(doc) for name, doc in services_docs.items()}
        gauge = await promql(prom.url, f'tessera_batch_size{{namespace="{NAMESPACE}",pool="{POOL}"}}')

        async def next_boundary() -> dict[str, Any] | None:
            body = await harness.get(pool)
            later = (body or {}).get("status") or {}
            return later if later.get("lastPlacementTime") != status["lastPlacementTime"] else None

        second = await harness.eventually(next_boundary, timeout=status["replacementIntervalSeconds"] + 5)
        for task in load.values():
            task.cancel()
        await asyncio.gather(*load.values(), return_exceptions=True)
    finally:
        await harness.stop()
        await asyncio.to_thread(lambda: [w.stop() for w in workers] and None)
        await asyncio.to_thread(prom.stop)

    # The measured rates reached the planner's inputs (and the services' status says so).
    loads = {name: services[name]["status"]["load"] for name in MODELS}
    for load_status in loads.values():
        assert load_status["sources"]["requestsPerSecond"] == "measured"
        assert load_status["sources"]["outputTokens"] == "measured"
        assert load_status["meanOutputTokens"] == pytest.approx(TOKENS, rel=0.15)
    assert loads["busy"]["requestsPerSecond"] > 2 * loads["quiet"]["requestsPerSecond"] > 0
    measured_plans = [
        (t, inputs) for t, inputs in planned if start < t <= boundary and any(s.history for s in inputs)
    ]
    assert measured_plans, planned
    _, inputs = measured_plans[-1]
    rates = {s.name: s.request_rate for s in inputs}
    assert rates["busy"] == pytest.approx(loads["busy"]["requestsPerSecond"], rel=1e-3)
    assert rates["busy"] > 2 * rates["quiet"] > 0

    # Eq. 8: the estimate kept in status at the first plan against what the interval measured.
    estimate = IntervalMetrics(
        first["placement"]["estimatedSloAttainment"], first["placement"]["estimatedNormLatency"]
    )
    real = IntervalMetrics(status["measured"]["sloAttainment"], status["measured"]["normLatency"])
    settings = IntervalSettings(12, 10, 30, 0.1)
    assert status["estimateError"] == pytest.approx(prediction_error(estimate, real))
    interval = status["replacementIntervalSeconds"]
    assert interval == pytest.approx(next_replacement_interval(12, estimate, real, settings))
    assert interval != INTERVAL["initialSeconds"]
    # The next boundary compares the estimate of the plan made on the measured load.
    kept = IntervalMetrics(
        status["placement"]["estimatedSloAttainment"], status["placement"]["estimatedNormLatency"]
    )
    later = IntervalMetrics(second["measured"]["sloAttainment"], second["measured"]["normLatency"])
    assert second["estimateError"] == pytest.approx(prediction_error(kept, later))
    assert second["replacementIntervalSeconds"] == pytest.approx(
        next_replacement_interval(interval, kept, later, settings)
    )
    # Each group's batch size is what its workers report (no autoscaling: batchSize.initial).
    reported = {s["metric"]["group"]: float(s["value"][1]) for s in gauge}
    assert {g["name"]: g["batchSize"] for g in status["placement"]["groups"]} == {
        group: round(value) for group, value in reported.items()
    }
    assert set(reported.values()) == {256.0}
    print(
        f"boundary {boundary - start:.1f}s after the load started: rates busy "
        f"{loads['busy']['requestsPerSecond']:.2f}/s, quiet {loads['quiet']['requestsPerSecond']:.2f}/s "
        f"(over {loads['busy'].get('windowSeconds')}s); estimate {estimate}, measured {real}, error "
        f"{status['estimateError']:.3f}; interval 12 -> {interval:.1f}s; next boundary: estimate {kept}, "
        f"measured {later}, error {second['estimateError']:.3f}, interval -> "
        f"{second['replacementIntervalSeconds']:.1f}s"
    )
