"""The operator under KMock never patches or deletes an object it did not create: an LLMService named
``kubernetes`` leaves the cluster's own ``default/kubernetes`` Service alone and reports the conflict,
and a foreign ConfigMap carrying Tessera's labels survives both passes and the pool's deletion."""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio
from kmock_harness import Harness, emulated_cluster, load_example
from test_operator_kmock import EXAMPLES, POOL, SERVICE, apply_all, of_kind, quiet, writes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CLUSTER_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "kubernetes", "namespace": "default", "uid": "cluster-svc", "labels": {}},
    "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "https", "port": 443, "targetPort": 6443}]},
}
FOREIGN_CONFIG = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {
        "name": "someone-elses",
        "namespace": "default",
        "uid": "foreign-cm",
        "labels": {"app.kubernetes.io/managed-by": "tessera-operator", "tessera.dev/pool": "h100-pool"},
    },
    "data": {"keep": "me"},
}


@pytest_asyncio.fixture(loop_scope="function")
async def cluster():
    async with emulated_cluster() as harness:
        yield harness


async def _post(h: Harness, path: str, body: dict[str, Any]) -> None:
    response = await h.session.post(h.url + path, json=body)
    assert response.status in (200, 201), await response.text()


def _ready(body: dict[str, Any] | None) -> dict[str, Any]:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


async def test_service_named_kubernetes_and_labelled_configmap_are_left_alone(cluster: Harness) -> None:
    namespace = "default"
    await _post(cluster, "/api/v1/namespaces/default/services", CLUSTER_SERVICE)
    await _post(cluster, "/api/v1/namespaces/default/configmaps", FOREIGN_CONFIG)
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    service = of_kind(docs, SERVICE)[0]
    service["metadata"]["name"] = "kubernetes"
    pool = of_kind(docs, POOL)[0]
    await apply_all(cluster, docs)

    async def conflicted() -> bool:
        reasons = (
            _ready(await cluster.get(service)).get("reason"),
            _ready(await cluster.get(pool)).get("reason"),
        )
        return reasons == ("OwnershipConflict", "OwnershipConflict")

    await cluster.eventually(conflicted)
    message = _ready(await cluster.get(service))["message"]
    assert "Service default/kubernetes already exists" in message and "LLMService kubernetes" in message

    async def warned() -> bool:
        events = await cluster.events(namespace)
        return any(e["reason"] == "OwnershipConflict" and e["type"] == "Warning" for e in events)

    await cluster.eventually(warned)

    # The pool's own children are there; the foreign objects are as they were, never written.
    async def workers() -> bool:
        return any(kind == "StatefulSet" for kind, _ in await cluster.children(namespace))

    await cluster.eventually(workers)
    await quiet(cluster, namespace)
    children = await cluster.children(namespace)
    kube_svc = children[("Service", "kubernetes")]
    assert kube_svc["spec"] == CLUSTER_SERVICE["spec"]
    assert not kube_svc["metadata"].get("ownerReferences")
    assert children[("ConfigMap", "someone-elses")]["data"] == {"keep": "me"}
    touched = [
        w
        for w in writes(cluster, namespace)
        if w.endswith("/services/kubernetes") or w.endswith("/configmaps/someone-elses")
    ]
    assert touched == []

    # Deleting the pool deletes its own children only.
    await cluster.delete(pool)

    async def cleaned() -> bool:
        left = await cluster.children(namespace)
        return not any(kind == "StatefulSet" for kind, _ in left)

    await cluster.eventually(cleaned)
    await quiet(cluster, namespace)
    left = await cluster.children(namespace)
    assert {("Service", "kubernetes"), ("ConfigMap", "someone-elses")} <= set(left)
    assert not [w for w in writes(cluster, namespace) if w.startswith("DELETE") and "someone-elses" in w]
