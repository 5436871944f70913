"""The worker pods of a GPU cluster: one engine container holds the instance's GPUs and runs one vLLM
server per placed model (1, 2 and 3 models, tensor parallel size 1 and 2), co-located servers split
the GPU memory as the placement's KV split says and start with sleep mode; resources, /dev/shm, the
weight cache, the hub token, probes, topology spread and the PodDisruptionBudget come from the pool;
the engine's supervisor really starts the servers and drains them after the worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tessera.api import LLMService, RequestClass, ServingPool, SpecError, load_documents
from tessera.api.base import parse_quantity
from tessera.api.worker_config import ProfileSpec, WorkerConfig
from tessera.control import children
from tessera.control.inputs import service_input
from tessera.control.pool_plan import PoolDesired, desired_pool
from tessera.core.planners import GroupPlan
from tessera.core.planners.types import RoleCounts
from tessera.worker.runtime import Worker

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = ("llama-8b", "mistral-7b", "qwen-7b")


def _pool(tp: int, pod: Mapping[str, Any] | None = None, **spec: Any) -> ServingPool:
    return ServingPool.model_validate(
        {
            "metadata": {"name": "gpus", "uid": "pool-uid"},
            "spec": spec
            | {
                "gpu": {"type": "H100", "perInstance": tp, "memory": "80Gi"},
                "instances": {"max": 8},
                "placement": {"maxServicesPerGroup": 3},
                "pod": dict(pod or {}),
            },
        }
    )


def _services() -> dict[str, LLMService]:
    return {
        name: LLMService.model_validate(
            {
                "metadata": {"name": name, "uid": f"{name}-uid"},
                "spec": {
                    "model": {"name": f"org/{name}", "weightsSize": "16Gi", "maxModelLength": 4096},
                    "poolRef": {"name": "gpus"},
                    "requestClasses": [{"name": "chat"}],
                },
            }
        )
        for name in MODELS
    }


CLASSES = {
    "chat": RequestClass.model_validate(
        {"metadata": {"name": "chat"}, "spec": {"slo": {"ttftSeconds": 1}}}
    ).spec
}


def _render(models: int, tp: int, pod: Mapping[str, Any] | None = None, **spec: Any) -> tuple[Any, ...]:
    pool, services = _pool(tp, pod, **spec), _services()
    group = GroupPlan("g", MODELS[:models], tp, RoleCounts(interactive=2))
    config = children.worker_config(pool, group, services, CLASSES)
    sts = children.stateful_set(pool, group, services, config, "ns")
    return pool, group, services, config, sts["spec"]["template"]["spec"]


def engine_servers(engine: Mapping[str, Any]) -> list[list[str]]:
    """Each model server's vLLM arguments in an engine container (separated by SERVER_SEPARATOR)."""
    servers: list[list[str]] = [[]]
    for arg in engine["args"]:
        if arg == children.SERVER_SEPARATOR:
            servers.append([])
        else:
            servers[-1].append(arg)
    return servers


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("models", [1, 2, 3])
def test_one_engine_container_holds_the_gpus_and_runs_every_model(models: int, tp: int) -> None:
    pool, group, services, config, pod = _render(models, tp)
    gpu_holders = [
        c for c in pod["containers"] if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
    ]
    (engine,) = gpu_holders
    assert engine["name"] == "engine" and engine["image"] == pool.spec.images.vllm
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == str(tp)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    servers = engine_servers(engine)
    assert len(servers) == models
    memory = children.memory_plan(pool, group, services)
    shares = []
    for index, (args, entry) in enumerate(zip(servers, config.models, strict=True)):
        port = children.VLLM_BASE_PORT + index
        assert _flag(args, "--port") == str(port) and entry.url == f"http://127.0.0.1:{port}"
        assert _flag(args, "--served-model-name") == entry.name == f"org/{MODELS[index]}"
        assert _flag(args, "--tensor-parallel-size") == str(tp)
        share = _flag(args, "--gpu-memory-utilization")
        planned = memory[MODELS[index]]
        assert entry.kv_capacity_tokens == planned.kv_capacity_tokens
        # The pod's policies estimate with the step times the placement planned with, at the group's TP.
        profile = service_input(pool, services[MODELS[index]]).profile.at_tp(tp)
        assert entry.profile == ProfileSpec.from_profile(profile) != ProfileSpec()
        if models == 1:
            assert share is None and "--enable-sleep-mode" not in args and entry.sleep_mode == "off"
        else:
            assert share is not None and float(share) == planned.gpu_memory_utilization
            shares.append(float(share))
            assert "--enable-sleep-mode" in args and entry.sleep_mode == "auto"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert ("VLLM_SERVER_DEV_MODE" in env) == (models > 1)
    if models > 1:
        # the processes' shares fit the pool's budget (vLLM's default 0.9) and each holds its weights
        assert 0.85 < sum(shares) <= 0.9
        weights = parse_quantity("16Gi") / tp / parse_quantity("80Gi")
        assert all(s > weights for s in shares)
    # the engine is Ready only when every model server answers /health
    ports = [str(children.VLLM_BASE_PORT + i) for i in range(models)]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = engine[probe]["exec"]["command"]
        assert command[:2] == ["python3", "-c"] and command[3:] == ports


@pytest.mark.parametrize("models", [1, 3])
def test_kv_events_publish_on_one_port_per_model_that_the_pod_names(models: int) -> None:
    """With the pool's kvEvents each model's vLLM publishes its KV events on KV_EVENTS_BASE_PORT + its
    index, on every interface (the router subscribes from its pod), and the pod template names the
    ports by model; the OpenAI servers stay on loopback. Without it no server publishes."""
    import json

    pool, services = _pool(1, kvEvents=True), _services()
    group = GroupPlan("g", MODELS[:models], 1, RoleCounts(interactive=2))
    config = children.worker_config(pool, group, services, CLASSES)
    template = children.stateful_set(pool, group, services, config, "ns")["spec"]["template"]
    pod = template["spec"]
    (engine,) = [c for c in pod["containers"] if c["name"] == children.ENGINE_CONTAINER]
    expected = {m.name: children.KV_EVENTS_BASE_PORT + i for i, m in enumerate(config.models)}
    for index, args in enumerate(engine_servers(engine)):
        published = json.loads(_flag(args, "--kv-events-config") or "{}")
        assert published == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv-events",
            "endpoint": f"tcp://*:{children.KV_EVENTS_BASE_PORT + index}",
        }
        assert _flag(args, "--host") == "127.0.0.1"
    assert [(p["name"], p["containerPort"]) for p in engine["ports"] if p["name"].startswith("kv-")] == [
        (f"kv-events-{i}", port) for i, port in enumerate(expected.values())
    ]
    assert set(expected.values()) <= set(children.KV_EVENTS_PORTS)
    # on the pod template, which the StatefulSet copies to each pod: discovery reads it there
    annotations = template["metadata"]["annotations"]
    assert json.loads(annotations[children.KV_EVENTS_ANNOTATION]) == expected

    _, _, _, _, pod = _render(models, 1)
    (engine,) = [c for c in pod["containers"] if c["name"] == children.ENGINE_CONTAINER]
    assert all("--kv-events-config" not in args for args in engine_servers(engine))
    assert [p["name"] for p in engine["ports"]] == [f"vllm-{i}" for i in range(models)]


def test_every_group_size_has_its_kv_event_ports_inside_the_published_range() -> None:
    """manifests/network admits the router on KV_EVENTS_PORTS: a group of the most models the API allows
    stays inside it, and the range stays clear of the worker's and the vLLM servers' ports."""
    from tessera.api.serving_pool import MAX_SERVICES_PER_GROUP, PlacementSpec

    bounds = PlacementSpec.model_fields["max_services_per_group"].metadata
    assert [b.le for b in bounds if hasattr(b, "le")] == [MAX_SERVICES_PER_GROUP]
    assert len(children.KV_EVENTS_PORTS) == MAX_SERVICES_PER_GROUP
    vllm = range(children.VLLM_BASE_PORT, children.VLLM_BASE_PORT + MAX_SERVICES_PER_GROUP)
    assert not set(children.KV_EVENTS_PORTS) & ({children.WORKER_PORT} | set(vllm))


@pytest.mark.parametrize("tp", [1, 2])
def test_resources_shm_cache_and_token_come_from_the_pool(tp: int) -> None:
    _, _, _, _, pod = _render(2, tp)
    engine = pod["containers"][1]
    shm = {1: 2**30, 2: 8 * 2**30}[tp]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm // 2**20}Mi"}} in pod[
        "volumes"
    ]
    assert {"name": "shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    memory = f"{(32 * 2**30 * tp + shm) // 2**20}Mi"  # defaults: 4 CPUs and 32Gi per GPU, plus /dev/shm
    assert engine["resources"]["requests"] == {
        "cpu": f"{4000 * tp}m",
        "memory": memory,
        "nvidia.com/gpu": str(tp),
    }
    assert engine["resources"]["limits"] == {"memory": memory, "nvidia.com/gpu": str(tp)}
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert "HF_TOKEN" not in {e["name"] for e in engine["env"]}

    spec = {
        "resources": {"cpuPerGpu": "6", "memoryPerGpu": "48Gi"},
        "shmSize": "20Gi",
        "modelCache": {"claimName": "hf-cache", "mountPath": "/cache"},
        "hubTokenSecret": {"name": "hf", "key": "HF_TOKEN"},
        "topologySpread": [
            {"topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
        ],
    }
    _, _, _, _, pod = _render(2, tp, spec)
    engine = pod["containers"][1]
    memory = f"{(48 * tp + 20) * 1024}Mi"
    assert engine["resources"]["requests"] == {
        "cpu": f"{6000 * tp}m",
        "memory": memory,
        "nvidia.com/gpu": str(tp),
    }
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "20480Mi"}} in pod["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/cache"} in engine["volumeMounts"]
    env = {e["name"]: e for e in engine["env"]}
    assert env["HF_HOME"]["value"] == "/cache"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    (spread,) = pod["topologySpreadConstraints"]
    assert spread == {
        "topologyKey": "topology.kubernetes.io/zone",
        "maxSkew": 1,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": children.group_labels("gpus", "g")},
    }
    _, _, _, _, pod = _render(1, tp, {"modelCache": {"hostPath": "/var/lib/hf"}})
    host = {"path": "/var/lib/hf", "type": "DirectoryOrCreate"}
    assert {"name": "model-cache", "hostPath": host} in pod["volumes"]


@pytest.mark.parametrize(
    ("pod", "problem"),
    [
        ({"modelCache": {"claimName": "c", "hostPath": "/x"}}, "set at most one of claimName and hostPath"),
        ({"modelCache": {"hostPath": "relative/dir"}}, "hostPath"),
        ({"resources": {"cpuPerGpu": "-1"}}, "cpuPerGpu"),
        ({"shmSize": "lots"}, "shmSize"),
        ({"hubTokenSecret": {"name": "Not_A_Name"}}, "hubTokenSecret.name"),
        ({"topologySpread": [{"topologyKey": "zone", "maxSkew": 0}]}, "maxSkew"),
        ({"disruptionBudget": {"maxUnavailable": 0}}, "maxUnavailable"),
        ({"engineSecurity": {"runAsUser": 0}}, "runAsUser"),
    ],
)
def test_bad_pod_fields_are_refused_naming_them(pod: dict[str, Any], problem: str) -> None:
    with pytest.raises((SpecError, ValueError)) as err:
        _pool(1, pod)
    assert problem in str(err.value)


def test_each_group_has_a_disruption_budget_and_drains_within_the_grace() -> None:
    docs = [d.to_json() for d in load_documents(EXAMPLES / "multi-model.yaml")]
    for d in docs:
        d["metadata"]["uid"] = "u"
    by_kind = {k: [d for d in docs if d["kind"] == k] for k in ("ServingPool", "LLMService", "RequestClass")}
    decided = desired_pool(
        by_kind["ServingPool"][0], by_kind["LLMService"], by_kind["RequestClass"], None, 0.0
    )
    assert isinstance(decided, PoolDesired) and decided.plan is not None
    budgets = {c["metadata"]["name"]: c for c in decided.children if c["kind"] == "PodDisruptionBudget"}
    sets = {c["metadata"]["name"]: c for c in decided.children if c["kind"] == "StatefulSet"}
    assert budgets.keys() == sets.keys() and len(sets) == len(decided.plan.groups)
    for name, budget in budgets.items():
        assert budget["spec"] == {"maxUnavailable": 1, "selector": sets[name]["spec"]["selector"]}
        pod = sets[name]["spec"]["template"]["spec"]
        # the kubelet's SIGKILL comes after the worker's drain and the servers' own stop
        assert pod["terminationGracePeriodSeconds"] > children.WORKER_GRACE_SECONDS
        assert sets[name]["spec"]["updateStrategy"] == {"type": "RollingUpdate"}


# -- the engine's supervisor, run for real with stand-in servers ---------------------------------------

FAKE_SERVER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
port = sys.argv[sys.argv.index("--port") + 1]
def stop(*_):
    (out / f"{port}.term").write_text("")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out / f"{port}.args").write_text(" ".join(sys.argv[1:]))
if "--crash" in sys.argv:
    while len(list(out.glob("*.args"))) < 2:  # the other server is up (and handles SIGTERM)
        time.sleep(0.05)
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


def _wait_for(condition: Any, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _supervisor(tmp_path: Path, worker_port: int, *servers: list[str]) -> subprocess.Popen[bytes]:
    """ENGINE_SCRIPT with a stand-in for vLLM's server module, watching ``worker_port``."""
    package = tmp_path / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(FAKE_SERVER)
    script = children.ENGINE_SCRIPT.replace(f":{children.WORKER_PORT:04X} ", f":{worker_port:04X} ")
    args: list[str] = []
    for index, server in enumerate(servers):
        args += ([children.SERVER_SEPARATOR] if index else []) + [*server, "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return subprocess.Popen(["bash", "-c", script, "engine", *args], env=env)


def test_the_supervisor_stops_the_servers_only_after_the_worker(tmp_path: Path) -> None:
    worker = socket.socket()
    worker.bind(("127.0.0.1", 0))
    worker.listen()
    port = worker.getsockname()[1]
    engine = _supervisor(tmp_path, port, ["--port", "9001", "--model", "a b"], ["--port", "9002"])
    try:
        assert _wait_for(lambda: (tmp_path / "9001.args").exists() and (tmp_path / "9002.args").exists())
        assert (tmp_path / "9001.args").read_text().startswith("--port 9001 --model a b --out")
        engine.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # the worker still listens: it is draining its requests on these servers
        assert engine.poll() is None and not list(tmp_path.glob("*.term"))
        worker.close()  # the worker has finished
        assert _wait_for(lambda: engine.poll() is not None)
        assert {p.name for p in tmp_path.glob("*.term")} == {"9001.term", "9002.term"}
    finally:
        worker.close()
        if engine.poll() is None:
            engine.kill()


def test_a_server_that_exits_stops_the_container(tmp_path: Path) -> None:
    engine = _supervisor(tmp_path, 1, ["--port", "9001"], ["--port", "9002", "--crash"])
    try:
        assert engine.wait(timeout=10) == 3  # the kubelet restarts the container, every server with it
        assert (tmp_path / "9001.term").exists()
    finally:
        if engine.poll() is None:
            engine.kill()


# -- co-located services that override a shared class differently -----------------------------------


def test_multi_model_on_two_instances_places_every_service_with_its_own_class_objectives() -> None:
    """Two instances make SeaLLM co-locate llama-8b (chat as declared, ttft 1 s) with mistral-7b (chat
    overridden to ttft 2 s): each model's requests of class chat get their own service's objectives."""
    docs = [d.to_json() for d in load_documents(EXAMPLES / "multi-model.yaml")]
    for d in docs:
        d["metadata"]["uid"] = "u"
    by_kind = {k: [d for d in docs if d["kind"] == k] for k in ("ServingPool", "LLMService", "RequestClass")}
    by_kind["ServingPool"][0]["spec"]["instances"] = {"min": 0, "max": 2}
    decided = desired_pool(
        by_kind["ServingPool"][0], by_kind["LLMService"], by_kind["RequestClass"], None, 0.0
    )
    assert isinstance(decided, PoolDesired) and decided.placement_problem is None and not decided.rejected
    assert decided.plan is not None
    assert {s for g in decided.plan.groups for s in g.services} == {"llama-8b", "mistral-7b", "qwen-7b"}
    (group,) = [g for g in decided.plan.groups if {"llama-8b", "mistral-7b"} <= set(g.services)]
    config = decided.configs[group.name]
    worker = Worker(config)
    objectives = {}
    for entry in config.models:
        chosen = worker.resolve_class(entry, {"X-Tessera-Class": "chat"})
        objectives[entry.name] = (
            chosen.name,
            chosen.ttft_slo_s,
            config.class_spec(entry, "chat").slo.ttft_seconds,
        )
    assert objectives["meta-llama/Llama-3.1-8B-Instruct"] == ("chat", 1, 1)
    assert objectives["mistralai/Mistral-7B-Instruct-v0.3"] == ("chat", 2, 2)
    # a changed override reaches running workers by their reload: no pod restart
    assert "classSpecs" not in children.RESTART_FIELDS


def test_a_model_may_not_change_a_shared_class_kind_or_match() -> None:
    base = {
        "models": [{"name": "m", "engine": "sim", "classSpecs": {}}],
        "classes": {"chat": {"kind": "interactive", "slo": {"ttftSeconds": 1}}},
    }
    for own, problem in [
        ({"batch": {"kind": "batch", "slo": {"deadlineSeconds": 60}}}, "classSpecs.batch must be one of"),
        ({"chat": {"kind": "batch", "slo": {"deadlineSeconds": 60}}}, "classSpecs.chat must be one of"),
        ({"chat": {"slo": {"ttftSeconds": 1}, "match": {"value": "talk"}}}, "same kind and match"),
    ]:
        base["models"][0]["classSpecs"] = own
        with pytest.raises(ValueError, match=problem):
            WorkerConfig.model_validate(base)
    base["models"][0]["classSpecs"] = {"chat": {"kind": "interactive", "slo": {"ttftSeconds": 3}}}
    config = WorkerConfig.model_validate(base)
    assert config.class_spec(config.models[0], "chat").slo.ttft_seconds == 3
