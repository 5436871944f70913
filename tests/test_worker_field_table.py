"""Every field of LLMService, RequestClass and ServingPool that concerns the worker reaches it.

``TABLE`` has one row per such field: the field, what it becomes in the worker pod (a worker
configuration setting, or a vLLM argument of the model's container), a change of the field, and
where cheap a behaviour of the worker that changes with it (the policy built from the configuration
as the worker builds it, the class a header selects, the runtime class). ``NOT_FOR_WORKER`` lists the
other fields with the reason. ``test_every_spec_field_is_accounted_for`` fails when a field is added
to a spec and to neither, so no field is silently dropped.

The specs go through the operator's own path (``desired_pool``: validation, placement, children).
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import UnionType
from typing import Any

import pytest
from pydantic import BaseModel
from scheduler_harness import one_model_scheduler
from test_children_gpu_pods import engine_servers

from tessera.api import LLMServiceSpec, RequestClassSpec, ServingPoolSpec
from tessera.api.worker_config import ClassHeaderError, WorkerConfig
from tessera.control import children
from tessera.control.pool_plan import PoolDesired, desired_pool
from tessera.core.registry import make_policy

# -- the specs --------------------------------------------------------------------------------------

POOL: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "ServingPool",
    "metadata": {"name": "pool", "namespace": "ns", "uid": "u-pool"},
    "spec": {
        "gpu": {"type": "H100", "perInstance": 1, "memory": "80Gi"},
        "instances": {"min": 0, "max": 4},
        "autoscaling": {"batchSize": {"min": 1, "initial": 64, "max": 512}},
    },
}
SERVICE: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": "llama", "namespace": "ns", "uid": "u-llama"},
    "spec": {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "weightsSize": "16Gi"},
        "poolRef": {"name": "pool"},
        "requestClasses": [{"name": "chat"}, {"name": "offline"}],
        "scheduling": {"policy": "qoe"},
    },
}


def _class(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": f"u-{name}"}
    return {"apiVersion": "tessera.dev/v1alpha1", "kind": "RequestClass", "metadata": meta, "spec": spec}


CLASSES = [
    _class("chat", {"kind": "interactive", "slo": {"ttftSeconds": 1, "itlSeconds": 0.1}}),
    _class("offline", {"kind": "batch", "slo": {"ttftSeconds": 60, "deadlineSeconds": 3600}}),
    _class("other", {"kind": "interactive", "slo": {"ttftSeconds": 5}}),
]
KINDS = {"ServingPool": 0, "LLMService": 1, "RequestClass": 2}


def _set(body: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = body
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _get(obj: Any, path: str) -> Any:
    for key in path.split("."):
        obj = obj[int(key)] if isinstance(obj, list) else obj.get(key)
    return obj


@dataclass(frozen=True)
class Rendered:
    """What the operator renders for the specs' one group."""

    config: WorkerConfig
    sts: dict[str, Any]

    @property
    def json(self) -> dict[str, Any]:
        return self.config.to_json()

    @property
    def vllm_args(self) -> list[str]:
        return self.sts["spec"]["template"]["spec"]["containers"][1]["args"]

    def flag(self, name: str) -> str | bool:
        """The value of a vLLM flag (True for a flag without a value, False when absent)."""
        args = self.vllm_args
        if name not in args:
            return False
        at = args.index(name)
        return args[at + 1] if at + 1 < len(args) and not args[at + 1].startswith("--") else True


def render(
    pool: dict[str, Any] = POOL, service: dict[str, Any] = SERVICE, classes: list[dict[str, Any]] = CLASSES
) -> Rendered:
    """The worker configuration and StatefulSet the operator builds for one service."""
    decided = desired_pool(pool, [service], classes, None, 0.0)
    assert isinstance(decided, PoolDesired) and not decided.rejected, decided
    assert decided.plan is not None and len(decided.plan.groups) == 1, decided.placement_problem
    group = decided.plan.groups[0].name
    (sts,) = [c for c in decided.children if c["kind"] == "StatefulSet"]
    return Rendered(decided.configs[group], sts)


def _docs(changes: tuple[tuple[str, str, Any], ...]) -> tuple[dict, dict, list[dict]]:
    """Copies of the specs with ``changes`` (kind, path from the body, value) applied."""
    docs = [copy.deepcopy(POOL), copy.deepcopy(SERVICE), copy.deepcopy(CLASSES)]
    for kind, path, value in changes:
        target = docs[KINDS[kind]]
        if kind == "RequestClass":
            name, _, path = path.partition(":")
            target = next(c for c in target if c["metadata"]["name"] == name)
        _set(target, path, value)
    return docs[0], docs[1], docs[2]


# -- behaviours -------------------------------------------------------------------------------------


def _policy(r: Rendered) -> Any:
    """The policy the worker builds from its configuration (worker/runtime.py does the same)."""
    return make_policy(r.config.scheduling.policy, r.config.scheduling.settings)


def _selected(headers: dict[str, str]) -> Callable[[Rendered], str | None]:
    """The class the worker gives a request with ``headers`` ("refused": a 400 naming the header)."""

    def select(r: Rendered) -> str | None:
        try:
            return r.config.class_from_headers(headers)
        except ClassHeaderError:
            return "refused"

    return select


def _service_class(name: str) -> Callable[[Rendered], Any]:
    return lambda r: r.config.classes[name].to_service_class(name)


# -- the table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """A spec field, what it becomes in the worker pod, a change and the behaviour it shows in."""

    field: str  # Kind.spec path, camelCase, lists as []
    setting: str  # "config:<path in the worker configuration>" or "vllm:<flag>"
    change: tuple[tuple[str, str, Any], ...]  # (kind, path from the body, value) of the change
    base: tuple[tuple[str, str, Any], ...] = ()  # changes both renders start from
    behaviour: Callable[[Rendered], Any] | None = None  # a worker behaviour that must change too
    honoured: str = ""  # where the worker honours the setting


ISRTF_TEXT = (("LLMService", "spec.scheduling", {"policy": "isrtf"}),)
ISRTF_MEAN = (
    ("LLMService", "spec.scheduling", {"policy": "isrtf"}),
    ("LLMService", "spec.predictor", {"enabled": False}),
)
OVERRIDE = "spec.requestClasses.0.overrides"

TABLE: tuple[Row, ...] = (
    # LLMService
    Row("LLMService.spec.model.name", "config:models.0.name",
        (("LLMService", "spec.model.name", "acme/Llama-3.1-8B-v2"),), honoured="worker: served model name"),
    Row("LLMService.spec.model.name", "vllm:--served-model-name",
        (("LLMService", "spec.model.name", "acme/Llama-3.1-8B-v2"),), honoured="vLLM"),
    Row("LLMService.spec.model.source", "vllm:--model",
        (("LLMService", "spec.model.source", "hf://acme/other-8B"),), honoured="vLLM weights"),
    Row("LLMService.spec.model.volume.claimName", "pod:volumes",
        (("LLMService", "spec.model.volume", {"claimName": "w2", "path": "/llama"}),),
        base=(("LLMService", "spec.model.volume", {"claimName": "w1", "path": "/llama"}),),
        honoured="the engine container's weights volume"),
    Row("LLMService.spec.model.volume.path", "vllm:--model",
        (("LLMService", "spec.model.volume", {"claimName": "w1", "path": "/other"}),),
        base=(("LLMService", "spec.model.volume", {"claimName": "w1", "path": "/llama"}),),
        honoured="vLLM weights"),
    Row("LLMService.spec.model.dtype", "vllm:--dtype",
        (("LLMService", "spec.model.dtype", "float16"),), honoured="vLLM"),
    Row("LLMService.spec.model.maxModelLength", "config:models.0.maxModelLen",
        (("LLMService", "spec.model.maxModelLength", 2048),),
        honoured="worker: request length check (400), default max_tokens"),
    Row("LLMService.spec.model.maxModelLength", "vllm:--max-model-len",
        (("LLMService", "spec.model.maxModelLength", 2048),), honoured="vLLM"),
    Row("LLMService.spec.model.maxModelLength", "config:scheduling.settings.contextLen",
        (("LLMService", "spec.model.maxModelLength", 2048),),
        base=(("LLMService", "spec.scheduling", {"policy": "qlm"}),),
        behaviour=lambda r: _policy(r).context_len, honoured="qlm: waiting-time estimate"),
    Row("LLMService.spec.model.toolParser", "config:models.0.toolParser",
        (("LLMService", "spec.model.toolParser", "hermes"),),
        honoured="worker: tool_choice auto, the calls read back by vLLM's tool parser"),
    Row("LLMService.spec.model.weightsSize", "config:models.0.kvCapacityTokens",
        (("LLMService", "spec.model.weightsSize", "30Gi"),), honoured="every policy's KV capacity"),
    Row("LLMService.spec.model.weightsSize", "config:scheduling.settings.modelWeightsBytes",
        (("LLMService", "spec.model.weightsSize", "30Gi"),),
        base=(("LLMService", "spec.scheduling", {"policy": "qlm"}),),
        behaviour=lambda r: _policy(r).model_weights_bytes, honoured="qlm: model swap time"),
    Row("LLMService.spec.requestClasses[].name", "config:classes",
        (("LLMService", "spec.requestClasses.1", {"name": "other"}),),
        behaviour=lambda r: sorted(r.config.classes), honoured="worker: class resolution"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.slo.ttftSeconds", "config:classes.chat.slo.ttftSeconds",
        (("LLMService", OVERRIDE, {"slo": {"ttftSeconds": 3}}),),
        behaviour=lambda r: _service_class("chat")(r).ttft_slo_s, honoured="policies, SLO accounting"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.slo.itlSeconds", "config:classes.chat.slo.itlSeconds",
        (("LLMService", OVERRIDE, {"slo": {"itlSeconds": 0.5}}),),
        behaviour=lambda r: _service_class("chat")(r).itl_slo_s, honoured="Chiron local, SLO accounting"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.slo.deadlineSeconds",
        "config:classes.chat.slo.deadlineSeconds",
        (("LLMService", OVERRIDE, {"slo": {"deadlineSeconds": 100}}),),
        behaviour=lambda r: _service_class("chat")(r).deadline_s, honoured="edf, qlm, SLO accounting"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.qoe.readingSpeedTokensPerSecond",
        "config:classes.chat.qoe.readingSpeedTokensPerSecond",
        (("LLMService", OVERRIDE, {"qoe": {"readingSpeedTokensPerSecond": 9}}),),
        behaviour=lambda r: _service_class("chat")(r).reading_speed_tps, honoured="qoe, pacer"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.qoe.ttftTargetSeconds",
        "config:classes.chat.qoe.ttftTargetSeconds",
        (("LLMService", OVERRIDE, {"qoe": {"ttftTargetSeconds": 2}}),),
        behaviour=lambda r: _service_class("chat")(r).ttft_target_s, honoured="qoe, pacer"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.priority", "config:classes.chat.priority",
        (("LLMService", OVERRIDE, {"priority": 7}),),
        behaviour=lambda r: _service_class("chat")(r).priority, honoured="policies' tie and overload order"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.queue.maxQueued", "config:classes.chat.queue.maxQueued",
        (("LLMService", OVERRIDE, {"queue": {"maxQueued": 3}}),), honoured="worker admission (429)"),
    Row(f"LLMService.{OVERRIDE.replace('.0.', '[].')}.queue.maxQueueTimeSeconds",
        "config:classes.chat.queue.maxQueueTimeSeconds",
        (("LLMService", OVERRIDE, {"queue": {"maxQueueTimeSeconds": 3}}),), honoured="worker queue timeout"),
    Row("LLMService.spec.defaultClass", "config:models.0.defaultClass",
        (("LLMService", "spec.defaultClass", "offline"),),
        behaviour=lambda r: r.config.default_class(r.config.models[0]),
        honoured="worker: class of bare requests"),
    Row("LLMService.spec.scheduling.policy", "config:scheduling.policy",
        (("LLMService", "spec.scheduling", {"policy": "fcfs"}),),
        behaviour=lambda r: type(_policy(r)).__name__, honoured="worker: the policy"),
    Row("LLMService.spec.scheduling.policy", "config:scheduling.pacing",
        (("LLMService", "spec.scheduling", {"policy": "fcfs"}),), honoured="worker: token pacer (qoe)"),
    Row("LLMService.spec.scheduling.fairShare.enabled", "config:scheduling.fairShare.enabled",
        (("LLMService", "spec.scheduling.fairShare", {"enabled": True}),),
        behaviour=lambda r: type(r.config.make_policy()).__name__, honoured="worker: VTC around the policy"),
    Row("LLMService.spec.scheduling.fairShare.inputWeight", "config:scheduling.fairShare.inputWeight",
        (("LLMService", "spec.scheduling.fairShare.inputWeight", 3.0),),
        base=(("LLMService", "spec.scheduling.fairShare", {"enabled": True}),),
        behaviour=lambda r: r.config.make_policy().input_weight, honoured="VTC: service per prompt token"),
    Row("LLMService.spec.scheduling.fairShare.outputWeight", "config:scheduling.fairShare.outputWeight",
        (("LLMService", "spec.scheduling.fairShare.outputWeight", 4.0),),
        base=(("LLMService", "spec.scheduling.fairShare", {"enabled": True}),),
        behaviour=lambda r: r.config.make_policy().output_weight, honoured="VTC: service per output token"),
    Row("LLMService.spec.scheduling.fairShare.liftCredit", "config:scheduling.fairShare.liftCredit",
        (("LLMService", "spec.scheduling.fairShare.liftCredit", 65536.0),),
        base=(("LLMService", "spec.scheduling.fairShare", {"enabled": True}),),
        behaviour=lambda r: r.config.make_policy().lift_credit, honoured="VTC: the lift's credit"),
    Row("LLMService.spec.scheduling.settings", "config:scheduling.settings.horizonS",
        (("LLMService", "spec.scheduling.settings", {"horizonS": 3.0}),),
        behaviour=lambda r: _policy(r).horizon_s, honoured="the policy's settings"),
    Row("LLMService.spec.predictor.enabled", "config:scheduling.settings.predictor",
        (("LLMService", "spec.predictor", {"enabled": False}),), base=ISRTF_TEXT, honoured="isrtf predictor"),
    Row("LLMService.spec.predictor.encoder", "config:scheduling.settings.predictorEncoder",
        (("LLMService", "spec.predictor", {"encoder": "sentence-transformers/all-mpnet-base-v2"}),),
        base=ISRTF_TEXT, honoured="isrtf text predictor: checked against the checkpoint"),
    Row("LLMService.spec.predictor.checkpoint", "config:scheduling.settings.predictorCheckpoint",
        (("LLMService", "spec.predictor", {"checkpoint": "/predictors/v2"}),),
        base=ISRTF_TEXT, honoured="isrtf text predictor: the trained head loaded"),
    Row("LLMService.spec.predictor.online", "config:scheduling.settings.predictorOnline",
        (("LLMService", "spec.predictor", {"online": False}),),
        base=ISRTF_TEXT, honoured="isrtf text predictor: learns online from finished requests"),
    Row("LLMService.spec.predictor.repredictEveryTokens", "config:scheduling.settings.windowTokens",
        (("LLMService", "spec.predictor", {"enabled": False, "repredictEveryTokens": 7}),), base=ISRTF_MEAN,
        behaviour=lambda r: _policy(r).window, honoured="isrtf re-prediction window"),
    # RequestClass
    Row("RequestClass.spec.kind", "config:classes.offline.kind",
        (("RequestClass", "offline:spec.kind", "interactive"),),
        behaviour=_service_class("offline"), honoured="Chiron roles, policies"),
    Row("RequestClass.spec.slo.ttftSeconds", "config:classes.chat.slo.ttftSeconds",
        (("RequestClass", "chat:spec.slo.ttftSeconds", 4),),
        behaviour=lambda r: _service_class("chat")(r).ttft_slo_s, honoured="policies, SLO accounting"),
    Row("RequestClass.spec.slo.itlSeconds", "config:classes.chat.slo.itlSeconds",
        (("RequestClass", "chat:spec.slo.itlSeconds", 0.3),),
        behaviour=lambda r: _service_class("chat")(r).itl_slo_s, honoured="Chiron local, SLO accounting"),
    Row("RequestClass.spec.slo.deadlineSeconds", "config:classes.offline.slo.deadlineSeconds",
        (("RequestClass", "offline:spec.slo.deadlineSeconds", 60),),
        behaviour=lambda r: _service_class("offline")(r).deadline_s, honoured="edf, qlm, SLO accounting"),
    Row("RequestClass.spec.qoe.readingSpeedTokensPerSecond",
        "config:classes.chat.qoe.readingSpeedTokensPerSecond",
        (("RequestClass", "chat:spec.qoe", {"readingSpeedTokensPerSecond": 10}),),
        behaviour=lambda r: _service_class("chat")(r).reading_speed_tps, honoured="qoe, pacer"),
    Row("RequestClass.spec.qoe.ttftTargetSeconds", "config:classes.chat.qoe.ttftTargetSeconds",
        (("RequestClass", "chat:spec.qoe", {"ttftTargetSeconds": 3}),),
        behaviour=lambda r: _service_class("chat")(r).ttft_target_s, honoured="qoe, pacer"),
    Row("RequestClass.spec.priority", "config:classes.chat.priority",
        (("RequestClass", "chat:spec.priority", 50),),
        behaviour=lambda r: _service_class("chat")(r).priority, honoured="policies' tie and overload order"),
    Row("RequestClass.spec.queue.maxQueued", "config:classes.chat.queue.maxQueued",
        (("RequestClass", "chat:spec.queue", {"maxQueued": 9}),), honoured="worker admission (429)"),
    Row("RequestClass.spec.queue.maxQueueTimeSeconds", "config:classes.chat.queue.maxQueueTimeSeconds",
        (("RequestClass", "chat:spec.queue", {"maxQueueTimeSeconds": 9}),), honoured="worker queue timeout"),
    Row("RequestClass.spec.match.header", "config:classes.chat.match.header",
        (("RequestClass", "chat:spec.match", {"header": "X-Tier"}),),
        behaviour=_selected({"X-Tier": "chat"}),
        honoured="worker and router: class resolution"),
    Row("RequestClass.spec.match.value", "config:classes.chat.match.value",
        (("RequestClass", "chat:spec.match", {"value": "talk"}),),
        behaviour=_selected({"X-Tessera-Class": "talk"}),
        honoured="worker and router: class resolution"),
    # ServingPool
    Row("ServingPool.spec.gpu.perInstance", "vllm:--tensor-parallel-size",
        (("ServingPool", "spec.gpu.perInstance", 2),), honoured="vLLM (the group's TP)"),
    Row("ServingPool.spec.gpu.perInstance", "config:models.0.kvCapacityTokens",
        (("ServingPool", "spec.gpu.perInstance", 2),), honoured="every policy's KV capacity"),
    Row("ServingPool.spec.gpu.type", "config:models.0.profile",
        (("ServingPool", "spec.gpu.type", "A100"),),
        honoured="every policy's step-time estimates: the placement's profile of the GPU (vLLM pools)"),
    Row("ServingPool.spec.gpu.memory", "config:models.0.kvCapacityTokens",
        (("ServingPool", "spec.gpu.memory", "40Gi"),), honoured="every policy's KV capacity"),
    Row("ServingPool.spec.autoscaling.enabled", "config:scheduling.autoscale.enabled",
        (("ServingPool", "spec.autoscaling.enabled", False),), honoured="worker: Chiron local autoscaler"),
    Row("ServingPool.spec.autoscaling.batchSize.min", "config:scheduling.batch.min",
        (("ServingPool", "spec.autoscaling.batchSize.min", 8),), honoured="Chiron local: lower bound"),
    Row("ServingPool.spec.autoscaling.batchSize.initial", "config:scheduling.batch.initial",
        (("ServingPool", "spec.autoscaling.batchSize.initial", 32),), honoured="worker: starting batch size"),
    Row("ServingPool.spec.autoscaling.batchSize.initial", "config:scheduling.settings.defaultBatch",
        (("ServingPool", "spec.autoscaling.batchSize.initial", 32),),
        base=(("LLMService", "spec.scheduling", {"policy": "qlm"}),),
        behaviour=lambda r: _policy(r).default_batch, honoured="qlm: group size before a batch is seen"),
    Row("ServingPool.spec.autoscaling.batchSize.max", "config:scheduling.batch.max",
        (("ServingPool", "spec.autoscaling.batchSize.max", 128),), honoured="worker: in-flight cap"),
    Row("ServingPool.spec.autoscaling.batchSize.max", "vllm:--max-num-seqs",
        (("ServingPool", "spec.autoscaling.batchSize.max", 128),), honoured="vLLM: sequences run at once"),
    Row("ServingPool.spec.extraVllmArgs", "vllm:--enable-prefix-caching",
        (("ServingPool", "spec.extraVllmArgs", ["--enable-prefix-caching"]),), honoured="vLLM"),
    Row("ServingPool.spec.extraVllmArgs", "config:models.0.kvCapacityTokens",
        (("ServingPool", "spec.extraVllmArgs", ["--gpu-memory-utilization", "0.5"]),),
        honoured="every policy's KV capacity (vLLM's share of the GPU memory)"),
    Row("ServingPool.spec.kvEvents", "vllm:--kv-events-config", (("ServingPool", "spec.kvEvents", True),),
        honoured="vLLM: publishes KV events for the router's precise-prefix route"),
)  # fmt: skip

NOT_FOR_WORKER: dict[str, str] = {
    "LLMService.spec.model.tensorParallelSize": "placement's smallest TP; the group's TP reaches vLLM and "
    "kvCapacityTokens (rows of ServingPool.spec.gpu.perInstance)",
    "LLMService.spec.poolRef.name": "which pool places the service",
    # An adapter needs a second LLMService (its base): tests/test_lora_adapters.py follows these fields
    # into the worker configuration (models[].adapterOf, adapterSource, adapterRank) and vLLM's flags.
    "LLMService.spec.model.adapter.base": "placement: served by its base's group (config adapterOf)",
    "LLMService.spec.model.adapter.source": "config models[].adapterSource (tests/test_lora_adapters.py)",
    "LLMService.spec.model.adapter.rank": "config models[].adapterRank; checked against maxLoraRank",
    "ServingPool.spec.maxLoraRank": "vLLM --max-lora-rank of a base with adapters (test_lora_adapters)",
    "ServingPool.spec.maxLoras": "vLLM --max-loras of a base with adapters (tests/test_lora_adapters.py)",
    "LLMService.spec.replicas.min": "placement: replica bounds",
    "LLMService.spec.replicas.max": "placement: replica bounds",
    "LLMService.spec.expectedLoad.requestsPerSecond": "placement: load before the workers measure one",
    "LLMService.spec.expectedLoad.promptTokens": "placement: load before the workers measure one",
    "LLMService.spec.expectedLoad.outputTokens": "placement: load before the workers measure one",
    "LLMService.spec.scaleToZero.afterSeconds": "router's activator, local mode: when an idle service sleeps",
    "LLMService.spec.scaleToZero.holdSeconds": "router's activator: how long a request waits for a wake-up",
    "LLMService.spec.scaleToZero.maxHeld": "router's activator: requests held while the service wakes",
    "ServingPool.spec.gpu.resourceName": "pod: the extended resource the engine container requests",
    "ServingPool.spec.nodeSelector": "pod scheduling",
    "ServingPool.spec.tolerations[].key": "pod scheduling",
    "ServingPool.spec.tolerations[].operator": "pod scheduling",
    "ServingPool.spec.tolerations[].value": "pod scheduling",
    "ServingPool.spec.tolerations[].effect": "pod scheduling",
    "ServingPool.spec.tolerations[].tolerationSeconds": "pod scheduling",
    "ServingPool.spec.instances.min": "operator: instance counts",
    "ServingPool.spec.instances.max": "operator: instance counts",
    "ServingPool.spec.instances.desired": "operator: instance counts",
    "ServingPool.spec.autoscaling.batchJustInTime": "operator: Chiron's global autoscaler (batch launches)",
    "ServingPool.spec.autoscaling.intervalSeconds": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.overProvisioning": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.overProvisioningBand": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.scaleUpCooldownSeconds": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.scaleDownCooldownSeconds": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.forecastWindowSeconds": "operator: Chiron's global autoscaler",
    "ServingPool.spec.autoscaling.forecastUtilization": "operator: Chiron's global autoscaler",
    "ServingPool.spec.placement.strategy": "operator: placement",
    "ServingPool.spec.placement.maxServicesPerGroup": "operator: placement",
    "ServingPool.spec.placement.replacementInterval.initialSeconds": "operator: re-placement interval",
    "ServingPool.spec.placement.replacementInterval.minSeconds": "operator: re-placement interval",
    "ServingPool.spec.placement.replacementInterval.maxSeconds": "operator: re-placement interval",
    "ServingPool.spec.placement.replacementInterval.beta": "operator: re-placement interval",
    "ServingPool.spec.placement.replacementInterval.loadShiftThreshold": "operator: early re-placement",
    "ServingPool.spec.placement.handoverTimeoutSeconds": "operator: re-placement roll-out",
    "ServingPool.spec.images.worker": "pod: container image",
    "ServingPool.spec.images.vllm": "pod: container image",
    "ServingPool.spec.images.pullPolicy": "pod: image pull policy",
    "ServingPool.spec.pod.resources.cpuPerGpu": "pod: the model-server container's CPU request",
    "ServingPool.spec.pod.resources.memoryPerGpu": "pod: the model-server container's memory",
    "ServingPool.spec.pod.shmSize": "pod: the /dev/shm volume of the model servers",
    "ServingPool.spec.pod.modelCache.claimName": "pod: the model-weight cache volume (HF_HOME)",
    "ServingPool.spec.pod.modelCache.hostPath": "pod: the model-weight cache volume (HF_HOME)",
    "ServingPool.spec.pod.modelCache.mountPath": "pod: where the model servers' HF_HOME is",
    "ServingPool.spec.pod.hubTokenSecret.name": "pod: the model servers' HF_TOKEN",
    "ServingPool.spec.pod.hubTokenSecret.key": "pod: the model servers' HF_TOKEN",
    "ServingPool.spec.pod.topologySpread[].topologyKey": "pod scheduling",
    "ServingPool.spec.pod.topologySpread[].maxSkew": "pod scheduling",
    "ServingPool.spec.pod.topologySpread[].whenUnsatisfiable": "pod scheduling",
    "ServingPool.spec.pod.engineSecurity.runAsRoot": "pod: the model servers' user",
    "ServingPool.spec.pod.engineSecurity.runAsUser": "pod: the model servers' user",
    "ServingPool.spec.pod.disruptionBudget.maxUnavailable": "the group's PodDisruptionBudget",
}


def _setting(r: Rendered, setting: str) -> Any:
    kind, _, where = setting.partition(":")
    if kind == "config":
        return _get(r.json, where)
    if kind == "vllm":
        return r.flag(where)
    assert kind == "pod", setting
    return json.dumps(_get(r.sts["spec"]["template"]["spec"], where), sort_keys=True)


@pytest.mark.parametrize("row", TABLE, ids=[f"{r.field}->{r.setting}" for r in TABLE])
def test_field_reaches_the_worker(row: Row) -> None:
    before = render(*_docs(row.base))
    after = render(*_docs(row.base + row.change))
    assert _setting(before, row.setting) != _setting(after, row.setting), row
    if row.behaviour is not None:
        assert row.behaviour(before) != row.behaviour(after), row


# -- every field is accounted for -------------------------------------------------------------------


def _models(annotation: Any) -> Iterator[tuple[str, type[BaseModel]]]:
    """The API models inside a field's type, with "[]" for a list of them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        yield from _models(args[0])
    elif origin in (typing.Union, UnionType):
        for arg in args:
            yield from _models(arg)
    elif origin is list:
        yield from (("[]" + suffix, model) for suffix, model in _models(args[0]))
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield "", annotation


def spec_fields(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Every leaf field of a spec model, as camelCase paths (a map is a leaf)."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}"
        nested = list(_models(info.annotation))
        if not nested:
            yield path
        for suffix, sub in nested:
            yield from spec_fields(sub, path + suffix)


ALL_FIELDS = sorted(
    [
        *spec_fields(LLMServiceSpec, "LLMService.spec"),
        *spec_fields(RequestClassSpec, "RequestClass.spec"),
        *spec_fields(ServingPoolSpec, "ServingPool.spec"),
    ]
)


def test_every_spec_field_is_accounted_for() -> None:
    in_table = {row.field for row in TABLE}
    missing = [f for f in ALL_FIELDS if f not in in_table and f not in NOT_FOR_WORKER]
    assert not missing, f"spec fields neither in TABLE nor in NOT_FOR_WORKER (say where they go): {missing}"
    stale = sorted((in_table | set(NOT_FOR_WORKER)) - set(ALL_FIELDS))
    assert not stale, f"rows naming no spec field: {stale}"
    assert not in_table & set(NOT_FOR_WORKER), "a field is both for the worker and not"


# -- vLLM's batch limit, model swapping, restarts ---------------------------------------------------


@pytest.mark.parametrize("autoscale", [True, False])
def test_the_workers_in_flight_cap_never_exceeds_vllms_max_num_seqs(autoscale: bool) -> None:
    from tessera.worker.engines.sim_realtime import SimEngine
    from tessera.worker.metrics import WorkerMetrics

    r = render(*_docs((("ServingPool", "spec.autoscaling.enabled", autoscale),)))
    scheduling, entry = r.config.scheduling, r.config.models[0]
    profile = entry.profile.to_profile(entry.name, entry.kv_capacity_tokens)
    sched = one_model_scheduler(
        SimEngine(entry.name, profile, entry.max_model_len),
        make_policy(scheduling.policy, scheduling.settings),
        profile=profile,
        batch=scheduling.batch,
        autoscale=scheduling.autoscale,
        max_queued=scheduling.max_queued,
        class_limits={},
        metrics=WorkerMetrics(),
    )
    seqs = int(r.flag("--max-num-seqs"))
    assert seqs == 512  # the pool's batchSize.max
    assert sched.max_batch == (512 if autoscale else 64) and sched.batch_size <= seqs
    assert sched.chiron.max_batch <= seqs  # Chiron's local autoscaler moves within [min, max]
    assert int(r.flag("--max-num-batched-tokens")) >= seqs  # vLLM refuses fewer


def _shared(engine: str = "vllm", extra: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], WorkerConfig]:
    """Two 8B services on a pool of one GPU: placement co-locates them in one group."""
    pool, service, classes = _docs(
        (("ServingPool", "spec.instances.max", 1), ("ServingPool", "spec.extraVllmArgs", list(extra)))
    )
    pool["metadata"]["annotations"] = {children.ENGINE_ANNOTATION: engine}
    other = copy.deepcopy(service)
    other["metadata"].update(name="qwen", uid="u-qwen")
    other["spec"]["model"] = {"name": "Qwen/Qwen2.5-7B-Instruct", "weightsSize": "15Gi"}
    decided = desired_pool(pool, [service, other], classes, None, 0.0)
    assert isinstance(decided, PoolDesired) and decided.plan is not None
    (group,) = decided.plan.groups
    assert len(group.services) == 2
    (sts,) = [c for c in decided.children if c["kind"] == "StatefulSet"]
    return sts["spec"]["template"]["spec"]["containers"], decided.configs[group.name]


def test_co_located_vllm_models_swap_by_sleep_mode() -> None:
    worker, engine = _shared()[0]
    servers = engine_servers(engine)
    assert len(servers) == 2
    for args in servers:
        assert "--enable-sleep-mode" in args
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in engine["env"]
    assert all(e["name"] != "VLLM_SERVER_DEV_MODE" for e in worker["env"])
    # auto: the worker swaps where vLLM reports sleep mode; vLLM on CPU has none and keeps both resident
    assert [m.sleep_mode for m in _shared()[1].models] == ["auto", "auto"]


@pytest.mark.parametrize(("extra", "budget"), [((), 0.9), (("--gpu-memory-utilization=0.8",), 0.8)])
def test_co_located_vllm_processes_split_the_gpu_memory(extra: tuple[str, ...], budget: float) -> None:
    """Each vLLM process takes its --gpu-memory-utilization at start and refuses to start when less is
    free: two processes at the pool's share would not both start."""
    containers, config = _shared(extra=extra)
    shares = []
    for args in engine_servers(containers[1]):
        (at,) = [i for i, a in enumerate(args) if a.startswith("--gpu-memory-utilization")]
        shares.append(float(args[at + 1]))
    assert budget - 0.01 < sum(shares) <= budget
    alone = render().config.models[0].kv_capacity_tokens
    assert all(0 < m.kv_capacity_tokens < alone / 2 for m in config.models)


def test_a_single_model_and_the_sim_engine_never_sleep() -> None:
    r = render()
    assert r.flag("--enable-sleep-mode") is False
    engine = r.sts["spec"]["template"]["spec"]["containers"][1]
    assert all(e["name"] != "VLLM_SERVER_DEV_MODE" for e in engine["env"])
    assert [m.sleep_mode for m in r.config.models] == ["off"]
    containers, config = _shared("sim")
    assert len(containers) == 1 and [m.sleep_mode for m in config.models] == ["off", "off"]


def _template(r: Rendered) -> dict[str, Any]:
    return r.sts["spec"]["template"]


@pytest.mark.parametrize(
    "change",
    [
        ("RequestClass", "chat:spec.slo.ttftSeconds", 9),
        ("RequestClass", "chat:spec.priority", 3),
        ("LLMService", "spec.scheduling", {"policy": "fcfs"}),
        ("ServingPool", "spec.autoscaling.batchSize.initial", 16),
        ("ServingPool", "spec.gpu.memory", "40Gi"),  # the KV capacity reloads in place
    ],
)
def test_what_the_worker_reloads_rolls_no_pod(change: tuple[str, str, Any]) -> None:
    before, after = render(), render(*_docs((change,)))
    assert before.json != after.json  # the ConfigMap changes; the worker reloads it
    assert _template(before) == _template(after)


@pytest.mark.parametrize(
    "change",
    [
        ("LLMService", "spec.model.maxModelLength", 1024),
        ("LLMService", "spec.model.name", "acme/Llama-3.1-8B"),
        ("ServingPool", "spec.autoscaling.batchSize.max", 1024),  # vLLM's --max-num-seqs
        ("ServingPool", "spec.extraVllmArgs", ["--enable-prefix-caching"]),
        ("ServingPool", "spec.kvEvents", True),  # vLLM's --kv-events-config
    ],
)
def test_what_the_worker_cannot_reload_rolls_the_pods(change: tuple[str, str, Any]) -> None:
    before, after = render(), render(*_docs((change,)))
    hash_before = _template(before)["metadata"]["annotations"][children.RESTART_HASH_ANNOTATION]
    assert hash_before != _template(after)["metadata"]["annotations"][children.RESTART_HASH_ANNOTATION]


RESTART_CHANGES = {
    "name": "other-model",
    "engine": "sim",
    "url": "http://127.0.0.1:9999",
    "sleepMode": "auto",
    "tokenizer": "/tokenizers/llama",
    "maxModelLen": 1024,
    "toolParser": "hermes",
}


@pytest.mark.parametrize("field", children.RESTART_FIELDS)
def test_the_restart_hash_covers_what_the_worker_refuses_to_reload(field: str) -> None:
    from tessera.api.worker_config import ConfigError
    from tessera.worker.runtime import Worker

    config = render().config
    if field == "launch":
        entry = {"engine": "vllm", "url": None, "launch": {"modelDir": "/models/llama"}}
    else:
        entry = {field: RESTART_CHANGES[field]} | ({"url": None} if field == "engine" else {})
    body = config.to_json()
    body["models"][0] = {k: v for k, v in (body["models"][0] | entry).items() if v is not None}
    if field == "name":
        body["models"][0]["defaultClass"] = "chat"
    changed = WorkerConfig.model_validate(body)
    with pytest.raises(ConfigError, match="restart"):
        Worker(config).reload(changed)
    assert children.restart_hash(config, []) != children.restart_hash(changed, [])
    # a change the worker reloads keeps the hash
    body = config.to_json()
    body["classes"]["chat"]["slo"]["ttftSeconds"] = 7
    assert children.restart_hash(config, []) == children.restart_hash(WorkerConfig.model_validate(body), [])


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("predictor", "problem"),
    [
        ({"repredictEveryTokens": 0}, "repredictEveryTokens"),
        ({"repredictEveryTokens": 70000}, "repredictEveryTokens"),
        ({"checkpoint": "s3://bucket/head"}, "checkpoint"),
        ({"encoder": "not an id"}, "encoder"),
        (
            {"enabled": False, "_settings": {"predictor": "text"}},
            "predictor may not be 'text' when predictor.enabled",
        ),
    ],
)
def test_bad_predictor_fields_are_refused_naming_them(predictor: dict[str, Any], problem: str) -> None:
    """By the API server (the CRD's schema and CEL rules) and by the models the operator loads."""
    from tessera.api import LLMService
    from tessera.api.crd_check import server_side_problems

    settings = predictor.pop("_settings", {})
    body = copy.deepcopy(SERVICE)
    body["spec"]["scheduling"] = {"policy": "isrtf", "settings": settings}
    body["spec"]["predictor"] = predictor
    (refused,) = server_side_problems(body)
    assert problem in refused, refused
    with pytest.raises(ValueError, match=problem):
        LLMService.model_validate(body)
    body["spec"]["predictor"] = {}
    body["spec"]["scheduling"]["settings"] = {}
    assert server_side_problems(body) == []


def test_a_seallm_pod_runs_db_with_the_placements_statistics_of_each_model() -> None:
    """``scheduling.policy: seallm``: the operator fills DB's per-model statistics from the placement's
    own (each service's isolated execution time), so the pod does not run DB on the default."""
    from tessera.api import LLMService, ServingPool
    from tessera.control.inputs import service_input
    from tessera.control.placement_sim import stats_of

    pool, service, classes = _docs((("LLMService", "spec.scheduling", {"policy": "seallm"}),))
    r = render(pool, service, classes)
    policy = _policy(r)
    model = service["spec"]["model"]["name"]
    planned = service_input(ServingPool.model_validate(pool), LLMService.model_validate(service))
    expected = stats_of(planned, [(h.prompt_tokens, h.output_tokens) for h in planned.history])
    assert policy.book.stats[model] == expected and expected.mean_exec_s != 10.0
