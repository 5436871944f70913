"""Bad-input suite of custom resource specs: each invalid ServingPool, LLMService and RequestClass goes
through the operator's own validation (``tessera.control.pool_plan.parse``, what every pass and the
service and class reports call) and is refused with a SpecError naming the field; nothing else is
raised (no crash). Where the CRD can express the check, the generated schema and its CEL rules (checked
offline as the API server would, ``tessera.api.crd_check``) refuse it too, so such objects never reach
the operator at all.

The quickstart's objects are the valid base; each case changes one thing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.api import SpecError
from tessera.api.crd_check import server_side_problems
from tessera.control.pool_plan import parse

DOCS = [
    d
    for d in yaml.safe_load_all(
        (Path(__file__).resolve().parents[1] / "examples/quickstart.yaml").read_text()
    )
]
BASE = {
    "pool": next(d for d in DOCS if d["kind"] == "ServingPool"),
    "service": next(d for d in DOCS if d["kind"] == "LLMService"),
    "chat": next(d for d in DOCS if d["kind"] == "RequestClass" and d["spec"]["kind"] == "interactive"),
    "offline": next(d for d in DOCS if d["kind"] == "RequestClass" and d["spec"]["kind"] == "batch"),
}
_DELETE = object()


def at(path: str, value: Any = _DELETE) -> Callable[[dict[str, Any]], None]:
    """A change setting the dotted ``path`` of a body to ``value`` (removing it when left out)."""

    def change(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = body
        for part in parents:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = copy.deepcopy(value)

    return change


# (id, base, change, text the message must contain (the field), whether the CRD refuses it too)
CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], str, bool]] = [
    # -- ServingPool ---------------------------------------------------------------------------------
    ("pool-gpu-per-instance-0", "pool", at("spec.gpu.perInstance", 0), "gpu.perInstance", True),
    ("pool-gpu-per-instance-17", "pool", at("spec.gpu.perInstance", 17), "gpu.perInstance", True),
    ("pool-gpu-per-instance-text", "pool", at("spec.gpu.perInstance", "two"), "gpu.perInstance", True),
    ("pool-gpu-memory-word", "pool", at("spec.gpu.memory", "lots"), "gpu.memory", True),
    ("pool-gpu-memory-negative", "pool", at("spec.gpu.memory", "-1Gi"), "gpu.memory", True),
    ("pool-gpu-memory-zero", "pool", at("spec.gpu.memory", "0Gi"), "gpu.memory", True),
    ("pool-gpu-type-empty", "pool", at("spec.gpu.type", ""), "gpu.type", True),
    ("pool-gpu-missing", "pool", at("spec.gpu"), "gpu", True),
    ("pool-instances-missing", "pool", at("spec.instances"), "instances", True),
    ("pool-instances-max-million", "pool", at("spec.instances.max", 10**6), "instances.max", True),
    ("pool-instances-max-zero", "pool", at("spec.instances.max", 0), "instances.max", True),
    ("pool-instances-max-float", "pool", at("spec.instances.max", 2.5), "instances.max", True),
    ("pool-instances-max-text", "pool", at("spec.instances.max", "four"), "instances.max", True),
    ("pool-instances-min-negative", "pool", at("spec.instances.min", -1), "instances.min", True),
    ("pool-instances-min-above-max", "pool", at("spec.instances", {"min": 3, "max": 1}), "min", True),
    (
        "pool-instances-desired-above-max",
        "pool",
        at("spec.instances", {"max": 2, "desired": 3}),
        "desired",
        True,
    ),
    ("pool-interval-tiny", "pool", at("spec.autoscaling.intervalSeconds", 1e-9), "intervalSeconds", True),
    ("pool-interval-negative", "pool", at("spec.autoscaling.intervalSeconds", -5), "intervalSeconds", True),
    ("pool-batch-max-billion", "pool", at("spec.autoscaling.batchSize.max", 10**9), "batchSize.max", True),
    (
        "pool-batch-min-above-initial",
        "pool",
        at("spec.autoscaling.batchSize", {"min": 64, "initial": 32}),
        "initial",
        True,
    ),
    ("pool-autoscaling-unknown", "pool", at("spec.autoscaling.speed", "fast"), "speed", True),
    ("pool-strategy-unknown", "pool", at("spec.placement.strategy", "random"), "strategy", True),
    ("pool-beta-above-1", "pool", at("spec.placement.replacementInterval.beta", 1.5), "beta", True),
    (
        "pool-interval-min-above-initial",
        "pool",
        at("spec.placement.replacementInterval", {"minSeconds": 600, "initialSeconds": 300}),
        "minSeconds",
        True,
    ),
    (
        "pool-services-per-group-0",
        "pool",
        at("spec.placement.maxServicesPerGroup", 0),
        "maxServicesPerGroup",
        True,
    ),
    (
        "pool-handover-negative",
        "pool",
        at("spec.placement.handoverTimeoutSeconds", -1),
        "handoverTimeoutSeconds",
        True,
    ),
    ("pool-vllm-tp", "pool", at("spec.extraVllmArgs", ["-tp", "2"]), "extraVllmArgs[0]", True),
    (
        "pool-vllm-underscore",
        "pool",
        at("spec.extraVllmArgs", ["--max_model_len=9"]),
        "model.maxModelLength",
        True,
    ),
    ("pool-vllm-config", "pool", at("spec.extraVllmArgs", ["--config", "x.yaml"]), "extraVllmArgs[0]", True),
    (
        "pool-vllm-args-string",
        "pool",
        at("spec.extraVllmArgs", "--enable-prefix-caching"),
        "extraVllmArgs",
        True,
    ),
    ("pool-vllm-arg-empty", "pool", at("spec.extraVllmArgs", [""]), "extraVllmArgs", True),
    ("pool-vllm-arg-huge", "pool", at("spec.extraVllmArgs", ["-" * 300]), "extraVllmArgs", True),
    ("pool-vllm-args-too-many", "pool", at("spec.extraVllmArgs", ["--x"] * 65), "extraVllmArgs", True),
    ("pool-node-selector-string", "pool", at("spec.nodeSelector", "gpu"), "nodeSelector", True),
    ("pool-tolerations-not-list", "pool", at("spec.tolerations", {"key": "x"}), "tolerations", True),
    (
        "pool-toleration-operator",
        "pool",
        at("spec.tolerations", [{"key": "k", "operator": "Maybe"}]),
        "operator",
        True,
    ),
    ("pool-cpu-per-gpu-word", "pool", at("spec.pod.resources.cpuPerGpu", "lots"), "cpuPerGpu", True),
    (
        "pool-disruption-zero",
        "pool",
        at("spec.pod.disruptionBudget.maxUnavailable", 0),
        "maxUnavailable",
        True,
    ),
    ("pool-image-empty", "pool", at("spec.images.worker", ""), "images.worker", True),
    ("pool-pull-policy", "pool", at("spec.images.pullPolicy", "Sometimes"), "pullPolicy", True),
    ("pool-unknown-field", "pool", at("spec.replicaz", 3), "replicaz", True),
    ("pool-spec-null", "pool", at("spec", None), "spec", True),
    ("pool-spec-list", "pool", at("spec", []), "spec", True),
    ("pool-spec-missing", "pool", at("spec"), "spec", True),
    # -- LLMService ----------------------------------------------------------------------------------
    ("svc-model-name-empty", "service", at("spec.model.name", ""), "model.name", True),
    ("svc-model-missing", "service", at("spec.model"), "model", True),
    ("svc-max-model-length-huge", "service", at("spec.model.maxModelLength", 10**12), "maxModelLength", True),
    ("svc-max-model-length-small", "service", at("spec.model.maxModelLength", 8), "maxModelLength", True),
    ("svc-tensor-parallel-3", "service", at("spec.model.tensorParallelSize", 3), "tensorParallelSize", True),
    ("svc-dtype-int4", "service", at("spec.model.dtype", "int4"), "dtype", True),
    ("svc-weights-size-word", "service", at("spec.model.weightsSize", "big"), "weightsSize", True),
    (
        "svc-source-and-volume",
        "service",
        at("spec.model", {"name": "m", "source": "s3://b/m", "volume": {"claimName": "w"}}),
        "source",
        True,
    ),
    ("svc-model-unknown-field", "service", at("spec.model.quantize", "awq"), "quantize", True),
    ("svc-pool-ref-missing", "service", at("spec.poolRef"), "poolRef", True),
    ("svc-pool-ref-empty", "service", at("spec.poolRef.name", ""), "poolRef.name", True),
    ("svc-classes-empty", "service", at("spec.requestClasses", []), "requestClasses", True),
    (
        "svc-classes-duplicated",
        "service",
        at("spec.requestClasses", [{"name": "chat"}, {"name": "chat"}]),
        "requestClasses",
        False,  # the schema has no uniqueness of list entries by one key here
    ),
    ("svc-class-entry-no-name", "service", at("spec.requestClasses", [{}]), "requestClasses", True),
    ("svc-default-class-unknown", "service", at("spec.defaultClass", "nope"), "defaultClass", True),
    ("svc-policy-unknown", "service", at("spec.scheduling.policy", "lottery"), "policy", True),
    (
        "svc-setting-unknown",
        "service",
        at("spec.scheduling", {"policy": "fcfs", "settings": {"x": 1}}),
        "settings",
        True,
    ),
    ("svc-replicas-min-above-max", "service", at("spec.replicas", {"min": 5, "max": 2}), "min", True),
    ("svc-spec-string", "service", at("spec", "llama"), "spec", True),
    # -- RequestClass --------------------------------------------------------------------------------
    ("rc-kind-unknown", "chat", at("spec.kind", "realtime"), "kind", True),
    ("rc-batch-without-deadline", "offline", at("spec.slo", {}), "deadlineSeconds", True),
    ("rc-ttft-tiny", "chat", at("spec.slo.ttftSeconds", 1e-9), "ttftSeconds", True),
    ("rc-ttft-negative", "chat", at("spec.slo.ttftSeconds", -1), "ttftSeconds", True),
    ("rc-itl-zero", "chat", at("spec.slo.itlSeconds", 0), "itlSeconds", True),
    ("rc-deadline-text", "offline", at("spec.slo.deadlineSeconds", "an hour"), "deadlineSeconds", True),
    (
        "rc-reading-speed-negative",
        "chat",
        at("spec.qoe.readingSpeedTokensPerSecond", -4.8),
        "readingSpeed",
        True,
    ),
    ("rc-priority-text", "chat", at("spec.priority", "high"), "priority", True),
    ("rc-max-queued-zero", "chat", at("spec.queue.maxQueued", 0), "maxQueued", True),
    ("rc-queue-time-negative", "chat", at("spec.queue.maxQueueTimeSeconds", -1), "maxQueueTimeSeconds", True),
    ("rc-match-unknown-field", "chat", at("spec.match.regex", ".*"), "regex", True),
    ("rc-slo-unknown-field", "chat", at("spec.slo.p99", 1), "p99", True),
    ("rc-spec-missing", "chat", at("spec"), "spec", True),
]


@pytest.mark.parametrize(
    ("base", "change", "field", "crd"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_spec_is_refused_naming_the_field(
    base: str, change: Callable[[dict[str, Any]], None], field: str, crd: bool
) -> None:
    body = copy.deepcopy(BASE[base])
    body["metadata"]["uid"] = "u"
    change(body)
    try:
        parse(body)
    except SpecError as err:
        assert field in str(err), str(err)
    else:
        pytest.fail(f"accepted: {body.get('spec', body)}")
    if crd:
        assert server_side_problems(body), "the CRD schema accepts it"


def test_the_suite_is_large_and_the_bases_are_valid() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    for body in BASE.values():
        parse(body)
        assert server_side_problems(body) == []
