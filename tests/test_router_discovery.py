"""Cluster discovery reads the operator's own children: worker config and roles from the group
ConfigMap, ready pods by ordinal, and with the pool's kvEvents each pod's KV-event publishers."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

from test_children_gpu_pods import engine_servers

from tessera.api import load_documents
from tessera.control.children import desired_children
from tessera.control.pool_plan import desired_pool
from tessera.core.planners import Role, RoleCounts
from tessera.router.discovery import backends_from_cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _rendered(
    kv_events: bool = False, roles: tuple[Role, ...] = ("interactive", "mixed", "batch")
) -> tuple[list[dict], dict]:
    """The quickstart's group ConfigMaps and StatefulSet as the operator writes them (``kv_events``:
    the pool's kvEvents), its pods running ``roles`` by ordinal."""
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    if kv_events:
        bodies[0]["spec"]["kvEvents"] = True
    desired = desired_pool(bodies[0], bodies[3:], bodies[1:3], None, 0.0)
    (group,) = desired.plan.groups
    group = replace(group, replicas=RoleCounts(**Counter(roles)), roles=roles)
    children = desired_children(desired.pool, [group], desired.services, desired.configs, "ns")
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    return [c for c in children if c["kind"] == "ConfigMap"], sts


def _children(roles: tuple[Role, ...] = ("interactive", "mixed", "batch")) -> tuple[list[dict], str]:
    config_maps, sts = _rendered(roles=roles)
    return config_maps, sts["metadata"]["name"]


def _pod(
    name: str,
    labels: dict,
    ip: str,
    ready: bool = True,
    owner: str | None = None,
    annotations: dict | None = None,
) -> dict:
    """A pod as the StatefulSet controller makes it (``owner``: its StatefulSet, by default the name
    without the ordinal; ``annotations``: its template's)."""
    sts = owner if owner is not None else name.rsplit("-", 1)[0]
    refs = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts, "uid": "s", "controller": True}]
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels, "ownerReferences": refs,
                     "annotations": dict(annotations or {})},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def test_ready_pods_become_backends_with_roles_by_ordinal() -> None:
    config_maps, sts = _children()
    labels = config_maps[0]["metadata"]["labels"]
    pods = [
        _pod(f"{sts}-0", labels, "10.0.0.1"),
        _pod(f"{sts}-1", labels, "10.0.0.2"),
        _pod(f"{sts}-2", labels, "10.0.0.3"),
        _pod(f"{sts}-3", labels, "10.0.0.4", ready=False),  # not ready: left out
        _pod("stranger-0", {**labels, "tessera.dev/group": "other"}, "10.0.0.5"),  # no ConfigMap
    ]
    found = backends_from_cluster(config_maps, pods)
    backends = found.backends
    assert found.skipped == {("Pod", "not-owned"): 1}  # stranger-0 is no StatefulSet's group pod
    assert [(b.url, b.role) for b in backends] == [
        ("http://10.0.0.1:8000", "interactive"),
        ("http://10.0.0.2:8000", "mixed"),
        ("http://10.0.0.3:8000", "batch"),
    ]
    expected = json.loads(config_maps[0]["data"]["worker.json"])
    assert backends[0].config.to_json() == expected
    assert found.coming == {}  # every planned ordinal serves


def test_planned_ordinals_without_a_ready_pod_are_coming() -> None:
    """A batch pod the autoscaler added that is still starting (or not yet created) is named as coming,
    so that the router's batch hold waits for it instead of lending interactive room."""
    config_maps, sts = _children(roles=("interactive", "interactive", "batch", "mixed"))
    labels = config_maps[0]["metadata"]["labels"]
    pods = [_pod(f"{sts}-0", labels, "10.0.0.1"), _pod(f"{sts}-2", labels, "10.0.0.3", ready=False)]
    found = backends_from_cluster(config_maps, pods)
    (model,) = {m.name for b in found.backends for m in b.config.models}
    assert found.coming == {model: ["interactive", "batch", "mixed"]}


def test_pods_take_the_role_the_config_map_gives_their_ordinal() -> None:
    """After scaling, pods keep their roles out of the interactive-mixed-batch order: a batch pod at
    ordinal 0 is routed as batch."""
    config_maps, sts = _children(roles=("batch", "interactive", "mixed"))
    labels = config_maps[0]["metadata"]["labels"]
    pods = [_pod(f"{sts}-{i}", labels, f"10.0.0.{i + 1}") for i in range(3)]
    backends = backends_from_cluster(config_maps, pods).backends
    assert [b.role for b in backends] == ["batch", "interactive", "mixed"]


def test_a_group_config_map_is_read_back_as_written_and_a_broken_one_is_named() -> None:
    import pytest

    from tessera.control.children import ChildError, read_group_config_map

    (cm, *_), _ = _children()
    read = read_group_config_map(cm)
    assert read is not None and read.roles == ["interactive", "mixed", "batch"] and read.config.models
    assert read.sleeping == {}
    assert read_group_config_map({"metadata": {"name": "other"}, "data": {"x": "1"}}) is None
    broken = {"metadata": {"name": "g-config"}, "data": {**cm["data"], "worker.json": "{not json"}}
    with pytest.raises(ChildError, match=r"ConfigMap g-config: invalid worker\.json"):
        read_group_config_map(broken)
    placement = json.loads(cm["data"]["placement.json"])
    older = {**placement, "roles": {"interactive": 1, "batch": 2}}
    del older["ordinalRoles"]  # written before pods kept their roles: the counts in role order
    read = read_group_config_map({**cm, "data": {**cm["data"], "placement.json": json.dumps(older)}})
    assert read is not None and read.roles == ["interactive", "batch", "batch"]
    wrong = {**placement, "ordinalRoles": ["interactive", "gpu", "batch"]}
    with pytest.raises(ChildError, match="roles must be a list of interactive, mixed, batch"):
        read_group_config_map({**cm, "data": {**cm["data"], "placement.json": json.dumps(wrong)}})


def test_forged_and_broken_objects_are_skipped_and_counted_not_routed_to() -> None:
    """Labels prove nothing: a pod or ConfigMap with the group's labels but not made by the group's
    StatefulSet or ServingPool, or outside the served namespaces, never becomes a backend, and a
    broken ConfigMap does not stop the other groups from being discovered."""
    import copy

    config_maps, sts = _children()
    labels = config_maps[0]["metadata"]["labels"]
    forged_cm = copy.deepcopy(config_maps[0])
    forged_cm["metadata"]["ownerReferences"] = []
    broken = copy.deepcopy(config_maps[0])
    broken["metadata"] |= {"name": "other-g9-worker", "labels": {**labels, "tessera.dev/group": "g9"}}
    broken["data"]["worker.json"] = "{not json"
    elsewhere = copy.deepcopy(config_maps[0])
    elsewhere["metadata"]["namespace"] = "tenant"
    pods = [
        _pod(f"{sts}-0", labels, "10.0.0.1"),
        _pod(f"{sts}-7", labels, "10.6.6.6", owner="tenant-sts"),  # not the group's StatefulSet
        _pod("impostor-0", labels, "10.6.6.7", owner=sts),  # claims the StatefulSet, wrong name
        {
            **_pod(f"{sts}-1", labels, "10.6.6.8"),
            "metadata": {"name": f"{sts}-1", "namespace": "ns", "labels": labels},
        },
    ]
    found = backends_from_cluster([broken, config_maps[0], elsewhere], pods, frozenset({"ns"}))
    assert [b.url for b in found.backends] == ["http://10.0.0.1:8000"]
    assert found.skipped == {
        ("ConfigMap", "invalid"): 1,
        ("ConfigMap", "namespace"): 1,
        ("Pod", "not-owned"): 3,
    }
    # Without its owner the group's ConfigMap itself is refused, and with it the group's pods.
    found = backends_from_cluster([forged_cm], pods[:1])
    assert found.backends == []
    assert found.skipped == {("ConfigMap", "not-owned"): 1, ("Pod", "no-group-config"): 1}


class _Core:
    """The two list calls of the CoreV1Api, answering per namespace and recording which were asked."""

    def __init__(self, objects: dict[str, dict[str, list[dict]]]) -> None:
        self.objects = objects
        self.asked: list[str] = []

    def _answer(self, items: list[dict]) -> object:
        return type("R", (), {"data": json.dumps({"items": items}).encode()})()

    def list_namespaced_config_map(self, namespace: str, **_: object) -> object:
        self.asked.append(namespace)
        return self._answer(self.objects.get(namespace, {}).get("cm", []))

    def list_namespaced_pod(self, namespace: str, **_: object) -> object:
        self.asked.append(namespace)
        return self._answer(self.objects.get(namespace, {}).get("pod", []))


def test_kube_discovery_lists_only_its_namespaces_and_metrics_show_what_it_skipped() -> None:
    from fastapi.testclient import TestClient

    from tessera.router.app import RouterState, create_router_app
    from tessera.router.discovery import KubeDiscovery, own_namespace

    config_maps, sts = _children()
    labels = config_maps[0]["metadata"]["labels"]
    broken = {**config_maps[0], "data": {**config_maps[0]["data"], "placement.json": "[]"}}
    core = _Core(
        {
            "ns": {"cm": [broken], "pod": [_pod(f"{sts}-0", labels, "10.0.0.1", ready=False)]},
            "tenant": {"cm": config_maps, "pod": [_pod(f"{sts}-0", labels, "10.6.6.6")]},
        }
    )
    discovery = KubeDiscovery(["ns", "ns"], core=core)
    app = create_router_app(RouterState([]), discover=discovery.discover, poll_interval_s=60)
    app.state.metrics.registry.register(discovery.collector())
    with TestClient(app) as http:
        text = http.get("/metrics").text
        assert http.get("/router/status").json()["instances"] == []
    assert set(core.asked) == {"ns"}
    assert 'tessera_router_discovery_skipped{kind="ConfigMap",reason="invalid"} 1.0' in text
    assert 'tessera_router_discovery_skipped{kind="Pod",reason="no-group-config"} 1.0' in text
    assert own_namespace(Path("/nonexistent")) is None


def test_kv_event_publishers_of_a_kv_events_pool_are_discovered_per_pod_and_model() -> None:
    """A pool with kvEvents: each ready pod's backend lists tcp://POD_IP:PORT for every model its
    group serves, at the port the operator launched that model's vLLM with (block size left to the
    events); the router's precise-prefix route subscribes to exactly these. A pool without it, a
    port of a model the group no longer serves, and a broken annotation give no publisher."""
    import copy

    from tessera.control.children import KV_EVENTS_ANNOTATION, KV_EVENTS_BASE_PORT
    from tessera.router.app import RouterState

    config_maps, sts = _rendered(kv_events=True)
    template = sts["spec"]["template"]
    name, labels, annotations = (
        sts["metadata"]["name"],
        template["metadata"]["labels"],
        template["metadata"]["annotations"],
    )
    engine = next(c for c in template["spec"]["containers"] if c["name"] == "engine")
    launched = {  # model -> the port its vLLM's --kv-events-config binds, read from the engine's args
        args[args.index("--served-model-name") + 1]: int(
            json.loads(args[args.index("--kv-events-config") + 1])["endpoint"].rsplit(":", 1)[1]
        )
        for args in engine_servers(engine)
    }
    models = [m["name"] for m in json.loads(config_maps[0]["data"]["worker.json"])["models"]]
    assert sorted(launched) == sorted(models) and min(launched.values()) == KV_EVENTS_BASE_PORT
    pods = [
        _pod(f"{name}-0", labels, "10.0.0.1", annotations=annotations),
        _pod(f"{name}-1", labels, "10.0.0.2", annotations=annotations),
        _pod(f"{name}-2", labels, "10.0.0.3", ready=False, annotations=annotations),
    ]
    found = backends_from_cluster(config_maps, pods)
    assert found.skipped == {}
    feeds = {b.url: [(s.model, s.endpoint, s.block_size) for s in b.kv_events] for b in found.backends}
    assert feeds == {
        f"http://{ip}:8000": sorted((m, f"tcp://{ip}:{port}", None) for m, port in launched.items())
        for ip in ("10.0.0.1", "10.0.0.2")
    }
    # the router's precise-prefix route follows exactly these: one feed per (instance, model)
    state = RouterState(found.backends, route="precise-prefix")
    assert state.feeds == {
        (f"ns/{name}-{i}", model): f"tcp://10.0.0.{i + 1}:{port}"
        for i in (0, 1)
        for model, port in launched.items()
    }

    # a pool without kvEvents: same pods, no publishers
    plain_maps, plain_sts = _rendered()
    plain = plain_sts["spec"]["template"]["metadata"]["annotations"]
    assert KV_EVENTS_ANNOTATION not in plain
    found = backends_from_cluster(plain_maps, [_pod(f"{name}-0", labels, "10.0.0.1", annotations=plain)])
    assert [b.kv_events for b in found.backends] == [[]]

    # a pod from before a rollout names a model the group no longer serves: only the served ones count
    stale = copy.deepcopy(annotations)
    stale[KV_EVENTS_ANNOTATION] = json.dumps({**launched, "org/retired": KV_EVENTS_BASE_PORT + 7})
    broken = {**annotations, KV_EVENTS_ANNOTATION: json.dumps({models[0]: "8200"})}
    found = backends_from_cluster(
        config_maps,
        [
            _pod(f"{name}-0", labels, "10.0.0.1", annotations=stale),
            _pod(f"{name}-1", labels, "10.0.0.2", annotations=broken),
        ],
    )
    by_url = {b.url: b for b in found.backends}
    assert sorted(s.model for s in by_url["http://10.0.0.1:8000"].kv_events) == sorted(models)
    assert by_url["http://10.0.0.2:8000"].kv_events == []  # a port that is no number: still routed to
