"""Cluster discovery: the router's backends from the operator's children, read from the API server.

Each placement group has a ConfigMap (``worker.json``: the worker configuration; ``placement.json``:
role counts and ``ordinalRoles``, each ordinal's role) and a StatefulSet whose pods ``<group
object>-<ordinal>`` carry the group's labels. A pod's role is its ordinal's
(``tessera.control.children``). Only running pods with an IP and a true Ready condition count.
A pod of a pool with ``kvEvents`` names its models' KV-event ports in its ``tessera.dev/kv-events``
annotation; each served model's becomes a ``kvEvents`` source ``tcp://POD_IP:PORT`` of its backend (the
block size left to the events). A port of a model the group's configuration no longer serves (a pod
from before a rollout) is left out, and so is an annotation that does not parse (logged).

Trust: labels are not proof (anyone who may create a pod can copy them, and would then receive other
users' prompts). Discovery reads only the namespaces it is given (the router's own by default), where
whoever may create pods is trusted with the workloads anyway; within them a group ConfigMap counts only
when its name is the group's and its controller is the ServingPool its labels name, and a pod only when
its controller is the group's StatefulSet and its name that StatefulSet's ``<name>-<ordinal>``. Every
other labelled object, and a group ConfigMap that does not parse, is skipped and counted
(``tessera_router_discovery_skipped``) instead of failing the listing.

A group whose services all scale to zero says so in ``placement.json`` (each model's LLMService and
idle policy); discovery lists it in ``Discovered.sleeping`` for the activator (``cluster_wake``), cold
when the operator scaled it to zero (no role), when its stopping pods are no backend.

``backends_from_cluster`` is pure; ``KubeDiscovery`` is the thin adapter that lists the objects.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.api import GROUP
from tessera.api.worker_config import WorkerConfig
from tessera.control.children import (
    GROUP_LABEL,
    KV_EVENTS_ANNOTATION,
    MANAGED_BY,
    MANAGER,
    POOL_LABEL,
    WORKER_PORT,
    ChildError,
    GroupConfigMap,
    SleepingModel,
    config_map_name,
    group_object_name,
    read_group_config_map,
)
from tessera.control.metrics_queries import pod_ordinal, role_of
from tessera.router.backends import Backend, KVEventsSource

log = logging.getLogger(__name__)
SELECTOR = f"{MANAGED_BY}={MANAGER},{GROUP_LABEL}"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return (
        status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    )


def _kv_events(pod: Mapping[str, Any], config: WorkerConfig) -> list[KVEventsSource]:
    """The KV-event publishers of a ready pod's served models, from its annotation (module docstring)."""
    meta = pod.get("metadata") or {}
    text = (meta.get("annotations") or {}).get(KV_EVENTS_ANNOTATION)
    if text is None:
        return []
    try:
        ports = json.loads(text)
        if not isinstance(ports, dict) or not all(type(p) is int and 1 <= p <= 65535 for p in ports.values()):
            raise ValueError("not a map of model names to ports")
    except ValueError as err:
        log.warning("discovery: pod %s has an invalid %s annotation (%s): no KV events from it",
                    meta.get("name"), KV_EVENTS_ANNOTATION, err)  # fmt: skip
        return []
    served = {m.name for m in config.models}
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod address is bracketed in a ZMQ endpoint
    return [
        KVEventsSource(model=model, endpoint=f"tcp://{host}:{port}")
        for model, port in sorted(ports.items())
        if model in served
    ]


@dataclass(frozen=True)
class SleepingGroup:
    """A group whose services all scale to zero, as the router's activator follows it: ``unit`` names it
    (``namespace/pool/group``); ``cold`` when the operator scaled it to zero (no pod role), ``ready``
    when one of its pods serves."""

    unit: str
    namespace: str
    config: WorkerConfig
    models: dict[str, SleepingModel]
    cold: bool
    ready: bool


@dataclass(frozen=True)
class Discovered:
    """The backends of one listing, the scale-to-zero groups and the objects it skipped, by (kind,
    reason)."""

    backends: list[Backend]
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)
    sleeping: list[SleepingGroup] = field(default_factory=list)
    # model -> the roles of its groups' ordinals that no ready pod serves yet (starting, or not yet
    # created): Chiron's dispatch holds batch work for a batch or mixed instance that is coming
    coming: dict[str, list[str]] = field(default_factory=dict)


def _controller(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    refs = meta.get("ownerReferences") or []
    return next((r for r in refs if isinstance(r, Mapping) and r.get("controller") is True), {})


def _group_key(meta: Mapping[str, Any]) -> tuple[str, str, str]:
    labels = meta.get("labels") or {}
    return (str(meta.get("namespace", "")), str(labels.get(POOL_LABEL, "")), str(labels.get(GROUP_LABEL, "")))


def _object_name(pool: str, group: str) -> str | None:
    try:
        return group_object_name(pool, group)
    except ChildError:
        return None


def _config_map_is_the_pools(meta: Mapping[str, Any], pool: str, group: str) -> bool:
    owner = _controller(meta)
    name = _object_name(pool, group)
    return (
        name is not None
        and meta.get("name") == config_map_name(pool, group)
        and owner.get("kind") == "ServingPool"
        and str(owner.get("apiVersion", "")).startswith(f"{GROUP}/")
        and owner.get("name") == pool
    )


def _pod_is_the_groups(meta: Mapping[str, Any], pool: str, group: str) -> bool:
    owner = _controller(meta)
    name = _object_name(pool, group)
    pod = str(meta.get("name", ""))
    return (
        name is not None
        and owner.get("kind") == "StatefulSet"
        and owner.get("name") == name
        and pod.startswith(f"{name}-")
        and pod[len(name) + 1 :].isdigit()
    )


def backends_from_cluster(
    config_maps: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    namespaces: frozenset[str] | None = None,
) -> Discovered:
    """The ready worker pods as backends, each with its group's worker configuration and its role.

    Only objects in ``namespaces`` (None: any) whose controllers are the group's count (module
    docstring); the others are skipped and counted by (kind, reason)."""
    skipped: Counter[tuple[str, str]] = Counter()
    groups: dict[tuple[str, str, str], GroupConfigMap] = {}
    for cm in config_maps:
        meta = cm.get("metadata") or {}
        key = _group_key(meta)
        if namespaces is not None and key[0] not in namespaces:
            skipped["ConfigMap", "namespace"] += 1
            continue
        try:
            read = read_group_config_map(cm)
        except ChildError as err:
            log.warning("discovery skips %s/%s: %s", key[0], meta.get("name"), err)
            skipped["ConfigMap", "invalid"] += 1
            continue
        if read is None:
            continue
        if not _config_map_is_the_pools(meta, key[1], key[2]):
            skipped["ConfigMap", "not-owned"] += 1
            continue
        groups[key] = read
    backends: list[Backend] = []
    serving: set[tuple[str, str, str]] = set()  # groups with a ready pod
    ready_ordinals: dict[tuple[str, str, str], set[int | None]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        key = _group_key(meta)
        if namespaces is not None and key[0] not in namespaces:
            skipped["Pod", "namespace"] += 1
            continue
        if not _pod_is_the_groups(meta, key[1], key[2]):
            skipped["Pod", "not-owned"] += 1
            continue
        if key not in groups:
            skipped["Pod", "no-group-config"] += 1
            continue
        config, roles = groups[key].config, groups[key].roles
        # A group scaled to zero: its pods are stopping, and its requests are held until it wakes.
        if not _ready(pod) or not roles:
            continue
        # An ordinal past the role list (scaling in progress) serves as mixed: it takes both kinds.
        ordinal = pod_ordinal(meta.get("name", ""))
        role = role_of(ordinal, roles) or "mixed"
        serving.add(key)
        ready_ordinals.setdefault(key, set()).add(ordinal)
        backends.append(
            Backend(
                name=f"{key[0]}/{meta['name']}",
                url=f"http://{pod['status']['podIP']}:{WORKER_PORT}",
                role=role,
                config=config,
                kv_events=_kv_events(pod, config),
            )
        )
    sleeping = [
        SleepingGroup(
            unit="/".join(key),
            namespace=key[0],
            config=read.config,
            models=read.sleeping,
            cold=not read.roles,
            ready=key in serving,
        )
        for key, read in sorted(groups.items())
        if read.sleeping
    ]
    coming: dict[str, list[str]] = {}
    for key, read in sorted(groups.items()):
        waiting = [r for i, r in enumerate(read.roles) if i not in ready_ordinals.get(key, set())]
        for model in read.config.models if waiting else ():
            coming.setdefault(model.name, []).extend(waiting)
    return Discovered(sorted(backends, key=lambda b: b.name), dict(skipped), sleeping, coming)


class _SkippedCollector(Collector):
    """The objects the last listing skipped, read at scrape time."""

    def __init__(self, discovery: KubeDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "tessera_router_discovery_skipped",
            "Labelled objects the last discovery left out (kind; reason: namespace, not-owned, invalid, "
            "no-group-config).",
            labels=["kind", "reason"],
        )
        for (kind, reason), count in sorted(self.discovery.skipped.items()):
            gauge.add_metric([kind, reason], float(count))
        yield gauge


def kube_client() -> Any:
    """The Kubernetes client module, configured from the pod's service account (else the kubeconfig)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client


class KubeDiscovery:
    """Lists the operator's group ConfigMaps and worker pods in the namespaces it serves (None: all)."""

    def __init__(self, namespaces: Sequence[str] | None, core: Any = None) -> None:
        self.core = core if core is not None else kube_client().CoreV1Api()
        self.namespaces = None if namespaces is None else tuple(dict.fromkeys(namespaces))
        self.skipped: dict[tuple[str, str], int] = {}

    def _list(self, what: str) -> list[dict[str, Any]]:
        if self.namespaces is None:
            call = getattr(self.core, f"list_{what}_for_all_namespaces")
            response = call(label_selector=SELECTOR, _preload_content=False)
            return json.loads(response.data).get("items", [])
        items: list[dict[str, Any]] = []
        for namespace in self.namespaces:
            call = getattr(self.core, f"list_namespaced_{what}")
            response = call(namespace=namespace, label_selector=SELECTOR, _preload_content=False)
            items += json.loads(response.data).get("items", [])
        return items

    def discover(self) -> Discovered:
        """The current backends and scale-to-zero groups (the skipped objects are kept for ``/metrics``)."""
        scope = None if self.namespaces is None else frozenset(self.namespaces)
        found = backends_from_cluster(self._list("config_map"), self._list("pod"), scope)
        self.skipped = found.skipped
        return found

    def collector(self) -> Collector:
        """A Prometheus collector of what the last listing skipped."""
        return _SkippedCollector(self)


def own_namespace(path: Path = SERVICE_ACCOUNT_NAMESPACE) -> str | None:
    """The namespace the router's pod runs in (its service account's); None outside a cluster."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
