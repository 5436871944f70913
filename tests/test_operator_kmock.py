"""The operator under kopf against KMock's Kubernetes emulator: children, rescaling, cleanup, invalid
specs, restarts and API errors. Each test gets a fresh emulator and operator: KMock 0.8 matches every
request against its whole request history, so one long-lived emulator slows down quadratically."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio

from tessera.bench.cluster import PLURALS, Harness, copy_doc, emulated_cluster, load_example
from tessera.control.children import CONFIG_KEY
from tessera.operator import controller as controller_module

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
POOL, SERVICE, CLASS = "ServingPool", "LLMService", "RequestClass"


@pytest_asyncio.fixture(loop_scope="function")
async def cluster():
    async with emulated_cluster() as harness:
        yield harness


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


async def apply_all(h: Harness, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        await h.create(doc)


def expected_children(
    pool: dict[str, Any], status: dict[str, Any], services: list[str]
) -> set[tuple[str, str]]:
    name = pool["metadata"]["name"]
    expected = {("Service", s) for s in services}
    for group in status["placement"]["groups"]:
        obj = f"{name}-{group['name']}"
        expected |= {("StatefulSet", obj), ("Service", obj), ("ConfigMap", f"{obj}-worker")}
        expected.add(("PodDisruptionBudget", obj))
    return expected


async def settled(h: Harness, pool: dict[str, Any], services: list[str]) -> tuple[dict, dict]:
    """Wait until the pool's status has a plan and exactly its children exist; return both."""
    namespace = pool["metadata"]["namespace"]

    async def check():
        body = await h.get(pool)
        status = (body or {}).get("status") or {}
        if not status.get("placement", {}).get("groups"):
            return None
        children = await h.children(namespace)
        if set(children) != expected_children(pool, status, services):
            return None
        return status, children

    return await h.eventually(check)


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


async def quiet(h: Harness, namespace: str, still_s: float = 1.0, timeout: float = 20.0) -> None:
    """Wait until the operator has made no write in ``namespace`` for ``still_s`` (a fixed sleep can
    end before a handler the machine delayed has written)."""
    deadline = time.monotonic() + timeout
    last, since = writes(h, namespace), time.monotonic()
    while time.monotonic() - since < still_s:
        assert time.monotonic() < deadline, f"the operator kept writing for {timeout}s: {last[-3:]}"
        await asyncio.sleep(0.1)
        now = writes(h, namespace)
        if now != last:
            last, since = now, time.monotonic()


def writes(h: Harness, namespace: str) -> list[str]:
    """The operator's own writes in ``namespace``: creates, patches and deletes of children and of
    status subresources (kopf's bookkeeping patches and events are left out)."""
    found = []
    for r in h.emulator:
        method, path = getattr(r.method, "value", str(r.method)), r.url.path
        if method not in ("POST", "PATCH", "PUT", "DELETE") or f"/namespaces/{namespace}/" not in path:
            continue
        children = ("/statefulsets", "/configmaps", "/services", "/poddisruptionbudgets")
        if any(k in path for k in children) or path.endswith("/status"):
            found.append(f"{method} {path}")
    return found


@pytest.mark.parametrize("example", ["quickstart.yaml", "multi-model.yaml"])
async def test_example_creates_exactly_the_expected_children(cluster: Harness, example: str) -> None:
    namespace = "ex-" + example.split(".")[0]
    docs = load_example(EXAMPLES / example, namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    services = {s["metadata"]["name"]: s for s in of_kind(docs, SERVICE)}
    status, children = await settled(cluster, pool, sorted(services))

    placed = {s for g in status["placement"]["groups"] for s in g["services"]}
    assert placed == set(services)
    assert condition(status, "Placed")["status"] == "True"
    assert condition(status, "Invalid")["status"] == "False"
    spec = pool["spec"]
    for (kind, name), obj in children.items():
        owner = obj["metadata"]["ownerReferences"][0]
        expected_owner = services[name] if (kind == "Service" and name in services) else pool
        assert owner["uid"] == expected_owner["metadata"]["uid"]
        assert owner["kind"] == expected_owner["kind"] and owner["controller"] is True
        if kind != "StatefulSet":
            continue
        group = next(g for g in status["placement"]["groups"] if name.endswith(g["name"]))
        assert obj["spec"]["replicas"] == sum(group["replicas"].values())
        pod = obj["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == spec["nodeSelector"]
        assert [t["key"] for t in pod["tolerations"]] == [t["key"] for t in spec["tolerations"]]
        (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
        assert engine["args"].count(";") == len(group["services"]) - 1  # one vLLM server per model
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(group["tensorParallelSize"])
        assert obj["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"

    async def all_events():
        reasons = [e.get("reason") for e in await cluster.events(namespace)]
        return "Placed" in reasons and reasons.count("Created") == len(children)

    await cluster.eventually(all_events)
    for name, service in services.items():
        body = await cluster.eventually(
            lambda service=service: _with_status(cluster, service, "endpoint"),
        )
        assert body["status"]["endpoint"] == f"http://{name}.{namespace}.svc:80"
        assert condition(body["status"], "Placed")["status"] == "True"


async def _with_status(h: Harness, doc: dict[str, Any], field: str) -> dict[str, Any] | None:
    body = await h.get(doc)
    return body if body and field in (body.get("status") or {}) else None


async def test_second_reconcile_changes_nothing(cluster: Harness) -> None:
    namespace = "idem"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    await settled(cluster, pool, ["llama-8b"])
    await quiet(cluster, namespace)  # the handlers triggered by the creation have finished
    before = writes(cluster, namespace)
    services = [
        d for d in await cluster.list(SERVICE, namespace) if d["spec"]["poolRef"]["name"] == "h100-pool"
    ]
    classes = await cluster.list(CLASS, namespace)
    # Two more full passes, one by a fresh controller (nothing remembered): no write at all.
    for controller in (cluster.controller(), cluster.controller()):
        for _ in range(2):
            await asyncio.to_thread(
                controller.reconcile_pool, namespace, "h100-pool", services, classes, time.time()
            )
    assert writes(cluster, namespace)[len(before) :] == []


async def test_changing_pool_bounds_rescales(cluster: Harness) -> None:
    namespace = "rescale"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    status, _ = await settled(cluster, pool, ["llama-8b"])
    sts = f"h100-pool-{status['placement']['groups'][0]['name']}"
    assert (await cluster.children(namespace))[("StatefulSet", sts)]["spec"]["replicas"] == 4

    await cluster.patch(pool, {"spec": {"instances": {"min": 1, "max": 2}}})

    async def rescaled():
        children = await cluster.children(namespace)
        return children[("StatefulSet", sts)]["spec"]["replicas"] == 2

    await cluster.eventually(rescaled)
    body = await cluster.eventually(lambda: _replicas_are(cluster, pool, 2))
    assert body["status"]["placement"]["groups"][0]["replicas"]["interactive"] == 2


async def _replicas_are(h: Harness, doc: dict[str, Any], n: int) -> dict[str, Any] | None:
    body = await h.get(doc)
    return body if body and (body.get("status") or {}).get("replicas") == n else None


async def test_deleting_the_pool_cleans_up(cluster: Harness) -> None:
    namespace = "cleanup"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    await settled(cluster, pool, ["llama-8b"])

    await cluster.delete(pool)

    async def gone():
        return not await cluster.children(namespace) and await cluster.get(pool) is None

    await cluster.eventually(gone)


async def test_invalid_pool_sets_invalid_condition_and_event_and_creates_nothing(cluster: Harness) -> None:
    namespace = "invalid"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    pool = of_kind(docs, POOL)[0]
    pool["spec"]["instances"] = {"min": 3, "max": 1}
    await apply_all(cluster, docs)

    async def invalid():
        body = await cluster.get(pool)
        conditions = (body or {}).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Invalid" and c["status"] == "True"), None)

    found = await cluster.eventually(invalid)
    assert found["reason"] == "InvalidSpec"
    assert "instances" in found["message"] and "min" in found["message"]

    async def warned():
        events = await cluster.events(namespace)
        return any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events)

    await cluster.eventually(warned)
    await asyncio.sleep(1.0)  # several daemon ticks: still nothing
    assert await cluster.children(namespace) == {}


async def test_invalid_service_is_reported_and_left_out(cluster: Harness) -> None:
    namespace = "badsvc"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    service = of_kind(docs, SERVICE)[0]
    service["spec"]["requestClasses"] = []  # at least one class is required
    await apply_all(cluster, docs)

    async def invalid():
        body = await cluster.get(service)
        conditions = (body or {}).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Invalid" and c["status"] == "True"), None)

    found = await cluster.eventually(invalid)
    assert "requestClasses" in found["message"]
    assert not any(kind == "StatefulSet" for kind, _ in await cluster.children(namespace))


async def test_restarted_operator_resumes_without_duplicating_children(cluster: Harness) -> None:
    namespace = "restart"
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    _, children = await settled(cluster, pool, ["llama-8b"])
    await quiet(cluster, namespace)
    before = writes(cluster, namespace)

    await cluster.stop()
    await cluster.start()
    await asyncio.sleep(2.0)  # resume handlers and pool daemons of the new operator
    await quiet(cluster, namespace)

    # Read through the kubernetes client: kopf's shutdown closes aiohttp connectors in this process.
    kube = cluster.controller().kube
    after = await asyncio.to_thread(kube.list_children, namespace, {"tessera.dev/pool": "h100-pool"})
    assert {(o["kind"], o["metadata"]["name"]) for o in after} == set(children)
    new_writes = writes(cluster, namespace)[len(before) :]
    assert not [w for w in new_writes if w.startswith("POST")]
    assert not [w for w in new_writes if any(k in w for k in ("statefulsets", "configmaps", "/services/"))]

    # The new operator is alive: it rescales on a spec change.
    await asyncio.to_thread(
        kube.custom.patch_namespaced_custom_object,
        "tessera.dev",
        "v1alpha1",
        namespace,
        "servingpools",
        "h100-pool",
        {"spec": {"instances": {"min": 1, "max": 3}}},
        _content_type="application/merge-patch+json",
    )

    async def rescaled():
        found = await asyncio.to_thread(kube.list_children, namespace, {"tessera.dev/pool": "h100-pool"})
        return [o["spec"]["replicas"] for o in found if o["kind"] == "StatefulSet"] == [3]

    await cluster.eventually(rescaled)

    async def patched() -> bool:
        return any(
            e["reason"] == "Patched" and e["message"].startswith("StatefulSet ")
            for e in await cluster.events(namespace)
        )

    await cluster.eventually(patched)


async def test_api_errors_and_conflicts_are_retried(cluster: Harness) -> None:
    namespace = "flaky"
    sts_path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets"
    cm_path = f"/api/v1/namespaces/{namespace}/configmaps"
    # The first StatefulSet create fails with 500 after the emulator stored it (a lost response): the
    # retry meets 409 AlreadyExists and patches. The first ConfigMap create is throttled (429).
    cluster.emulator[f"post {sts_path}"][:1] << 500
    cluster.emulator[f"post {cm_path}"][:1] << 429
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    await apply_all(cluster, docs)
    pool = of_kind(docs, POOL)[0]
    status, children = await settled(cluster, pool, ["llama-8b"])

    assert len([k for k in children if k[0] == "StatefulSet"]) == 1
    posts = [w for w in writes(cluster, namespace) if w == f"POST {sts_path}"]
    assert len(posts) >= 2  # the failed attempt and its retry
    assert condition(status, "Placed")["status"] == "True"


def two_pools(namespace: str) -> list[dict[str, Any]]:
    """Pools ``pool-a`` and ``pool-b`` from the quickstart's pool; ``svc-a`` on pool-a uses class
    ``chat``, ``svc-b`` on pool-b uses class ``other`` (a copy of chat)."""
    docs = load_example(EXAMPLES / "quickstart.yaml", namespace)
    pool, service = of_kind(docs, POOL)[0], of_kind(docs, SERVICE)[0]
    chat = next(d for d in of_kind(docs, CLASS) if d["metadata"]["name"] == "chat")
    other = copy_doc(chat)
    other["metadata"] |= {"name": "other", "uid": str(uuid.uuid4())}
    made = [chat, other]
    for suffix, cls in (("a", "chat"), ("b", "other")):
        p, s = copy_doc(pool), copy_doc(service)
        p["metadata"] |= {"name": f"pool-{suffix}", "uid": str(uuid.uuid4())}
        p["spec"]["placement"] = {"strategy": "dedicated"}
        s["metadata"] |= {"name": f"svc-{suffix}", "uid": str(uuid.uuid4())}
        s["spec"] |= {"poolRef": {"name": f"pool-{suffix}"}, "requestClasses": [{"name": cls}]}
        if suffix == "b":  # a pool serves each model once
            s["spec"]["model"]["name"] = "Qwen/Qwen2.5-7B-Instruct"
        s["spec"]["defaultClass"] = cls
        made += [p, s]
    return made


def tessera_lists(h: Harness) -> list[str]:
    """The LIST calls the emulator saw for ServingPools, LLMServices and RequestClasses (kopf's watch
    streams start with one each; a handler listing them would add more)."""
    plurals = set(PLURALS.values())
    return [
        r.url.path
        for r in h.emulator
        if r.action == kmock.action.LIST and r.url.path.rsplit("/", 1)[-1] in plurals
    ]


async def pool_of(h: Harness, pool: dict[str, Any], services: set[str]) -> dict[str, Any] | None:
    """The pool's status once its plan places exactly ``services``."""
    body = await h.get(pool)
    groups = ((body or {}).get("status") or {}).get("placement", {}).get("groups")
    placed = {s for g in groups or [] for s in g["services"]}
    return body["status"] if body and groups is not None and placed == services else None


async def test_a_class_change_replans_exactly_the_pools_using_it_and_nothing_lists(
    cluster: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = "classes"
    docs = two_pools(namespace)
    passes: list[str] = []
    desired_pool = controller_module.desired_pool

    def recording(pool_body, *args, **kwargs):  # type: ignore[no-untyped-def]
        passes.append(pool_body["metadata"]["name"])
        return desired_pool(pool_body, *args, **kwargs)

    monkeypatch.setattr(controller_module, "desired_pool", recording)
    await apply_all(cluster, docs)
    pools = {p["metadata"]["name"]: p for p in of_kind(docs, POOL)}
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-a"], {"svc-a"}))
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-b"], {"svc-b"}))
    await quiet(cluster, namespace)
    lists = tessera_lists(cluster)
    before = len(passes)

    chat = next(d for d in docs if d["metadata"]["name"] == "chat")
    await cluster.patch(chat, {"spec": {"slo": {"ttftSeconds": 3}}})

    async def new_slo() -> bool:
        children = await cluster.children(namespace)
        configs = [v for (kind, name), v in children.items() if kind == "ConfigMap" and "pool-a" in name]
        worker = json.loads(configs[0]["data"][CONFIG_KEY])
        return worker["classes"]["chat"]["slo"]["ttftSeconds"] == 3

    await cluster.eventually(new_slo)
    await quiet(cluster, namespace)
    assert set(passes[before:]) == {"pool-a"}, passes[before:]
    # kopf's one list per kind at its start, and no list since: every pass read the indexes.
    assert tessera_lists(cluster) == lists
    assert not [path for path in lists if "/namespaces/" in path], lists


async def test_moving_a_service_replans_both_pools_and_deleting_one_replans_its_pool(
    cluster: Harness,
) -> None:
    namespace = "moves"
    docs = two_pools(namespace)
    await apply_all(cluster, docs)
    pools = {p["metadata"]["name"]: p for p in of_kind(docs, POOL)}
    services = {s["metadata"]["name"]: s for s in of_kind(docs, SERVICE)}
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-a"], {"svc-a"}))
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-b"], {"svc-b"}))

    await cluster.patch(
        services["svc-b"],
        {
            "spec": {
                "poolRef": {"name": "pool-a"},
                "requestClasses": [{"name": "chat"}],
                "defaultClass": "chat",
            }
        },
    )
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-a"], {"svc-a", "svc-b"}))
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-b"], set()))

    async def pool_b_empty() -> bool:
        children = await cluster.children(namespace)
        return not [k for k in children if k[0] == "StatefulSet" and "pool-b" in k[1]]

    await cluster.eventually(pool_b_empty)

    await cluster.delete(services["svc-a"])
    await cluster.eventually(lambda: pool_of(cluster, pools["pool-a"], {"svc-b"}))

    async def endpoint_gone() -> bool:
        return ("Service", "svc-a") not in await cluster.children(namespace)

    await cluster.eventually(endpoint_gone)
