"""Worker pods are hardened: no API token, no privileges, a read-only root, bounded resources."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.control.pool_plan import desired_pool

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("example", ["quickstart.yaml", "multi-model.yaml"])
def test_worker_pods_are_hardened(example: str) -> None:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / example)]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    pools = [b for b in bodies if b["kind"] == "ServingPool"]
    services = [b for b in bodies if b["kind"] == "LLMService"]
    classes = [b for b in bodies if b["kind"] == "RequestClass"]
    desired = desired_pool(pools[0], services, classes, None, 0.0)
    (sts, *_) = [c for c in desired.children if c["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    worker, *engines = pod["containers"]
    ctx = worker["securityContext"]
    assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in worker["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert worker["resources"]["requests"]["memory"] and worker["resources"]["limits"]["memory"]
    for engine in engines:
        assert engine["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
