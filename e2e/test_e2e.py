"""Tessera on a real cluster, GPU-less: the quickstart with simulated-engine workers, reached through
the router Service. Run by e2e/run.sh, or against any KUBECONFIG where Tessera (manifests/ and
manifests/router-cluster-wide/) is installed, so that the router discovers in every namespace
(``--all-namespaces``; the tests make a namespace of their own): ``KUBECONFIG=... pytest e2e``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from e2e_support import kubectl_json, run_kubectl

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = f"tessera-e2e-{uuid.uuid4().hex[:6]}"
WORKER_IMAGE = os.environ.get("TESSERA_E2E_WORKER_IMAGE", "ghcr.io/tessera-dev/tessera-operator:0.1.0")


def _quickstart_sim() -> str:
    """The quickstart with its pool on the simulated engine and the e2e worker image."""
    docs = list(yaml.safe_load_all((ROOT / "examples" / "quickstart.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "ServingPool":
            doc["metadata"]["annotations"] = {"tessera.dev/engine": "sim"}
            doc["spec"]["images"] = {"worker": WORKER_IMAGE, "pullPolicy": "IfNotPresent"}
            doc["spec"]["instances"] = {"min": 1, "max": 2}
    return yaml.safe_dump_all(docs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def applied() -> Iterator[str]:
    run_kubectl("create", "namespace", NAMESPACE)
    try:
        run_kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=_quickstart_sim())
        yield NAMESPACE
    finally:
        run_kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def endpoint(applied: str) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [*run_kubectl.base(), "-n", "tessera-system", "port-forward", "svc/tessera-router", f"{port}:80"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait(what: str, check: object, timeout_s: float = 300.0) -> object:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()  # type: ignore[operator]
        if last:
            return last
        time.sleep(3)
    raise AssertionError(f"timed out waiting for {what} (last seen: {last})")


def test_operator_places_the_pool_on_the_fake_gpu_nodes(applied: str) -> None:
    def ready_sets() -> list[dict]:
        sets = kubectl_json("get", "statefulsets", "-n", applied)["items"]
        return [s for s in sets if s["status"].get("readyReplicas", 0) >= 1]

    (sts,) = _wait("a ready worker StatefulSet", ready_sets)  # type: ignore[misc]
    pods = kubectl_json(
        "get",
        "pods",
        "-n",
        applied,
        "-l",
        f"tessera.dev/group={sts['metadata']['labels']['tessera.dev/group']}",
    )
    nodes = {n["metadata"]["name"]: n for n in kubectl_json("get", "nodes")["items"]}
    for pod in pods["items"]:
        node = nodes[pod["spec"]["nodeName"]]
        assert node["metadata"]["labels"].get("cloud.google.com/gke-accelerator") == "nvidia-h100-80gb"
        assert [c["name"] for c in pod["spec"]["containers"]] == ["worker"]  # sim engine: no vLLM


def test_router_streams_interactive_and_batch_requests(endpoint: str, applied: str) -> None:
    _wait("the router to see a ready instance",
          lambda: httpx.get(f"{endpoint}/ready", timeout=5).status_code == 200)  # fmt: skip
    model = httpx.get(f"{endpoint}/v1/models", timeout=5).json()["data"][0]["id"]
    for header, n in (("chat", 8), ("batch", 5)):
        body = {"model": model, "prompt": "hello", "max_tokens": n, "stream": True}
        with httpx.stream("POST", f"{endpoint}/v1/completions", json=body, timeout=60,
                          headers={"X-Tessera-Class": header}) as resp:  # fmt: skip
            assert resp.status_code == 200
            chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
        assert sum(c["choices"][0]["finish_reason"] is None for c in chunks) == n


def test_llmservice_reports_ready(applied: str) -> None:
    def ready() -> bool:
        svc = kubectl_json("get", "llmservices", "llama-8b", "-n", applied)
        conds = {c["type"]: c["status"] for c in svc.get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    _wait("LLMService llama-8b Ready", ready)
