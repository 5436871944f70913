"""Pure builders of the Kubernetes objects the operator owns.

Per placement group of a ServingPool: a StatefulSet of worker pods, a headless Service and a ConfigMap
with the worker configuration. Per LLMService: a ClusterIP Service, its endpoint. Every builder returns
the exact dict the operator applies; nothing here talks to Kubernetes or reads a clock.

Roles inside a group (Chiron): one StatefulSet holds all the group's instances, ordered interactive,
then mixed, then batch by pod ordinal. Scaling a StatefulSet down removes the highest ordinals first, so
batch instances go first, then mixed, then interactive — the order Chiron retires them in. The worker
reads the role counts from the (hot-reloaded) ConfigMap and its ordinal from its pod name.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError
from pydantic.alias_generators import to_snake

from tessera.api import API_VERSION, LLMService, RequestClassSpec, ServingPool
from tessera.api.llm_service import LLMServiceSpec
from tessera.api.worker_config import WorkerConfig
from tessera.control.inputs import pool_input, service_input
from tessera.control.placement_sim import BLOCK_TOKENS, group_profiles
from tessera.core.planners import GroupPlan, Role

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "tessera-operator"
POOL_LABEL = "tessera.dev/pool"
GROUP_LABEL = "tessera.dev/group"
SERVICE_LABEL = "tessera.dev/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Pods carry one such label per model they serve; an LLMService's endpoint selects on it.
SERVES_PREFIX = "serves.tessera.dev/"

WORKER_PORT = 8000  # OpenAI-compatible API and /metrics of the worker container
VLLM_BASE_PORT = 8100  # vLLM of the i-th model in the pod listens on VLLM_BASE_PORT + i (loopback)
ENDPOINT_PORT = 80
CONFIG_KEY = "worker.json"
PLACEMENT_KEY = "placement.json"
CONFIG_DIR = "/etc/tessera"
# Routes of the worker app (tessera.worker.server.app); a test checks the app really serves them.
LIVENESS_PATH = "/health"
READINESS_PATH = "/ready"
METRICS_PATH = "/metrics"
# How long in-flight requests may finish after SIGTERM (`tessera worker --grace-seconds`); the pod's
# terminationGracePeriodSeconds adds a margin so that the kubelet's SIGKILL never cuts the drain short.
WORKER_GRACE_SECONDS = 30
TERMINATION_MARGIN_SECONDS = 10
MODELS_DIR = "/models"
WORKER_UID = 10001  # the worker image's user (Dockerfile)
WORKER_REQUESTS = {"cpu": "500m", "memory": "1Gi"}  # the worker process, its predictor included
WORKER_LIMITS = {"memory": "4Gi"}
# ServingPool annotation selecting the workers' engine: "vllm" (default) or "sim" (simulated engine,
# no vLLM containers; the worker container takes the GPUs) for clusters without GPUs (e2e on kind).
ENGINE_ANNOTATION = "tessera.dev/engine"
# Pod-template annotation: a hash of what a running worker cannot take from its hot-reloaded ConfigMap.
RESTART_HASH_ANNOTATION = "tessera.dev/restart-hash"
# Model entry fields a running worker keeps from its start: its reload refuses a change of the model
# list (tessera.worker.runtime.Worker.reload); everything else in the ConfigMap reloads in place.
RESTART_FIELDS = ("name", "engine", "url", "launch", "sleepMode", "tokenizer", "maxModelLen")
# Andes pairs its QoE scheduler with the token pacer: it pauses a stream only while the reader's buffer
# covers the pause, which holds when tokens reach the reader at the reading pace.
PACED_POLICIES = frozenset({"qoe"})
BATCHED_TOKENS_FLAG = "--max-num-batched-tokens"
GPU_MEMORY_FLAG = "--gpu-memory-utilization"
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default token budget of one step on GPUs of 70 GiB or more
# vLLM's sleep mode (model swapping by sleep / wake-up) is a development endpoint: the server needs it on.
SLEEP_MODE_ENV = {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}


ROLE_ORDER: tuple[Role, ...] = ("interactive", "mixed", "batch")  # pods by ordinal: the StatefulSet's order


def roles_by_ordinal(roles: dict[str, int]) -> list[Role]:
    """The role of each pod ordinal: interactive first, then mixed, then batch (the operator's order)."""
    return [role for role in ROLE_ORDER for _ in range(int(roles.get(role, 0)))]


def worker_engine(pool: ServingPool) -> str:
    """The engine of a pool's workers, from its ``tessera.dev/engine`` annotation."""
    engine = pool.metadata.annotations.get(ENGINE_ANNOTATION, "vllm")
    if engine not in ("vllm", "sim"):
        raise ChildError(f"annotation {ENGINE_ANNOTATION}={engine!r}: use 'vllm' or 'sim'")
    return engine


class ChildError(ValueError):
    """The specs cannot be turned into Kubernetes objects (the message says what to change)."""


def owner_reference(resource: ServingPool | LLMService) -> dict[str, Any]:
    """The ownerReference pointing at a Tessera resource (controller, blocks owner deletion)."""
    uid = resource.metadata.uid
    if not uid:
        raise ChildError(
            f"{resource.kind} {resource.name!r} has no metadata.uid; children need it in their "
            "ownerReferences (the API server sets it; set it yourself in tests)"
        )
    return {
        "apiVersion": API_VERSION,
        "kind": resource.kind,
        "name": resource.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def group_object_name(pool: str, group: str) -> str:
    """Name of a group's StatefulSet and headless Service (and prefix of its ConfigMap)."""
    name = f"{pool}-{group}"
    # StatefulSet pods add "-<ordinal>" and a controller-revision-hash label of the name plus 11 chars.
    if len(name) > 52:
        raise ChildError(
            f"ServingPool {pool!r} with group {group!r} gives the object name {name!r} "
            f"({len(name)} characters); StatefulSet names must stay within 52: shorten the pool name"
        )
    return name


def config_map_name(pool: str, group: str) -> str:
    """Name of a group's worker ConfigMap."""
    return f"{group_object_name(pool, group)}-worker"


def pool_labels(pool: str) -> dict[str, str]:
    """Labels every child of a pool carries; the operator lists its children by them."""
    return {MANAGED_BY: MANAGER, POOL_LABEL: pool}


def group_labels(pool: str, group: str) -> dict[str, str]:
    """Labels of a group's objects and pods (also the StatefulSet's selector)."""
    return {**pool_labels(pool), GROUP_LABEL: group}


def serves_label(service: str) -> str:
    """The pod label saying that the pod serves ``service``."""
    return f"{SERVES_PREFIX}{service}"


def _meta(name: str, namespace: str, labels: Mapping[str, str], owner: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(labels), "ownerReferences": [owner]}


def _model_location(service: LLMService) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """What vLLM's --model gets, and the volume + mount that hold the weights (if any)."""
    model = service.spec.model
    if model.volume is not None:
        mount = f"{MODELS_DIR}/{service.name}"
        volume = {
            "name": f"weights-{service.name}",
            "persistentVolumeClaim": {"claimName": model.volume.claim_name, "readOnly": True},
        }
        path = f"{mount}/{model.volume.path.strip('/')}".rstrip("/")
        return path, volume, {"name": volume["name"], "mountPath": mount, "readOnly": True}
    if model.source is None:
        return model.name, None, None
    if model.source.startswith("hf://"):
        return model.source.removeprefix("hf://"), None, None
    if model.source.startswith("file://"):
        return model.source.removeprefix("file://"), None, None
    return model.source, None, None


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (``flag value`` or ``flag=value``)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


def swaps_models(pool: ServingPool, group: GroupPlan) -> bool:
    """Whether a group's models swap by sleep / wake-up: several models on the vLLM engine."""
    return worker_engine(pool) == "vllm" and len(group.services) > 1


def vllm_args(
    pool: ServingPool,
    group: GroupPlan,
    service: LLMService,
    port: int,
    gpu_memory_utilization: float | None = None,
) -> list[str]:
    """The vLLM OpenAI server arguments of one placed model (the operator-owned flags first).

    ``--max-num-seqs`` is the pool's ``batchSize.max``: the worker's in-flight cap (the static
    ``batchSize.initial``, or the batch size Chiron's local autoscaler moves within ``[min, max]``) never
    exceeds it, so vLLM runs every request the worker hands it at once and nothing queues inside vLLM
    in arrival order, out of the policy's reach; the worker holds the rest in its own queue. A fixed
    maximum also keeps the arguments, and so the pods, unchanged while the batch size moves.
    vLLM refuses a ``--max-num-batched-tokens`` below ``--max-num-seqs``, and its default is 2048 on
    GPUs under 70 GiB: unless ``extraVllmArgs`` sets it, it is ``max(batchSize.max,
    DEFAULT_BATCHED_TOKENS)`` (vLLM's default on larger GPUs).
    ``gpu_memory_utilization`` (a co-located model's share, ``memory_plan``) replaces the pool's.
    Co-located models (``swaps_models``) start with ``--enable-sleep-mode`` (their container also gets
    ``VLLM_SERVER_DEV_MODE=1``) so that the worker can swap them.
    """
    model_arg, _, _ = _model_location(service)
    model = service.spec.model
    args = [
        "--model",
        model_arg,
        "--served-model-name",
        model.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(group.tp),
        "--max-num-seqs",
        str(pool.spec.autoscaling.batch_size.max),
        "--dtype",
        model.dtype,
    ]
    if model.max_model_length is not None:
        args += ["--max-model-len", str(model.max_model_length)]
    extra = list(pool.spec.extra_vllm_args)
    if gpu_memory_utilization is not None:
        extra = _without_flag(extra, GPU_MEMORY_FLAG)
        args += [GPU_MEMORY_FLAG, str(gpu_memory_utilization)]
    if not any(a.split("=", 1)[0] == BATCHED_TOKENS_FLAG for a in extra):
        args += [BATCHED_TOKENS_FLAG, str(max(pool.spec.autoscaling.batch_size.max, DEFAULT_BATCHED_TOKENS))]
    if swaps_models(pool, group):
        args.append("--enable-sleep-mode")
    return args + list(extra)


def _gpu_requests(pool: ServingPool, group: GroupPlan, index: int) -> dict[str, Any]:
    """GPU requests of the index-th vLLM container.

    The group's instance has ``group.tp`` GPUs that all its models share (SeaLLM co-location). The
    device plugin cannot split an extended resource between containers, so the first vLLM container
    requests the instance's GPUs and the others request none (CHOICE, see the module report: sharing
    needs DRA resource claims, not yet used).
    """
    if index > 0:
        return {}
    gpus = {pool.spec.gpu.resource_name: str(group.tp)}
    return {"requests": dict(gpus), "limits": dict(gpus)}


def _default(settings: dict[str, Any], alias: str, value: Any) -> None:
    """Set ``alias`` in ``settings`` unless it (or its snake_case name) is there: the spec's own
    ``scheduling.settings`` take precedence over values derived from other fields."""
    if alias not in settings and to_snake(alias) not in settings and value is not None:
        settings[alias] = value


def policy_settings(spec: LLMServiceSpec, policy: str) -> dict[str, Any]:
    """The settings a service's worker runs ``policy`` with: ``scheduling.settings``, and for isrtf the
    ``predictor`` block where those settings do not say (enabled → predictor text, else running-mean;
    repredictEveryTokens → windowTokens; checkpoint → predictorCheckpoint and encoder →
    predictorEncoder for the text predictor). No other policy predicts lengths from text."""
    settings = dict(spec.scheduling.settings)
    if policy == "isrtf":
        predictor = spec.predictor
        _default(settings, "predictor", "text" if predictor.enabled else "running-mean")
        _default(settings, "windowTokens", predictor.repredict_every_tokens)
        if settings.get("predictor") == "text":
            _default(settings, "predictorCheckpoint", predictor.checkpoint)
            _default(settings, "predictorEncoder", predictor.encoder)
    return settings


def _group_settings(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    policy: str,
    models: list[dict[str, Any]],
) -> dict[str, Any]:
    """Settings a group's policy derives from the pool and all its models: QLM's context length (the
    group's longest), weight sizes (``weightsSize``, else the matched profile's) and the batch size it
    assumes before the engine reports one (``batchSize.initial``)."""
    if policy != "qlm":
        return {}
    return {
        "contextLen": max(m["maxModelLen"] for m in models),
        "modelWeightsBytes": {
            services[n].spec.model.name: float(service_input(pool, services[n]).weights_bytes)
            for n in group.services
        },
        "defaultBatch": pool.spec.autoscaling.batch_size.initial,
    }


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """One model's share of its group's GPU memory."""

    kv_capacity_tokens: int  # KV cache of the model, tokens
    gpu_memory_utilization: float | None  # vLLM's --gpu-memory-utilization; None: the pool's (one model)


def _utilization_budget(pool: ServingPool) -> float:
    """The share of GPU memory vLLM may take: ``--gpu-memory-utilization`` of ``extraVllmArgs``, else the
    placement's (vLLM's default, 0.9)."""
    args = list(pool.spec.extra_vllm_args)
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag == GPU_MEMORY_FLAG:
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                budget = float(value)
            except ValueError:
                budget = -1.0
            if not 0 < budget <= 1:
                raise ChildError(f"extraVllmArgs: {GPU_MEMORY_FLAG} {value!r} must be a number in (0, 1]")
            return budget
    return pool_input(pool).memory_fraction


def memory_plan(
    pool: ServingPool, group: GroupPlan, services: Mapping[str, LLMService]
) -> dict[str, ModelMemory]:
    """Each of a group's models' KV cache (and, when several share the GPUs, vLLM's memory share), by
    service name.

    One model: the KV cache the placement estimator gives it (``placement_sim.group_profiles``: the
    pool's utilization of the memory at the group's TP, less the weights and an activation reserve).
    Several models: each runs its own vLLM process, which takes ``--gpu-memory-utilization`` of the GPUs
    at start and refuses to start when less is free, so the budget (the pool's utilization) is split:
    each model gets its weights, an activation reserve and an equal share of what is left as KV cache.
    Weights come from ``weightsSize``, else the matched step profile.
    """
    inputs = {name: service_input(pool, services[name]) for name in group.services}
    gpu = replace(pool_input(pool), memory_fraction=_utilization_budget(pool))
    if len(inputs) == 1:
        try:
            profiles = group_profiles(gpu, list(inputs.values()), group.tp)
        except ValueError as err:
            raise ChildError(f"group {group.name!r}: {err}; use GPUs with more memory") from None
        return {name: ModelMemory(p.kv_capacity_tokens, None) for name, p in profiles.items()}
    budget = gpu.memory_fraction * gpu.gpu_memory_bytes
    weights = {name: s.weights_bytes / group.tp for name, s in inputs.items()}
    kv_each = (budget - sum(weights.values()) - len(inputs) * gpu.activation_bytes_per_gpu) / len(inputs)
    if kv_each <= 0:
        raise ChildError(
            f"group {group.name!r}: the models {sorted(inputs)} leave no KV cache in separate vLLM processes "
            f"on {group.tp} GPU(s) of {pool.spec.gpu.memory}; use GPUs with more memory or fewer models"
        )
    plan = {}
    for name, s in inputs.items():
        tokens = int(kv_each // (s.kv_bytes_per_token / group.tp))
        share = (weights[name] + gpu.activation_bytes_per_gpu + kv_each) / gpu.gpu_memory_bytes
        # rounded down: the shares' sum stays within the budget
        plan[name] = ModelMemory(tokens - tokens % BLOCK_TOKENS, math.floor(share * 1e4) / 1e4)
    return plan


def worker_config(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    classes: Mapping[str, RequestClassSpec],
) -> WorkerConfig:
    """The worker configuration of one group: every field of the specs that concerns the worker
    (tests/test_worker_field_table.py lists each, and those that do not with the reason).

    Classes carry the per-service overrides already applied (SLOs, QoE, priority, queue bounds, match),
    so the worker needs no other object. One pod runs one policy: co-located services use the first
    service's, with its settings (``policy_settings``; SeaLLM groups run its DB policy across services).
    Streams are paced for the qoe policy (``PACED_POLICIES``). Per model: the KV capacity of the group
    (``memory_plan``), the context length (``maxModelLength``, else the one the placement reserved
    KV for, within the KV capacity) and model swapping (``sleepMode`` auto where ``swaps_models``: the
    worker swaps when vLLM reports sleep mode; vLLM on CPU has none, and there every model stays
    resident; off otherwise). Batch bounds and Chiron's local autoscaler switch come from the pool.
    """
    models: list[dict[str, Any]] = []
    merged_classes: dict[str, dict[str, Any]] = {}
    policies: list[str] = []
    settings: list[dict[str, Any]] = []
    memory = memory_plan(pool, group, services)
    engine = worker_engine(pool)
    for index, name in enumerate(group.services):
        service = services[name]
        spec = service.spec
        for accepted in spec.request_classes:
            merged = classes[accepted.name].with_overrides(accepted.overrides).to_json()
            if merged_classes.setdefault(accepted.name, merged) != merged:
                raise ChildError(
                    f"LLMServices {list(group.services)} share group {group.name!r} but override "
                    f"RequestClass {accepted.name!r} differently; a pod holds one spec per class: make "
                    "the overrides equal or use separate classes"
                )
        has_batch = any(classes[c.name].kind == "batch" for c in spec.request_classes)
        policies.append(spec.scheduling.resolved_policy(has_batch))
        settings.append(policy_settings(spec, policies[-1]))
        entry: dict[str, Any] = {"name": spec.model.name, "engine": engine}
        if engine == "vllm":
            entry["url"] = f"http://127.0.0.1:{VLLM_BASE_PORT + index}"
        entry["defaultClass"] = spec.default_class_name
        entry["kvCapacityTokens"] = memory[name].kv_capacity_tokens
        context = spec.model.max_model_length or service_input(pool, service).p99_context_tokens
        entry["maxModelLen"] = min(context, memory[name].kv_capacity_tokens)
        entry["sleepMode"] = "auto" if swaps_models(pool, group) else "off"
        models.append(entry)
    for alias, value in _group_settings(pool, group, services, policies[0], models).items():
        _default(settings[0], alias, value)
    bounds = pool.spec.autoscaling.batch_size
    config = {
        "models": models,
        "classes": merged_classes,
        "scheduling": {
            "policy": policies[0],
            "settings": settings[0],
            "batch": {"min": bounds.min, "max": bounds.max, "initial": bounds.initial},
            "autoscale": {"enabled": pool.spec.autoscaling.enabled},
            "pacing": policies[0] in PACED_POLICIES,
        },
    }
    try:
        return WorkerConfig.model_validate(config)
    except ValidationError as err:
        raise ChildError(f"group {group.name!r}: the worker configuration would be invalid: {err}") from None


def restart_hash(config: WorkerConfig, vllm_containers: Sequence[Mapping[str, Any]]) -> str:
    """Hash of what a running worker pod cannot reload: its models' ``RESTART_FIELDS`` and the vLLM
    containers' arguments and environment. On the pod template it rolls the StatefulSet when these
    change; anything else in the ConfigMap (policy, settings, classes, batch bounds, KV capacity, step
    profile) reaches running workers by their reload of the mounted file, without a restart."""
    models = [{k: v for k, v in m.to_json().items() if k in RESTART_FIELDS} for m in config.models]
    engines = [{"args": c.get("args", []), "env": c.get("env", [])} for c in vllm_containers]
    text = json.dumps({"models": models, "vllm": engines}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def placement_info(pool: ServingPool, group: GroupPlan) -> dict[str, Any]:
    """Where a pod sits: its pool, group and the instance counts by Chiron role (by pod ordinal:
    interactive first, then mixed, then batch)."""
    return {
        "pool": pool.name,
        "group": group.name,
        "services": list(group.services),
        "tensorParallelSize": group.tp,
        "roles": {
            "interactive": group.replicas.interactive,
            "mixed": group.replicas.mixed,
            "batch": group.replicas.batch,
        },
    }


def group_config_map(
    pool: ServingPool, group: GroupPlan, config: WorkerConfig, namespace: str
) -> dict[str, Any]:
    """The ConfigMap holding a group's worker configuration (read back by ``read_group_config_map``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            config_map_name(pool.name, group.name),
            namespace,
            group_labels(pool.name, group.name),
            owner_reference(pool),
        ),
        "data": {
            CONFIG_KEY: json.dumps(config.to_json(), sort_keys=True, indent=2),
            PLACEMENT_KEY: json.dumps(placement_info(pool, group), sort_keys=True, indent=2),
        },
    }


def read_group_config_map(config_map: Mapping[str, Any]) -> tuple[WorkerConfig, list[Role]] | None:
    """A group ConfigMap's worker configuration and the role of each pod ordinal; None when the
    ConfigMap is not a group's. ChildError naming the ConfigMap when its content is invalid."""
    data = config_map.get("data") or {}
    if CONFIG_KEY not in data or PLACEMENT_KEY not in data:
        return None
    name = (config_map.get("metadata") or {}).get("name", "?")
    try:
        placement = json.loads(data[PLACEMENT_KEY])
        roles = roles_by_ordinal(placement["roles"])
        return WorkerConfig.model_validate_json(data[CONFIG_KEY]), roles
    except (ValueError, KeyError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        raise ChildError(f"ConfigMap {name}: invalid {CONFIG_KEY} or {PLACEMENT_KEY}: {err}") from None


def headless_service(pool: ServingPool, group: GroupPlan, namespace: str) -> dict[str, Any]:
    """The headless Service giving a group's pods stable DNS names (the StatefulSet's serviceName)."""
    labels = group_labels(pool.name, group.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(group_object_name(pool.name, group.name), namespace, labels, owner_reference(pool)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(labels),
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def worker_args() -> list[str]:
    """Arguments of the worker container (the image's entrypoint is ``tessera``)."""
    return [
        "worker",
        "--config",
        f"{CONFIG_DIR}/{CONFIG_KEY}",
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--grace-seconds",
        str(WORKER_GRACE_SECONDS),
    ]


def _worker_container(pool: ServingPool) -> dict[str, Any]:
    probe = {"httpGet": {"path": LIVENESS_PATH, "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}
    return {
        "name": "worker",
        "image": pool.spec.images.worker,
        "imagePullPolicy": pool.spec.images.pull_policy,
        "args": worker_args(),
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "volumeMounts": [
            {"name": "worker-config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {"requests": dict(WORKER_REQUESTS), "limits": dict(WORKER_LIMITS)},
        # The worker image runs as its own user; nothing in the pod needs privileges or a writable root.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": WORKER_UID,
            "runAsGroup": WORKER_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "livenessProbe": probe,
        "readinessProbe": {
            "httpGet": {"path": READINESS_PATH, "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
    }


def _vllm_container(
    pool: ServingPool, group: GroupPlan, service: LLMService, index: int, utilization: float | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    port = VLLM_BASE_PORT + index
    _, volume, mount = _model_location(service)
    container: dict[str, Any] = {
        "name": f"vllm-{index}",
        "image": pool.spec.images.vllm,
        "imagePullPolicy": pool.spec.images.pull_policy,
        "args": vllm_args(pool, group, service, port, utilization),
        "ports": [{"name": f"vllm-{index}", "containerPort": port, "protocol": "TCP"}],
        # Loading weights takes minutes for large models: wait for /health before liveness applies.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "failureThreshold": 90,
        },
        "livenessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 15},
        # vLLM's official image runs as root (its caches live under /root); it needs no capabilities.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if swaps_models(pool, group):
        container["env"] = [dict(SLEEP_MODE_ENV)]
    resources = _gpu_requests(pool, group, index)
    if resources:
        container["resources"] = resources
    if mount is not None:
        container["volumeMounts"] = [mount]
    return container, volume


def stateful_set(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    config: WorkerConfig,
    namespace: str,
) -> dict[str, Any]:
    """The StatefulSet of a group's worker pods: one vLLM container per placed model plus the worker;
    the pod template carries the ``restart_hash`` of ``config`` and the vLLM containers."""
    name = group_object_name(pool.name, group.name)
    labels = group_labels(pool.name, group.name)
    pod_labels = {**labels, **{serves_label(s): "true" for s in group.services}}
    containers = [_worker_container(pool)]
    volumes: list[dict[str, Any]] = [
        {"name": "worker-config", "configMap": {"name": config_map_name(pool.name, group.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if worker_engine(pool) == "sim":  # no vLLM: the worker holds the instance's GPUs for scheduling
        gpus = _gpu_requests(pool, group, 0)
        for kind in ("requests", "limits"):
            containers[0]["resources"][kind].update(gpus[kind])
    vllm = worker_engine(pool) == "vllm"
    memory = memory_plan(pool, group, services) if vllm else {}
    for index, service_name in enumerate(group.services if vllm else ()):
        share = memory[service_name].gpu_memory_utilization
        container, volume = _vllm_container(pool, group, services[service_name], index, share)
        containers.append(container)
        if volume is not None:
            volumes.append(volume)
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS + TERMINATION_MARGIN_SECONDS,
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    if pool.spec.node_selector:
        pod_spec["nodeSelector"] = dict(pool.spec.node_selector)
    if pool.spec.tolerations:
        pod_spec["tolerations"] = [t.to_json() for t in pool.spec.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, namespace, labels, owner_reference(pool)),
        "spec": {
            "serviceName": name,
            "replicas": group.replicas.total,
            # Instances are independent: start and stop them together, not one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(WORKER_PORT),
                        "prometheus.io/path": METRICS_PATH,
                        RESTART_HASH_ANNOTATION: restart_hash(config, containers[1:]),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def endpoint_service(pool: ServingPool, service: LLMService, namespace: str) -> dict[str, Any]:
    """The ClusterIP Service clients call for one LLMService: every pod that serves its model."""
    labels = {**pool_labels(pool.name), SERVICE_LABEL: service.name}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service.name, namespace, labels, owner_reference(service)),
        "spec": {
            "type": "ClusterIP",
            "selector": {POOL_LABEL: pool.name, serves_label(service.name): "true"},
            "ports": [{"name": "http", "port": ENDPOINT_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint_url(service: str, namespace: str) -> str:
    """In-cluster URL of an LLMService's endpoint."""
    return f"http://{service}.{namespace}.svc:{ENDPOINT_PORT}"


def group_configs(
    pool: ServingPool,
    groups: Sequence[GroupPlan],
    services: Mapping[str, LLMService],
    classes: Mapping[str, RequestClassSpec],
) -> dict[str, WorkerConfig]:
    """The worker configuration of each group, by group name."""
    configs: dict[str, WorkerConfig] = {}
    for group in groups:
        missing = [s for s in group.services if s not in services]
        if missing:
            raise ChildError(f"group {group.name!r} places unknown LLMServices {missing}")
        configs[group.name] = worker_config(pool, group, services, classes)
    return configs


def desired_children(
    pool: ServingPool,
    groups: Sequence[GroupPlan],
    services: Mapping[str, LLMService],
    configs: Mapping[str, WorkerConfig],
    namespace: str,
) -> list[dict[str, Any]]:
    """Every object a pool should own for a plan and its groups' worker configurations
    (``group_configs``): per group a ConfigMap, headless Service and StatefulSet; per placed
    LLMService its endpoint Service."""
    children: list[dict[str, Any]] = []
    placed: list[str] = []
    for group in groups:
        children += [
            group_config_map(pool, group, configs[group.name], namespace),
            headless_service(pool, group, namespace),
            stateful_set(pool, group, services, configs[group.name], namespace),
        ]
        placed += [s for s in group.services if s not in placed]
    children += [endpoint_service(pool, services[s], namespace) for s in sorted(placed)]
    return children
