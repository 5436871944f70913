"""Cluster discovery reads the operator's own children: worker config and roles from the group
ConfigMap, ready pods by ordinal."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tessera.api import load_documents
from tessera.control.children import desired_children
from tessera.control.pool_plan import desired_pool
from tessera.core.planners import RoleCounts
from tessera.router.discovery import backends_from_cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _children() -> tuple[list[dict], str]:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    desired = desired_pool(bodies[0], bodies[3:], bodies[1:3], None, 0.0)
    (group,) = desired.plan.groups
    group = replace(group, replicas=RoleCounts(interactive=1, mixed=1, batch=1))
    children = desired_children(desired.pool, [group], desired.services, desired.configs, "ns")
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    return [c for c in children if c["kind"] == "ConfigMap"], sts["metadata"]["name"]


def _pod(name: str, labels: dict, ip: str, ready: bool = True) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
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
    backends = backends_from_cluster(config_maps, pods)
    assert [(b.url, b.role) for b in backends] == [
        ("http://10.0.0.1:8000", "interactive"),
        ("http://10.0.0.2:8000", "mixed"),
        ("http://10.0.0.3:8000", "batch"),
    ]
    expected = json.loads(config_maps[0]["data"]["worker.json"])
    assert backends[0].config.to_json() == expected


def test_a_group_config_map_is_read_back_as_written_and_a_broken_one_is_named() -> None:
    import pytest

    from tessera.control.children import ChildError, read_group_config_map

    (cm, *_), _ = _children()
    config, roles = read_group_config_map(cm)
    assert roles == ["interactive", "mixed", "batch"] and config.models
    assert read_group_config_map({"metadata": {"name": "other"}, "data": {"x": "1"}}) is None
    broken = {"metadata": {"name": "g-config"}, "data": {**cm["data"], "worker.json": "{not json"}}
    with pytest.raises(ChildError, match=r"ConfigMap g-config: invalid worker\.json"):
        read_group_config_map(broken)
