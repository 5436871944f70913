"""The operator under kopf against KMock: a service the pool cannot place is reported on its own while
the others are served, and a re-placement keeps unchanged groups and drains a moved service's old group
only once its new group is ready (readiness set by hand, as the StatefulSet controller would)."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import pytest_asyncio
from test_operator_load_placement import class_body, pool_body
from test_operator_rollout import service

from tessera.bench.cluster import Harness, emulated_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest_asyncio.fixture(loop_scope="function")
async def cluster():
    async with emulated_cluster() as harness:
        yield harness


def in_namespace(docs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    out = copy.deepcopy(docs)
    for doc in out:
        doc["metadata"].update(namespace=namespace, resourceVersion="1")
    return out


async def stateful_sets(h: Harness, namespace: str) -> dict[str, dict[str, Any]]:
    """The StatefulSets by the services their pods serve ("a+b")."""
    found = {}
    for (kind, _), obj in (await h.children(namespace)).items():
        if kind == "StatefulSet":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            served = sorted(k.split("/", 1)[1] for k in labels if k.startswith("serves.tessera.dev/"))
            found["+".join(served)] = obj
    return found


async def set_ready(h: Harness, sts: dict[str, Any]) -> None:
    """Report every replica of a StatefulSet ready."""
    meta = sts["metadata"]
    path = f"/apis/apps/v1/namespaces/{meta['namespace']}/statefulsets/{meta['name']}"
    response = await h.session.patch(
        h.url + path,
        json={"status": {"readyReplicas": sts["spec"]["replicas"]}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()


async def resync(h: Harness, pool: dict[str, Any]) -> None:
    """One pool pass by the running operator now, rather than at its periodic resync (a minute away):
    an annotation changed on the pool marks it, as ``kubectl annotate`` would."""
    await h.patch(pool, {"metadata": {"annotations": {"test.tessera.dev/nudge": str(time.time_ns())}}})


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    conditions = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


async def test_the_pool_serves_the_good_service_and_reports_the_bad_one_until_it_is_fixed(
    cluster: Harness,
) -> None:
    namespace = "one-bad"
    good, bad = service("good", "org/good-8B"), service("bad", "org/bad-8B", tensorParallelSize=2)
    docs = in_namespace([pool_body(), class_body(), good, bad], namespace)
    for doc in docs:
        await cluster.create(doc)
    good, bad = docs[2], docs[3]

    sets = await cluster.eventually(lambda: stateful_sets(cluster, namespace))
    assert list(sets) == ["good"]
    await set_ready(cluster, sets["good"])

    async def good_ready():
        return condition(await cluster.get(good), "Ready").get("status") == "True"

    await resync(cluster, docs[0])
    await cluster.eventually(good_ready)

    async def bad_reported():
        placed = condition(await cluster.get(bad), "Placed")
        events = [
            e
            for e in await cluster.events(namespace)
            if e["involvedObject"]["name"] == "bad" and e["reason"] == "Unplaceable"
        ]
        return placed.get("reason") == "Unplaceable" and events and (placed, events)

    placed, events = await cluster.eventually(bad_reported)
    assert placed["status"] == "False" and "needs 2 GPUs per instance" in placed["message"]
    assert events[0]["type"] == "Warning"
    assert condition(await cluster.get(docs[0]), "Placed")["reason"] == "PartiallyPlaced"

    await cluster.patch(bad, {"spec": {"model": {"tensorParallelSize": 1}}})

    async def both_placed():
        sets = await stateful_sets(cluster, namespace)
        return set(sets) == {"bad", "good"} or "bad+good" in sets

    await cluster.eventually(both_placed)

    async def bad_placed():
        return condition(await cluster.get(bad), "Placed").get("status") == "True"

    await cluster.eventually(bad_placed)


async def test_a_replan_keeps_the_unchanged_group_and_drops_the_old_one_once_the_new_is_ready(
    cluster: Harness,
) -> None:
    namespace = "rollout"
    pool = pool_body()
    pool["spec"]["instances"] = {"min": 1, "max": 2}
    docs = in_namespace([pool, class_body(), *(service(n, f"org/{n}-8B") for n in "abc")], namespace)
    for doc in docs:
        await cluster.create(doc)

    async def placed():
        sets = await stateful_sets(cluster, namespace)
        return set(sets) == {"a+b", "a+c"} and sets

    sets = await cluster.eventually(placed)
    for sts in sets.values():
        await set_ready(cluster, sts)
    kept_name = sets["a+c"]["metadata"]["name"]
    old_name = sets["a+b"]["metadata"]["name"]

    async def pool_ready():
        return condition(await cluster.get(docs[0]), "Ready").get("status") == "True"

    await resync(cluster, docs[0])
    await cluster.eventually(pool_ready)
    before = {k: v for k, v in (await cluster.children(namespace)).items() if kept_name in k[1]}
    assert len(before) == 4

    # b's new revision is three times the size: it no longer fits beside a.
    await cluster.patch(docs[3], {"spec": {"model": {"weightsSize": "60Gi"}}})

    async def new_group():
        sets = await stateful_sets(cluster, namespace)
        return "b" in sets and sets

    sets = await cluster.eventually(new_group)
    assert set(sets) == {"a+b", "a+c", "b"}  # the old group still serves a and b

    async def rollout_event():
        events = [e for e in await cluster.events(namespace) if e["reason"] == "Rollout"]
        return events and events[0]["message"]

    message = await cluster.eventually(rollout_event)
    assert f"kept ['{kept_name.removeprefix('p-')}']" in message and "services moved ['a', 'b']" in message
    body = await cluster.get(docs[0])
    (retiring,) = body["status"]["placement"]["retiring"]
    assert retiring["services"] == ["a", "b"] and old_name.endswith(retiring["name"])

    await set_ready(cluster, sets["b"])

    async def old_gone():
        children = await cluster.children(namespace)
        return not [k for k in children if old_name in k[1]] and children

    children = await cluster.eventually(old_gone, timeout=20)  # polled every few seconds
    assert {k: v for k, v in children.items() if kept_name in k[1]} == before  # byte for byte

    async def reported():  # the pass writes status after its deletes: it may not have yet
        body = await cluster.get(docs[0])
        return body["status"]["placement"]["retiring"] == [] and body

    body = await cluster.eventually(reported, timeout=20)
    assert [g["services"] for g in body["status"]["placement"]["groups"]] == [["a", "c"], ["b"]]
