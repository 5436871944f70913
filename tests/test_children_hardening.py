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
    (engine,) = engines  # one container holds the GPUs and runs every model's server
    assert engine["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
    }
    assert pod["securityContext"]["fsGroup"] == 1000  # the weight cache's claim is writable by it
    env = {e["name"]: e.get("value") for e in engine["env"]}
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert {env["HOME"], env["HF_HOME"], "/tmp"} <= mounts  # what vLLM writes, on volumes


@pytest.mark.parametrize("example", ["quickstart.yaml", "multi-model.yaml"])
def test_engine_runs_as_root_only_when_asked(example: str) -> None:
    bodies = [d.to_json() for d in load_documents(EXAMPLES / example)]
    for b in bodies:
        b["metadata"]["uid"] = "u"
    (pool,) = [b for b in bodies if b["kind"] == "ServingPool"]
    pool["spec"]["pod"] = {"engineSecurity": {"runAsRoot": True}}
    by_kind = {k: [b for b in bodies if b["kind"] == k] for k in ("LLMService", "RequestClass")}
    desired = desired_pool(pool, by_kind["LLMService"], by_kind["RequestClass"], None, 0.0)
    for sts in (c for c in desired.children if c["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert "fsGroup" not in pod["securityContext"]
        assert pod["containers"][1]["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
