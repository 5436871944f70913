"""Cluster discovery: the router's backends from the operator's children, read from the API server.

Each placement group has a ConfigMap (``worker.json``: the worker configuration; ``placement.json``:
role counts) and a StatefulSet whose pods ``<group object>-<ordinal>`` carry the group's labels. A
pod's role follows from its ordinal the way the operator orders them (interactive, then mixed, then
batch; ``tessera.control.children``). Only running pods with an IP and a true Ready condition count.

``backends_from_cluster`` is pure; ``KubeDiscovery`` is the thin adapter that lists the objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tessera.api.worker_config import WorkerConfig
from tessera.control.children import (
    GROUP_LABEL,
    MANAGED_BY,
    MANAGER,
    POOL_LABEL,
    WORKER_PORT,
    read_group_config_map,
)
from tessera.router.backends import Backend

SELECTOR = f"{MANAGED_BY}={MANAGER},{GROUP_LABEL}"


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return (
        status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    )


def _ordinal(name: str) -> int | None:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def backends_from_cluster(
    config_maps: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[Backend]:
    """The ready worker pods as backends, each with its group's worker configuration and its role."""
    groups: dict[tuple[str, str, str], tuple[WorkerConfig, list[str]]] = {}
    for cm in config_maps:
        meta = cm.get("metadata") or {}
        labels = meta.get("labels") or {}
        read = read_group_config_map(cm)
        if read is None:
            continue
        key = (meta.get("namespace", ""), labels.get(POOL_LABEL, ""), labels.get(GROUP_LABEL, ""))
        groups[key] = read
    backends: list[Backend] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        key = (meta.get("namespace", ""), labels.get(POOL_LABEL, ""), labels.get(GROUP_LABEL, ""))
        if key not in groups or not _ready(pod):
            continue
        config, roles = groups[key]
        ordinal = _ordinal(meta.get("name", ""))
        # An ordinal past the role list (scaling in progress) serves as mixed: it takes both kinds.
        role = roles[ordinal] if ordinal is not None and ordinal < len(roles) else "mixed"
        backends.append(
            Backend(
                name=f"{key[0]}/{meta['name']}",
                url=f"http://{pod['status']['podIP']}:{WORKER_PORT}",
                role=role,
                config=config,
            )
        )
    return sorted(backends, key=lambda b: b.name)


class KubeDiscovery:
    """Lists the operator's group ConfigMaps and worker pods (one namespace, or all)."""

    def __init__(self, namespace: str | None) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core = client.CoreV1Api()
        self.namespace = namespace

    def _list(self, what: str) -> list[dict[str, Any]]:
        if self.namespace is None:
            call = getattr(self.core, f"list_{what}_for_all_namespaces")
            response = call(label_selector=SELECTOR, _preload_content=False)
        else:
            call = getattr(self.core, f"list_namespaced_{what}")
            response = call(namespace=self.namespace, label_selector=SELECTOR, _preload_content=False)
        return json.loads(response.data).get("items", [])

    def backends(self) -> list[Backend]:
        """The current backends."""
        return backends_from_cluster(self._list("config_map"), self._list("pod"))
