"""Scale to zero on a cluster, the way a user meets it: an LLMService with ``scaleToZero`` applied to
the operator (kopf on KMock's emulated API server), its idle group scaled to zero replicas, a request
sent to the router held while the service is Cold, the router's wake request answered by the operator
(restarted mid-wake: it resumes), and the request served once the group's pod is ready.

The emulator runs no StatefulSet controller: the test plays it (a pod object for ordinal 0, pointing at a
real ``tessera worker`` started from the group's own ConfigMap, sim engine). Prometheus is replaced by a
metrics source that reports the group idle; the PromQL of idleness is tested in
tests/test_scale_to_zero_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from tessera.bench.cluster import Harness, emulated_cluster, load_example
from tessera.bench.harness import WorkerChild
from tessera.control.children import CONFIG_KEY
from tessera.router import discovery as discovery_module
from tessera.router.activator import Activator
from tessera.router.app import RouterState, create_router_app
from tessera.router.cluster_wake import ClusterWaker
from tessera.router.discovery import KubeDiscovery

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NS = "stz"


class IdleMetrics:
    """A MetricsSource whose groups are idle (no load, no autoscaler measurements)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []

    def snapshot(self, *args: Any) -> None:
        return None

    def attainment(self, *args: Any) -> None:
        return None

    def loads(self, *args: Any) -> None:
        return None

    def batch_sizes(self, *args: Any) -> None:
        return None

    def idle(self, namespace: str, pool: str, group: str, window_s: float) -> bool:
        self.asked.append((group, window_s))
        return True


def documents() -> list[dict[str, Any]]:
    """The quickstart on the sim engine, its pool allowed to reach zero and its service sleeping after
    1 s without requests."""
    docs = load_example(EXAMPLES / "quickstart.yaml", NS)
    pool, service = docs[0], docs[3]
    pool["metadata"].setdefault("annotations", {})["tessera.dev/engine"] = "sim"
    pool["spec"]["instances"] = {"min": 0, "max": 2}
    pool["spec"]["autoscaling"] = {"enabled": False}
    service["spec"]["scaleToZero"] = {"afterSeconds": 1, "holdSeconds": 60}
    return docs


async def stateful_set(h: Harness) -> dict[str, Any] | None:
    return next((b for (k, _), b in (await h.children(NS)).items() if k == "StatefulSet"), None)


async def put_pod(h: Harness, sts: dict[str, Any], ip: str) -> None:
    """What the StatefulSet controller and kubelet would make of ordinal 0: a running, ready pod."""
    name = sts["metadata"]["name"]
    refs = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name, "uid": "s", "controller": True}]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-0", "namespace": NS, "ownerReferences": refs,
                     "labels": sts["spec"]["template"]["metadata"]["labels"]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip
    response = await h.session.post(f"{h.url}/api/v1/namespaces/{NS}/pods", json=pod)
    assert response.status in (200, 201), await response.text()
    # The StatefulSet's status, which the operator reads for readiness.
    path = f"{h.url}/apis/apps/v1/namespaces/{NS}/statefulsets/{name}"
    response = await h.session.patch(path, json={"status": {"readyReplicas": 1, "replicas": 1}},
                                     headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    assert response.status == 200, await response.text()


async def test_an_idle_service_goes_cold_and_a_request_through_the_router_wakes_and_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = IdleMetrics()
    async with emulated_cluster(metrics=metrics, tick_seconds=0.5) as h:
        docs = documents()
        for doc in docs:
            await h.create(doc)
        pool, service = docs[0], docs[3]

        awake_seen: list[int] = []

        async def replicas() -> int | None:
            sts = await stateful_set(h)
            count = None if sts is None else int(sts["spec"]["replicas"])
            if count:
                awake_seen.append(count)
            return count

        # Placed awake, then idle for its 1 s: scaled to zero, and the user sees it Cold. (The awake count
        # is the one observed: a second read could already find the group asleep.)
        await h.eventually(lambda: _is(replicas(), lambda r: r is not None and r >= 1))
        awake = awake_seen[-1]
        await h.eventually(lambda: _is(replicas(), lambda r: r == 0))
        status = await h.eventually(lambda: _state(h, service, "Cold"))
        assert any(c["type"] == "Ready" and c["status"] == "True" and c["reason"] == "Cold"
                   for c in status["conditions"]), status["conditions"]  # fmt: skip
        pool_status = (await h.get(pool))["status"]
        (entry,) = pool_status["scaleToZero"]
        assert entry["state"] == "Cold" and sum(entry["replicas"].values()) == awake
        assert any(e.get("reason") == "Slept" for e in await h.events(NS))
        assert metrics.asked and all(w == 1 for _, w in metrics.asked)

        sts = await stateful_set(h)
        assert sts is not None
        cm = next(b for (k, _), b in (await h.children(NS)).items() if k == "ConfigMap")
        worker = await asyncio.to_thread(WorkerChild, json.loads(cm["data"][CONFIG_KEY]), tmp_path)
        try:
            # The router as `tessera router --kubernetes` builds it, against the emulated API server.
            configuration = client.Configuration()
            configuration.host = h.url
            api = client.ApiClient(configuration)
            monkeypatch.setattr(discovery_module, "WORKER_PORT", worker.port)
            state = RouterState([])
            waker = ClusterWaker(state, custom=client.CustomObjectsApi(api), ready_timeout_s=60, poll_s=0.1)
            activator = Activator({}, {}, waker, lambda m: 0)
            discovery = KubeDiscovery([NS], core=client.CoreV1Api(api))
            app = create_router_app(state, poll_interval_s=0.3, discover=discovery.discover,
                                    activator=activator, follow=waker.follow)  # fmt: skip
            transport = httpx.ASGITransport(app=app)
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=transport, base_url="http://router", timeout=90) as router,
            ):
                model = service["spec"]["model"]["name"]
                listed = (await router.get("/v1/models")).json()
                assert model in [m["id"] for m in listed["data"]]  # still listed while Cold
                body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
                held = asyncio.create_task(
                    router.post("/v1/chat/completions", json=body, headers={"X-Request-Class": "chat"})
                )
                # The router's wake request restores the replicas; the service shows Waking.
                await h.eventually(lambda: _is(replicas(), lambda r: r == awake))
                await h.eventually(lambda: _state(h, service, "Waking"))
                # An operator restarted mid-wake resumes it from the pool's status.
                await h.stop()
                await h.start()
                await asyncio.sleep(2)
                assert await replicas() == awake and await _state(h, service, "Waking")
                assert not held.done()  # held until a pod is ready
                await put_pod(h, sts, "127.0.0.1")
                answer = await asyncio.wait_for(held, 60)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"]
                activation = (await router.get("/router/status")).json()["activation"]
                (unit,) = activation.values()
                assert unit["wakes"] == 1 and unit["state"] == "Ready"
            await h.eventually(lambda: _state(h, service, "Ready"))
            assert any(e.get("reason") == "Woken" for e in await h.events(NS))
        finally:
            await asyncio.to_thread(worker.stop)


async def _is(value: Any, test: Any) -> bool:
    return bool(test(await value))


async def _state(h: Harness, body: dict[str, Any], state: str) -> dict[str, Any] | None:
    status = ((await h.get(body)) or {}).get("status") or {}
    return status if status.get("state") == state else None
