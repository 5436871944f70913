"""The worker pods the operator builds match the real worker: its command line, its HTTP routes, its
configuration model, and the sim-engine pools (``tessera.dev/engine: sim``) of clusters without GPUs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tessera.api.worker_config import parse_config
from tessera.cli import build_parser
from tessera.control.children import CONFIG_DIR, CONFIG_KEY, ENGINE_ANNOTATION
from tessera.control.pool_plan import PoolDesired, desired_pool
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent


def _decided(engine: str | None = None) -> PoolDesired:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "quickstart.yaml").read_text()) if d]
    for i, doc in enumerate(docs):
        doc["metadata"].update(namespace="ns", uid=f"uid-{i}")
        if engine is not None and doc["kind"] == "ServingPool":
            doc["metadata"]["annotations"] = {ENGINE_ANNOTATION: engine}
    pool = next(d for d in docs if d["kind"] == "ServingPool")
    decided = desired_pool(
        pool,
        [d for d in docs if d["kind"] == "LLMService"],
        [d for d in docs if d["kind"] == "RequestClass"],
        None,
        0.0,
    )
    assert isinstance(decided, PoolDesired), decided
    return decided


def _child(decided: PoolDesired, kind: str) -> dict[str, Any]:
    (found,) = [c for c in decided.children if c["kind"] == kind]
    return found


def _worker_container(decided: PoolDesired) -> dict[str, Any]:
    pod = _child(decided, "StatefulSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "worker")


def _worker_image_entrypoint() -> list[str]:
    """ENTRYPOINT of the Dockerfile's worker stage (the container sets args only)."""
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)
    worker = next(s for s in stages if s.split("\n", 1)[0].strip().endswith(" AS worker"))
    (line,) = [ln for ln in worker.splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


@pytest.mark.parametrize("engine", [None, "sim"])
def test_worker_container_command_is_the_real_cli(engine: str | None) -> None:
    decided = _decided(engine)
    container = _worker_container(decided)
    assert "command" not in container and _worker_image_entrypoint() == ["tessera"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "worker"
    assert args._module.__name__ == "tessera.commands.worker"
    # The config file is the ConfigMap's key, mounted where the argument points.
    assert str(args.config) == f"{CONFIG_DIR}/{CONFIG_KEY}"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
    config_map = _child(decided, "ConfigMap")
    assert CONFIG_KEY in config_map["data"]
    pod = _child(decided, "StatefulSet")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    # It listens on the port the probes, Services and scrape annotation name.
    (port,) = container["ports"]
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    assert _child(decided, "StatefulSet")["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"
    ] == str(args.port)
    # The kubelet's SIGKILL comes after the worker's own drain deadline.
    assert args.grace_seconds < pod["terminationGracePeriodSeconds"]


def test_probe_and_scrape_paths_are_routes_of_the_worker_app() -> None:
    decided = _decided()
    config = parse_config(json.loads(_child(decided, "ConfigMap")["data"][CONFIG_KEY]))
    app = create_app(Worker(config), manage_worker=False)
    served = {r.path for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods}
    container = _worker_container(decided)
    annotations = _child(decided, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    wanted = {
        container["livenessProbe"]["httpGet"]["path"],
        container["readinessProbe"]["httpGet"]["path"],
        annotations["prometheus.io/path"],
    }
    assert wanted <= served, wanted - served
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == container["ports"][0]["name"]


def test_sim_engine_pool_runs_workers_without_vllm_that_answer_their_probes() -> None:
    decided = _decided("sim")
    pod = _child(decided, "StatefulSet")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["worker"]
    worker = pod["containers"][0]
    group = decided.plan.groups[0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == str(group.tp)
    config = parse_config(json.loads(_child(decided, "ConfigMap")["data"][CONFIG_KEY]))
    assert [m.engine for m in config.models] == ["sim"] and all(m.url is None for m in config.models)
    # The generated configuration starts a real worker whose probe routes answer 200.
    with TestClient(create_app(Worker(config))) as http:
        for probe in ("livenessProbe", "readinessProbe"):
            assert http.get(worker[probe]["httpGet"]["path"]).status_code == 200
        metrics = http.get(
            _child(decided, "StatefulSet")["spec"]["template"]["metadata"]["annotations"][
                "prometheus.io/path"
            ]
        )
        assert metrics.status_code == 200 and b"tessera_inflight" in metrics.content


def test_unknown_engine_annotation_is_reported_with_the_choices_and_builds_nothing() -> None:
    decided = _decided("tgi")
    assert decided.children == []
    assert "use 'vllm' or 'sim'" in (decided.placement_problem or "")


def _meta_name(prefix: str, key: str) -> str:
    """Prometheus' discovery label for a Kubernetes label or annotation key."""
    return prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _queried_labels() -> set[str]:
    """The target labels the operator's Prometheus queries select on, plus ``pod``, whose ordinal
    gives a scraped worker its Chiron role (``snapshot_from_results``)."""
    from tessera.control.metrics_queries import group_queries

    up = group_queries("ns", "pool", "group", {}, "2m")["up"]
    return set(re.findall(r'(\w+)="', up)) | {"pod"}


def test_service_monitor_relabels_the_labels_the_operator_queries_from_the_headless_service() -> None:
    decided = _decided()
    monitor = yaml.safe_load((ROOT / "manifests" / "monitoring" / "servicemonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["endpoints"]
    sources = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert set(sources) == _queried_labels() == {"namespace", "pod", "pool", "group"}
    headless = next(
        c for c in decided.children if c["kind"] == "Service" and c["spec"].get("clusterIP") == "None"
    )
    service_labels = {
        _meta_name("__meta_kubernetes_service_label_", k) for k in headless["metadata"]["labels"]
    }
    assert sources["pool"][0] in service_labels and sources["group"][0] in service_labels
    assert sources["namespace"] == ["__meta_kubernetes_namespace"]
    assert sources["pod"] == ["__meta_kubernetes_pod_name"]
    assert endpoint["port"] in {p["name"] for p in headless["spec"]["ports"]}


def test_plain_prometheus_job_relabels_the_labels_the_operator_queries_from_the_pods() -> None:
    decided = _decided()
    jobs = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-scrape-config.yaml").read_text())
    (job,) = [j for j in jobs if j["job_name"] == "tessera-workers"]
    rules = job["relabel_configs"]
    targets = {r["target_label"]: r["source_labels"] for r in rules if "target_label" in r}
    assert _queried_labels() <= set(targets)
    template = _child(decided, "StatefulSet")["spec"]["template"]
    pod_meta = {
        _meta_name("__meta_kubernetes_pod_label_", k): v for k, v in template["metadata"]["labels"].items()
    }
    pod_meta |= {
        _meta_name("__meta_kubernetes_pod_annotation_", k): v
        for k, v in template["metadata"]["annotations"].items()
    }
    pod_meta["__meta_kubernetes_pod_container_port_name"] = _worker_container(decided)["ports"][0]["name"]
    for label in ("pool", "group"):
        assert targets[label][0] in pod_meta
    # Every keep rule lets the worker's port through.
    for rule in (r for r in rules if r.get("action") == "keep"):
        (source,) = rule["source_labels"]
        assert re.fullmatch(rule["regex"], pod_meta[source]), rule
    assert pod_meta[targets["__metrics_path__"][0]] == "/metrics"
