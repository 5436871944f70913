"""Pure builders of the Kubernetes objects the operator owns.

Per placement group of a ServingPool: a StatefulSet of worker pods, a headless Service, a ConfigMap
with the worker configuration and a PodDisruptionBudget. Per LLMService: a ClusterIP Service, its
endpoint. Every builder returns the exact dict the operator applies; nothing here talks to Kubernetes
or reads a clock.

A worker pod has two containers: the worker (Tessera's image, non-root, no GPU) and one ``engine``
container (the vLLM image) that holds all the instance's GPUs and runs one vLLM OpenAI server per
placed model, each on its own loopback port (``ENGINE_SCRIPT``: a small bash supervisor). One container
because the device plugin gives an extended resource such as ``nvidia.com/gpu`` to one container only:
per-model containers would leave every model but the first without a GPU, and sharing by
``NVIDIA_VISIBLE_DEVICES`` in unrequested containers depends on the node's runtime settings (refused
where unprivileged containers may not choose devices, all of the node's GPUs where they may). The
worker does not launch the servers itself (as local mode does) because its image carries no CUDA
vLLM and it should stay small, unprivileged and independent of the engine's version. The engine's
args list each server's vLLM arguments, separated by ``SERVER_SEPARATOR``; co-located servers split
the GPU memory (``memory_plan``) and start with sleep mode for swapping. With the pool's ``kvEvents``
each server also publishes vLLM's KV events on ``KV_EVENTS_BASE_PORT`` + its index of the pod's address
(the only engine port reachable from outside the pod), and the pod template names those ports in its
``KV_EVENTS_ANNOTATION`` for the router's discovery (the router's precise-prefix route).

Upgrades: any change of the pod template (an image, vLLM arguments, the restart hash) rolls the
StatefulSet, highest ordinal first, one pod at a time, each new pod Ready (worker ``/ready`` and every
model server's ``/health``) before the next. A stopping pod drains: the worker refuses new requests and
finishes its in-flight ones within ``WORKER_GRACE_SECONDS``; the engine supervisor keeps the model
servers up until the worker has stopped serving (or that grace ran out), then stops them; the pod's
``terminationGracePeriodSeconds`` adds ``TERMINATION_MARGIN_SECONDS`` for vLLM's own shutdown. The
group's PodDisruptionBudget bounds voluntary evictions (node drains) the same way.

Roles inside a group (Chiron): one StatefulSet holds all the group's instances, and the ConfigMap's
``ordinalRoles`` gives each pod ordinal its role (``GroupPlan.roles``, ``assign_roles``). Scaling
a StatefulSet down removes the highest ordinals first, whatever their role; a change of the counts keeps
each running pod's role where it can and re-roles the highest ordinals of a role over its count, so
scaling one role moves no pod of another. A role only steers routing, read by the router from the
(hot-reloaded) ConfigMap with the ordinal from the pod name: a re-roled pod restarts nothing.
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
from tessera.api.base import parse_quantity
from tessera.api.llm_service import LLMServiceSpec
from tessera.api.serving_pool import (
    BATCHED_TOKENS_FLAG,
    GPU_MEMORY_FLAG,
    MAX_SERVICES_PER_GROUP,
    sets_flag,
)
from tessera.api.worker_config import ProfileSpec, WorkerConfig
from tessera.control.adapters import RUNTIME_LORA_ENV, adapters_of, lora_args, lora_slots
from tessera.control.inputs import ENGINE_ANNOTATION, pool_input, service_input
from tessera.control.placement_sim import group_profiles, kv_tokens, separate_kv_bytes, stats_of
from tessera.core.activation import IdlePolicy
from tessera.core.planners import GroupPlan, Role, RoleCounts, assign_roles, parse_roles
from tessera.core.prefix import kv_events_config
from tessera.core.sharing import sharing_mode

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "tessera-operator"
POOL_LABEL = "tessera.dev/pool"
GROUP_LABEL = "tessera.dev/group"
SERVICE_LABEL = "tessera.dev/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
# The uid of the pool whose passes manage an object the pool does not own (an LLMService's endpoint
# Service): labels alone may be copied, so a pass deletes only objects owned or marked by its pool.
POOL_UID_ANNOTATION = "tessera.dev/pool-uid"
# Pods carry one such label per model they serve; an LLMService's endpoint selects on it.
SERVES_PREFIX = "serves.tessera.dev/"

WORKER_PORT = 8000  # OpenAI-compatible API and /metrics of the worker container
VLLM_BASE_PORT = 8100  # vLLM of the i-th model in the pod listens on VLLM_BASE_PORT + i (loopback)
# With the pool's kvEvents, vLLM of the i-th model publishes its KV events on KV_EVENTS_BASE_PORT + i of
# every interface (vLLM binds its publisher on a wildcard address only), for the router to subscribe to
# from its own pod; manifests/network admits the router alone on these ports.
KV_EVENTS_BASE_PORT = 8200
KV_EVENTS_PORTS = range(KV_EVENTS_BASE_PORT, KV_EVENTS_BASE_PORT + MAX_SERVICES_PER_GROUP)
# Pod-template annotation: where each model's engine publishes its KV events, {model name: port} as
# JSON; router discovery (tessera.router.discovery) reads it from each pod, which knows what it runs
# while a rollout changes the group's ConfigMap under it.
KV_EVENTS_ANNOTATION = "tessera.dev/kv-events"
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
ENGINE_CONTAINER = "engine"
SERVER_SEPARATOR = ";"  # between two model servers' arguments in the engine container's args
ENGINE_HOME = "/home/engine"  # HOME of the model servers: vLLM, torch and triton write caches under it
SHM_TP1_BYTES = 2**30  # /dev/shm at tensor parallel size 1 (vLLM's processes still exchange through it)
SHM_PER_GPU_BYTES = 4 * 2**30  # /dev/shm per GPU above (NCCL's buffers between the TP workers)
# The engine container's supervisor: starts one vLLM OpenAI server per SERVER_SEPARATOR-separated part of
# its arguments; stops them all when one exits (the kubelet restarts the container). On SIGTERM it keeps
# them up while the worker still listens or holds a connection on its port (read from /proc/net/tcp: the
# pod shares one network namespace, and the image need not carry curl), at most the worker's grace. grep,
# not a bash read loop: bash reads procfs a byte at a time, 33 s over 7,000 sockets on a busy node.
ENGINE_SCRIPT = f"""set -u
pids=()
start() {{ python3 -m vllm.entrypoints.openai.api_server "$@" & pids+=("$!"); }}
part=()
for arg in "$@"; do
  if [ "$arg" = "{SERVER_SEPARATOR}" ]; then start "${{part[@]}}"; part=(); else part+=("$arg"); fi
done
start "${{part[@]}}"
worker_busy() {{
  grep -qsE '^ *[0-9]+: [0-9A-F]+:{WORKER_PORT:04X} [0-9A-F]+:[0-9A-F]+ (01|0A) ' /proc/net/tcp /proc/net/tcp6
}}
drain() {{
  local end=$((SECONDS + {WORKER_GRACE_SECONDS}))
  while [ "$SECONDS" -lt "$end" ] && worker_busy; do sleep 1; done
  kill -TERM "${{pids[@]}}" 2>/dev/null
}}
trap drain TERM INT
wait -n
code=$?
kill -TERM "${{pids[@]}}" 2>/dev/null
wait
exit "$code"
"""
# Readiness of the engine container: every model server answers /health (python3 is in the vLLM image).
HEALTH_CHECK = (
    "import sys, urllib.request\n"
    "for port in sys.argv[1:]:\n"
    "    urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=5)"
)
WORKER_REQUESTS = {"cpu": "500m", "memory": "1Gi"}  # the worker process, its predictor included
WORKER_LIMITS = {"memory": "4Gi"}
# ServingPool annotation selecting the workers' engine: "vllm" (default) or "sim" (simulated engine,
# no engine container; the worker container takes the GPUs) for clusters without GPUs (e2e on kind).
# Pod-template annotation: a hash of what a running worker cannot take from its hot-reloaded ConfigMap.
RESTART_HASH_ANNOTATION = "tessera.dev/restart-hash"
# Model entry fields a running worker keeps from its start: its reload refuses a change of the model
# list (tessera.worker.runtime.Worker.reload); everything else in the ConfigMap reloads in place.
RESTART_FIELDS = ("name", "engine", "url", "launch", "sleepMode", "tokenizer", "maxModelLen", "toolParser")
# Andes pairs its QoE scheduler with the token pacer: it pauses a stream only while the reader's buffer
# covers the pause, which holds when tokens reach the reader at the reading pace.
PACED_POLICIES = frozenset({"qoe"})
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default token budget of one step on GPUs of 70 GiB or more
# vLLM's sleep mode (model swapping by sleep / wake-up) is a development endpoint: the server needs it on.
SLEEP_MODE_ENV = {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}


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
    """Whether a group's models swap by sleep / wake-up (``tessera.core.sharing.sharing_mode``: several
    models on engines that can sleep, the vLLM engine's; the placement estimator asks the same)."""
    return sharing_mode(len(group.services), engines_sleep=worker_engine(pool) == "vllm") == "swapping"


def vllm_args(
    pool: ServingPool,
    group: GroupPlan,
    service: LLMService,
    port: int,
    gpu_memory_utilization: float | None = None,
    kv_events_port: int | None = None,
    adapters: Sequence[LLMService] = (),
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
    ``VLLM_SERVER_DEV_MODE=1``) so that the worker can swap them. ``kv_events_port`` (the pool's
    ``kvEvents``): the server publishes its KV events there (``--kv-events-config``). A base model
    with ``adapters`` (LLMServices naming it in ``model.adapter``) serves LoRA adapters (``lora_args``).
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
    if not sets_flag(extra, BATCHED_TOKENS_FLAG):
        args += [BATCHED_TOKENS_FLAG, str(max(pool.spec.autoscaling.batch_size.max, DEFAULT_BATCHED_TOKENS))]
    if swaps_models(pool, group):
        args.append("--enable-sleep-mode")
    if kv_events_port is not None:
        args += ["--kv-events-config", kv_events_config(kv_events_port)]
    args += lora_args(pool, list(adapters))
    return args + list(extra)


def _gpus(pool: ServingPool, group: GroupPlan) -> dict[str, str]:
    """The GPUs of one instance of the group (requested and limited: extended resources need both)."""
    return {pool.spec.gpu.resource_name: str(group.tp)}


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
            _default(settings, "predictorOnline", predictor.online)
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
    assumes before the engine reports one (``batchSize.initial``); SeaLLM's execution-time statistics
    of each model (``placement_sim.stats_of``: the placement's own, from each service's history at its
    reference TP)."""
    if policy == "seallm":
        stats = {}
        for n in group.services:
            planned = service_input(pool, services[n])
            st = stats_of(planned, [(h.prompt_tokens, h.output_tokens) for h in planned.history])
            stats[services[n].spec.model.name] = {
                "meanExecS": st.mean_exec_s,
                "stdExecS": st.std_exec_s,
                "starvationS": st.starvation_s,
            }
        return {"services": stats}
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
    try:
        kv_each = separate_kv_bytes(gpu, list(inputs.values()), group.tp)
    except ValueError:
        raise ChildError(
            f"group {group.name!r}: the models {sorted(inputs)} leave no KV cache in separate vLLM processes "
            f"on {group.tp} GPU(s) of {pool.spec.gpu.memory}; use GPUs with more memory or fewer models"
        ) from None
    plan = {}
    for name, s in inputs.items():
        share = (s.weights_bytes / group.tp + gpu.activation_bytes_per_gpu + kv_each) / gpu.gpu_memory_bytes
        # rounded down: the shares' sum stays within the budget
        plan[name] = ModelMemory(kv_tokens(s, kv_each, group.tp), math.floor(share * 1e4) / 1e4)
    return plan


def worker_config(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    classes: Mapping[str, RequestClassSpec],
) -> WorkerConfig:
    """The worker configuration of one group: every field of the specs that concerns the worker
    (tests/test_worker_field_table.py lists each, and those that do not with the reason).

    Classes carry the per-service overrides already applied (SLOs, QoE, priority, queue bounds), so the
    worker needs no other object; where co-located services override a shared class differently, the
    first service's spec is the pod's and each other model carries its own in ``classSpecs`` (the class
    a header selects is the same for every model, its objectives are the model's).
    One pod runs one policy: co-located services use the first
    service's, with its settings (``policy_settings``); the placement estimator plays a co-located group
    the same way (``placement_sim.pod_policy``, in the mode ``swaps_models`` gives).
    Streams are paced for the qoe policy (``PACED_POLICIES``). Per model: the KV capacity of the group
    (``memory_plan``), the context length (``maxModelLength``, else the one the placement reserved
    KV for, within the KV capacity) and model swapping (``sleepMode`` auto where ``swaps_models``: the
    worker swaps when vLLM reports sleep mode; vLLM on CPU has none, and there every model stays
    resident; off otherwise), the tool parser (``toolParser``), and on vLLM pools the step-time profile the
    placement planned with (``profile``). Batch bounds and Chiron's local
    autoscaler switch come from the pool.
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
        own = _own_class_specs(spec, classes, merged_classes)
        has_batch = any(classes[c.name].kind == "batch" for c in spec.request_classes)
        policies.append(spec.scheduling.resolved_policy(has_batch))
        settings.append(policy_settings(spec, policies[-1]))
        planned = service_input(pool, service)
        entry: dict[str, Any] = {"name": spec.model.name, "engine": engine}
        if engine == "vllm":
            entry["url"] = f"http://127.0.0.1:{VLLM_BASE_PORT + index}"
            # The step times the placement planned with, at the group's TP: what the pod's policies
            # estimate waits and batch sizes from (the worker's default profile is a small CPU model's).
            # Not for the sim engine, which runs its profile in real time: there the worker's default
            # keeps a simulated pod's pace within what a test machine serves.
            entry["profile"] = ProfileSpec.from_profile(planned.profile.at_tp(group.tp)).to_json()
        entry["defaultClass"] = spec.default_class_name
        entry["kvCapacityTokens"] = memory[name].kv_capacity_tokens
        context = spec.model.max_model_length or planned.p99_context_tokens
        entry["maxModelLen"] = min(context, memory[name].kv_capacity_tokens)
        entry["sleepMode"] = "auto" if swaps_models(pool, group) else "off"
        if spec.model.tool_parser is not None:
            entry["toolParser"] = spec.model.tool_parser
        if own:
            entry["classSpecs"] = own
        adapters = adapters_of(name, services)
        if adapters:
            entry["maxLoras"], entry["maxCpuLoras"] = lora_slots(pool, adapters)
        models.append(entry)
        models += [_adapter_entry(entry, adapter, classes, merged_classes) for adapter in adapters]
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
            "fairShare": services[group.services[0]].spec.scheduling.fair_share.to_json(),
        },
    }
    try:
        return WorkerConfig.model_validate(config)
    except ValidationError as err:
        raise ChildError(f"group {group.name!r}: the worker configuration would be invalid: {err}") from None


def _own_class_specs(
    spec: LLMServiceSpec, classes: Mapping[str, RequestClassSpec], merged_classes: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """A model's spec of the classes it overrides differently from the pod's (``merged_classes``, which
    gains the classes it lacks), by class name."""
    own: dict[str, dict[str, Any]] = {}
    for accepted in spec.request_classes:
        merged = classes[accepted.name].with_overrides(accepted.overrides).to_json()
        if merged_classes.setdefault(accepted.name, merged) != merged:
            own[accepted.name] = merged
    return own


def _adapter_entry(
    base: Mapping[str, Any],
    adapter: LLMService,
    classes: Mapping[str, RequestClassSpec],
    merged_classes: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The worker's model entry of an adapter served by ``base``'s entry: the base's engine, server,
    profile, KV capacity and context; its own name, source, default class and classes (``merged_classes``
    gains those the pod lacks, as for a full model). It never sleeps on its own: the base's server
    holds it."""
    spec = adapter.spec
    assert spec.model.adapter is not None
    own = _own_class_specs(spec, classes, merged_classes)
    kept = ("engine", "url", "profile", "kvCapacityTokens", "maxModelLen")
    entry: dict[str, Any] = {k: base[k] for k in kept if k in base}
    entry |= {
        "name": spec.model.name,
        "adapterOf": base["name"],
        "adapterSource": spec.model.adapter.source,
        "adapterRank": spec.model.adapter.rank,
        "defaultClass": spec.default_class_name,
        "sleepMode": "off",
    }
    if spec.model.tool_parser is not None:
        entry["toolParser"] = spec.model.tool_parser
    if spec.scale_to_zero is not None:  # an idle adapter is unloaded; its base's pods stay
        entry["unloadAfterSeconds"] = spec.scale_to_zero.after_seconds
    if own:
        entry["classSpecs"] = own
    return entry


def restart_hash(config: WorkerConfig, vllm_containers: Sequence[Mapping[str, Any]]) -> str:
    """Hash of what a running worker pod cannot reload: its models' ``RESTART_FIELDS`` and the vLLM
    containers' arguments and environment. On the pod template it rolls the StatefulSet when these
    change; anything else in the ConfigMap (policy, settings, classes, batch bounds, KV capacity, step
    profile) reaches running workers by their reload of the mounted file, without a restart."""
    models = [{k: v for k, v in m.to_json().items() if k in RESTART_FIELDS} for m in config.models]
    engines = [{"args": c.get("args", []), "env": c.get("env", [])} for c in vllm_containers]
    text = json.dumps({"models": models, "vllm": engines}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SleepingModel:
    """A model of a scale-to-zero group as the router's activator reads it: its LLMService (where a
    wake-up is asked for) and its idle policy."""

    service: str
    policy: IdlePolicy


def scale_to_zero_models(group: GroupPlan, services: Mapping[str, LLMService]) -> dict[str, SleepingModel]:
    """The group's models by name with their idle policies when every service on it has ``scaleToZero``
    (the group sleeps whole); empty otherwise."""
    specs = [(services[s].spec.model.name, s, services[s].spec.scale_to_zero) for s in group.services]
    if not specs or any(spec is None for _, _, spec in specs):
        return {}
    return {model: SleepingModel(name, spec.policy()) for model, name, spec in specs if spec is not None}


def placement_info(pool: ServingPool, group: GroupPlan, services: Mapping[str, LLMService]) -> dict[str, Any]:
    """Where a pod sits: its pool, group, the instance counts by Chiron role and each pod ordinal's role
    (``ordinalRoles``), and, for a group that scales to zero, each model's LLMService and idle policy
    (``scale_to_zero_models``)."""
    info: dict[str, Any] = {
        "pool": pool.name,
        "group": group.name,
        "services": list(group.services),
        "tensorParallelSize": group.tp,
        "roles": {
            "interactive": group.replicas.interactive,
            "mixed": group.replicas.mixed,
            "batch": group.replicas.batch,
        },
        "ordinalRoles": list(group.roles),
    }
    sleeping = scale_to_zero_models(group, services)
    if sleeping:
        info["scaleToZero"] = {
            model: {
                "service": m.service,
                "afterSeconds": m.policy.after_s,
                "holdSeconds": m.policy.hold_s,
                "maxHeld": m.policy.max_held,
            }
            for model, m in sleeping.items()
        }
    return info


def group_config_map(
    pool: ServingPool,
    group: GroupPlan,
    config: WorkerConfig,
    namespace: str,
    services: Mapping[str, LLMService],
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
            PLACEMENT_KEY: json.dumps(placement_info(pool, group, services), sort_keys=True, indent=2),
        },
    }


@dataclass(frozen=True, slots=True)
class GroupConfigMap:
    """What a group's ConfigMap says: its worker configuration, the role of each pod ordinal (none while
    the group is scaled to zero) and its scale-to-zero models (``scale_to_zero_models``)."""

    config: WorkerConfig
    roles: list[Role]
    sleeping: dict[str, SleepingModel]


def read_group_config_map(config_map: Mapping[str, Any]) -> GroupConfigMap | None:
    """A group ConfigMap's content; None when the ConfigMap is not a group's. ChildError naming the
    ConfigMap when its content is invalid."""
    data = config_map.get("data") or {}
    if CONFIG_KEY not in data or PLACEMENT_KEY not in data:
        return None
    name = (config_map.get("metadata") or {}).get("name", "?")
    try:
        placement = json.loads(data[PLACEMENT_KEY])
        counts = RoleCounts(**{role: int(n) for role, n in placement["roles"].items()})
        roles = list(parse_roles(placement["ordinalRoles"])) if "ordinalRoles" in placement else None
        if roles is None or len(roles) != counts.total:  # written before pods kept their roles
            roles = list(assign_roles(counts))
        sleeping = {
            str(model): SleepingModel(
                str(m["service"]),
                IdlePolicy(
                    float(m["afterSeconds"]),
                    None if m.get("holdSeconds") is None else float(m["holdSeconds"]),
                    int(m["maxHeld"]),
                ),
            )
            for model, m in (placement.get("scaleToZero") or {}).items()
        }
        return GroupConfigMap(WorkerConfig.model_validate_json(data[CONFIG_KEY]), roles, sleeping)
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as err:  # pydantic's ValidationError is a ValueError
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


def _mebibytes(n_bytes: float) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def shm_bytes(pool: ServingPool, group: GroupPlan) -> float:
    """Size of the engine's /dev/shm: ``pod.shmSize``, else ``SHM_TP1_BYTES`` at TP 1 and
    ``SHM_PER_GPU_BYTES`` per GPU above."""
    if pool.spec.pod.shm_size is not None:
        return parse_quantity(pool.spec.pod.shm_size)
    return SHM_TP1_BYTES if group.tp == 1 else SHM_PER_GPU_BYTES * group.tp


def engine_resources(pool: ServingPool, group: GroupPlan) -> dict[str, Any]:
    """Requests and limits of the engine container: the group's GPUs, ``pod.resources`` per GPU, and the
    memory-backed /dev/shm on top of the memory (it counts against the limit). Memory is limited at its
    request (an engine past it is killed rather than starving its node); CPU is not limited."""
    spec = pool.spec.pod.resources
    cpu = f"{math.ceil(parse_quantity(spec.cpu_per_gpu) * group.tp * 1000)}m"
    memory = _mebibytes(parse_quantity(spec.memory_per_gpu) * group.tp + shm_bytes(pool, group))
    gpus = _gpus(pool, group)
    return {"requests": {"cpu": cpu, "memory": memory, **gpus}, "limits": {"memory": memory, **gpus}}


def _engine_security(pool: ServingPool) -> dict[str, Any]:
    """The engine's securityContext. The vLLM image runs as root by default; it needs root only to write
    its caches under /root, so unless ``engineSecurity.runAsRoot`` it runs as ``runAsUser`` with HOME,
    /tmp and the weight cache on writable volumes. No capabilities either way."""
    context: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    security = pool.spec.pod.engine_security
    if not security.run_as_root:
        uid = security.run_as_user
        context |= {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid}
    return context


def _model_cache_volume(pool: ServingPool) -> dict[str, Any]:
    cache = pool.spec.pod.model_cache
    if cache.claim_name is not None:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.host_path is not None:
        return {"name": "model-cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "model-cache", "emptyDir": {}}


def _engine_container(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    memory: Mapping[str, ModelMemory],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine container (one vLLM server per placed model) and the volumes only it uses."""
    args: list[str] = []
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    ports = [VLLM_BASE_PORT + index for index in range(len(group.services))]
    events = kv_events_ports(pool, group, services)
    for index, name in enumerate(group.services):
        if index:
            args.append(SERVER_SEPARATOR)
        model = services[name].spec.model.name
        args += vllm_args(pool, group, services[name], ports[index], memory[name].gpu_memory_utilization,
                          events.get(model), adapters_of(name, services))  # fmt: skip
        _, volume, mount = _model_location(services[name])
        if volume is not None and mount is not None:
            volumes.append(volume)
            mounts.append(mount)
    pod = pool.spec.pod
    volumes += [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": _mebibytes(shm_bytes(pool, group))}},
        _model_cache_volume(pool),
        {"name": "engine-home", "emptyDir": {}},
        {"name": "engine-tmp", "emptyDir": {}},
    ]
    mounts += [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "model-cache", "mountPath": pod.model_cache.mount_path},
        {"name": "engine-home", "mountPath": ENGINE_HOME},
        {"name": "engine-tmp", "mountPath": "/tmp"},
    ]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": ENGINE_HOME},
        {"name": "HF_HOME", "value": pod.model_cache.mount_path},
    ]
    if pod.hub_token_secret is not None:
        ref = {"name": pod.hub_token_secret.name, "key": pod.hub_token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if swaps_models(pool, group):
        env.append(dict(SLEEP_MODE_ENV))
    if any(adapters_of(name, services) for name in group.services):
        env.append(dict(RUNTIME_LORA_ENV))
    health = {"exec": {"command": ["python3", "-c", HEALTH_CHECK, *map(str, ports)]}, "timeoutSeconds": 10}
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": pool.spec.images.vllm,
        "imagePullPolicy": pool.spec.images.pull_policy,
        "command": ["/bin/bash", "-c", ENGINE_SCRIPT, ENGINE_CONTAINER],
        "args": args,
        "ports": [
            {"name": f"vllm-{i}", "containerPort": port, "protocol": "TCP"} for i, port in enumerate(ports)
        ]
        + [
            {"name": f"kv-events-{i}", "containerPort": port, "protocol": "TCP"}
            for i, port in enumerate(events.values())
        ],
        "env": env,
        "resources": engine_resources(pool, group),
        # Downloading and loading weights takes minutes for large models: liveness waits for startup.
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 120},
        "readinessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 20, "failureThreshold": 3},
        "securityContext": _engine_security(pool),
        "volumeMounts": mounts,
    }
    return container, volumes


def kv_events_ports(
    pool: ServingPool, group: GroupPlan, services: Mapping[str, LLMService]
) -> dict[str, int]:
    """Where each model's vLLM publishes its KV events in the group's pods, by model name in the
    group's order (``KV_EVENTS_BASE_PORT`` + its index); empty unless the pool asks for the events
    (``kvEvents``) and its pods run vLLM."""
    if not pool.spec.kv_events or worker_engine(pool) != "vllm":
        return {}
    return {services[name].spec.model.name: KV_EVENTS_PORTS[i] for i, name in enumerate(group.services)}


def disruption_budget(pool: ServingPool, group: GroupPlan, namespace: str) -> dict[str, Any]:
    """The PodDisruptionBudget of a group's pods: at most ``pod.disruptionBudget.maxUnavailable``
    evicted at once (node drains, cluster upgrades)."""
    labels = group_labels(pool.name, group.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(group_object_name(pool.name, group.name), namespace, labels, owner_reference(pool)),
        "spec": {
            "maxUnavailable": pool.spec.pod.disruption_budget.max_unavailable,
            "selector": {"matchLabels": dict(labels)},
        },
    }


def stateful_set(
    pool: ServingPool,
    group: GroupPlan,
    services: Mapping[str, LLMService],
    config: WorkerConfig,
    namespace: str,
) -> dict[str, Any]:
    """The StatefulSet of a group's worker pods: the worker and (vLLM engine) the engine container
    running every placed model's server; the pod template carries the ``restart_hash`` of ``config``
    and the engine container."""
    name = group_object_name(pool.name, group.name)
    labels = group_labels(pool.name, group.name)
    served = [*group.services, *(a.name for s in group.services for a in adapters_of(s, services))]
    pod_labels = {**labels, **{serves_label(s): "true" for s in served}}
    ports = kv_events_ports(pool, group, services)
    events = {KV_EVENTS_ANNOTATION: json.dumps(ports, sort_keys=True)} if ports else {}
    containers = [_worker_container(pool)]
    volumes: list[dict[str, Any]] = [
        {"name": "worker-config", "configMap": {"name": config_map_name(pool.name, group.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    pod_security: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if worker_engine(pool) == "sim":  # no vLLM: the worker holds the instance's GPUs for scheduling
        for kind in ("requests", "limits"):
            containers[0]["resources"][kind].update(_gpus(pool, group))
    else:
        engine, engine_volumes = _engine_container(pool, group, services, memory_plan(pool, group, services))
        containers.append(engine)
        volumes += engine_volumes
        if not pool.spec.pod.engine_security.run_as_root:
            # Volumes that support ownership (the weight cache's claim) become writable by the engine.
            pod_security["fsGroup"] = pool.spec.pod.engine_security.run_as_user
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS + TERMINATION_MARGIN_SECONDS,
        "automountServiceAccountToken": False,  # workers never call the Kubernetes API
        "securityContext": pod_security,
    }
    if pool.spec.node_selector:
        pod_spec["nodeSelector"] = dict(pool.spec.node_selector)
    if pool.spec.tolerations:
        pod_spec["tolerations"] = [t.to_json() for t in pool.spec.tolerations]
    if pool.spec.pod.topology_spread:
        pod_spec["topologySpreadConstraints"] = [
            {**t.to_json(), "labelSelector": {"matchLabels": dict(labels)}}
            for t in pool.spec.pod.topology_spread
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, namespace, labels, owner_reference(pool)),
        "spec": {
            "serviceName": name,
            "replicas": group.replicas.total,
            # Instances are independent: start and stop them together, not one by one.
            "podManagementPolicy": "Parallel",
            # A template change replaces pods one at a time, each Ready before the next (module docstring).
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(WORKER_PORT),
                        "prometheus.io/path": METRICS_PATH,
                        RESTART_HASH_ANNOTATION: restart_hash(config, containers[1:]),
                        **events,
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def endpoint_service(pool: ServingPool, service: LLMService, namespace: str) -> dict[str, Any]:
    """The ClusterIP Service clients call for one LLMService: every pod that serves its model."""
    labels = {**pool_labels(pool.name), SERVICE_LABEL: service.name}
    meta = _meta(service.name, namespace, labels, owner_reference(service))
    # Owned by the LLMService; the pool's uid lets the pool's pass delete it once that is gone.
    meta["annotations"] = {POOL_UID_ANNOTATION: owner_reference(pool)["uid"]}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
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
    (``group_configs``): per group a ConfigMap, headless Service, PodDisruptionBudget and StatefulSet;
    per placed LLMService its endpoint Service."""
    children: list[dict[str, Any]] = []
    placed: list[str] = []
    for group in groups:
        children += [
            group_config_map(pool, group, configs[group.name], namespace, services),
            headless_service(pool, group, namespace),
            disruption_budget(pool, group, namespace),
            stateful_set(pool, group, services, configs[group.name], namespace),
        ]
        placed += [s for s in group.services if s not in placed]
        placed += [a.name for s in group.services for a in adapters_of(s, services) if a.name not in placed]
    children += [endpoint_service(pool, services[s], namespace) for s in sorted(placed)]
    return children
