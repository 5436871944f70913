"""The operator under KMock never patches or deletes an object it did not create: an LLMService named
``kubernetes`` leaves the cluster's own ``default/kubernetes`` Service alone and reports the conflict,
and a foreign ConfigMap carrying Tessera's labels survives both passes and the pool's deletion. A child
the API server refuses (422) is reported, not retried."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio
from test_operator_kmock import EXAMPLES, POOL, SERVICE, apply_all, of_kind, quiet, writes

from tessera.bench.cluster import Harness, emulated_cluster, load_example

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
    body = await cluster.get(service)
    message = _ready(body)["message"]
    assert "Service default/kubernetes already exists" in message and "LLMService kubernetes" in message
    # Its status does not send clients to the cluster's own Service.
    assert "endpoint" not in body["status"]

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


async def test_a_child_the_api_server_refuses_sets_invalid_and_is_not_sent_again(cluster: Harness) -> None:
    """A 422 is permanent: the pool reports the server's message (Invalid=True RejectedByServer and a
    Warning event) and the same body is not sent again; a changed spec tries again."""
    namespace = "refused"
    sts_path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets"
    said = (
        'StatefulSet.apps "h100-pool-g0" is invalid: spec.template.spec.containers[0].image: Required value'
    )
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422}
    cluster.emulator.refuse("post", sts_path, 422, {**status, "message": said})
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    pool = of_kind(docs, POOL)[0]
    await apply_all(cluster, docs)

    async def invalid() -> dict[str, Any] | None:
        conditions = ((await cluster.get(pool)) or {}).get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "Invalid" and c["status"] == "True"), None)

    found = await cluster.eventually(invalid)
    assert found["reason"] == "RejectedByServer" and said in found["message"], found
    assert _ready(await cluster.get(pool))["status"] == "False"

    async def warned() -> bool:
        events = await cluster.events(namespace)
        return any(e["reason"] == "RejectedByServer" and e["type"] == "Warning" for e in events)

    await cluster.eventually(warned)
    # Further passes (marks from the services and classes, daemon ticks) do not send it again.
    await cluster.patch(pool, {"metadata": {"labels": {"touched": "yes"}}})
    await asyncio.sleep(2.0)
    await quiet(cluster, namespace)
    assert [w for w in writes(cluster, namespace) if w == f"POST {sts_path}"] == [f"POST {sts_path}"]

    # A changed spec gives another body: sent, accepted this time, and the pool is valid again.
    await cluster.patch(pool, {"spec": {"instances": {"min": 1, "max": 2}}})

    async def valid() -> bool:
        body = await cluster.get(pool)
        conditions = ((body or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Invalid" and c["status"] == "False" for c in conditions)

    await cluster.eventually(valid)
    assert any(kind == "StatefulSet" for kind, _ in await cluster.children(namespace))
