"""Map the API models (ServingPool, LLMService) onto the planners' plain inputs.

The planners need numbers the custom resources do not carry (iteration-time model, KV bytes per
token). Until measured profiles are wired in, a service gets the default profile below: an 8B-class
model on one H100-class GPU (CHOICE, documented; placement only uses it to weigh services with
traffic, which the operator does not feed yet).
"""

from __future__ import annotations

from collections.abc import Iterable

from tessera.api import LLMService, ServingPool, parse_quantity
from tessera.operator.planners import ChironSettings, LatencyModel, PoolInput, ServiceInput

DEFAULT_LATENCY = LatencyModel(
    decode_c0=0.006, decode_c1=0.00005, decode_c2=1e-7, prefill_p0=0.005, prefill_p1=0.00005
)
DEFAULT_KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
DEFAULT_WEIGHTS_BYTES = 16 * 2**30  # used when weightsSize is unset


def pool_input(pool: ServingPool) -> PoolInput:
    """The planners' view of a ServingPool."""
    spec = pool.spec
    per_instance = spec.gpu.per_instance
    return PoolInput(
        name=pool.name,
        gpu_type=spec.gpu.type,
        gpu_memory_bytes=int(parse_quantity(spec.gpu.memory)),
        max_gpus=spec.instances.max * per_instance,
        # TP stays inside one instance (one pod on one node): the node size is the instance size,
        # rounded up to a power of two as the planners require.
        gpus_per_node=1 << (per_instance - 1).bit_length(),
        max_services_per_group=spec.placement.max_services_per_group,
        min_gpus_per_instance=per_instance,
    )


def service_input(service: LLMService) -> ServiceInput:
    """The planners' view of an LLMService."""
    model = service.spec.model
    weights = parse_quantity(model.weights_size) if model.weights_size else DEFAULT_WEIGHTS_BYTES
    return ServiceInput(
        name=service.name,
        weights_bytes=int(weights),
        kv_bytes_per_token=DEFAULT_KV_BYTES_PER_TOKEN,
        latency=DEFAULT_LATENCY,
        tp_min=model.tensor_parallel_size,
        min_replicas=service.spec.replicas.min,
        p99_context_tokens=model.max_model_length or 4096,
    )


def service_inputs(services: Iterable[LLMService]) -> list[ServiceInput]:
    """Planner inputs of several services, sorted by name (plans must not depend on listing order)."""
    return [service_input(s) for s in sorted(services, key=lambda s: s.name)]


def chiron_settings(pool: ServingPool, max_instances: int) -> ChironSettings:
    """Chiron settings of one placement group of ``pool``; ``max_instances`` is the group's share of
    the pool's budget."""
    autoscaling = pool.spec.autoscaling
    band = min(autoscaling.over_provisioning_band, autoscaling.over_provisioning * 0.99)
    return ChironSettings(
        over_provisioning=autoscaling.over_provisioning,
        band=band,
        eval_interval_s=autoscaling.interval_seconds,
        min_instances=0,
        max_instances=max(1, max_instances),
        scale_up_cooldown_s=autoscaling.scale_up_cooldown_seconds,
        scale_down_cooldown_s=autoscaling.scale_down_cooldown_seconds,
    )
