"""Map the API models (ServingPool, LLMService) onto the planners' plain inputs.

The planners need numbers the custom resources do not carry (iteration-time model, KV bytes per
token). They come from the named step profiles (``tessera.core.profiles.PROFILES``), chosen by
the pool's GPU type and the model's size (``named_profile``). Where none matches, the fallback is
``FALLBACK_PROFILE``, the 8B-class model on one H100 (CHOICE, documented: the most common serving
setup; placement only uses the step profile to weigh services with traffic).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tessera.api import LLMService, ServingPool, parse_quantity
from tessera.core.planners import ChironSettings, PoolInput, ServiceInput
from tessera.core.profile import StepProfile
from tessera.core.profiles import PROFILES

FALLBACK_PROFILE = "h100-llama3-8b"
# Named profiles by GPU family and model size in billions of parameters.
PROFILE_BY_GPU_AND_SIZE: dict[str, dict[float, str]] = {
    "a100": {8: "a100-llama3-8b", 13: "a100-vicuna-13b", 70: "a100-llama-70b-tp4"},
    "h100": {8: "h100-llama3-8b", 13: "h100-vicuna-13b", 70: "h100-llama-70b-tp4"},
}
# A model matches a profile's size within this relative distance (7B and 8B both match 8B).
SIZE_TOLERANCE = 0.25
_BYTES_PER_PARAMETER = {"auto": 2, "float16": 2, "bfloat16": 2, "float32": 4}
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")


def gpu_family(gpu_type: str) -> str | None:
    """The profile family of a GPU type ("H100", "h100-80gb", "NVIDIA-A100-SXM4" ...), None if unknown."""
    lowered = gpu_type.lower()
    return next((family for family in PROFILE_BY_GPU_AND_SIZE if family in lowered), None)


def model_billions(service: LLMService) -> float | None:
    """The model's size in billions of parameters: from ``weightsSize`` and the dtype, else from a
    size in its name ("Llama-3.1-8B-Instruct"); None when neither says."""
    model = service.spec.model
    if model.weights_size:
        return parse_quantity(model.weights_size) / _BYTES_PER_PARAMETER[model.dtype] / 1e9
    found = _SIZE_IN_NAME.search(model.name)
    return float(found.group(1)) if found else None


def named_profile(pool: ServingPool, service: LLMService) -> StepProfile | None:
    """The simulator profile for this GPU type and model size, None when none matches."""
    family = gpu_family(pool.spec.gpu.type)
    billions = model_billions(service)
    if family is None or billions is None:
        return None
    size, name = min(PROFILE_BY_GPU_AND_SIZE[family].items(), key=lambda item: abs(item[0] - billions))
    return PROFILES[name] if abs(billions - size) <= SIZE_TOLERANCE * size else None


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


def service_profile(pool: ServingPool, service: LLMService) -> StepProfile:
    """The step-time profile the planners use for ``service`` on ``pool``'s GPUs (matched, else the
    fallback)."""
    return named_profile(pool, service) or PROFILES[FALLBACK_PROFILE]


def service_input(pool: ServingPool, service: LLMService) -> ServiceInput:
    """The planners' view of an LLMService placed on ``pool``."""
    model = service.spec.model
    profile = service_profile(pool, service)
    weights = parse_quantity(model.weights_size) if model.weights_size else profile.weights_bytes
    return ServiceInput(
        name=service.name,
        weights_bytes=int(weights),
        kv_bytes_per_token=profile.kv_bytes_per_token,
        profile=profile,
        tp_min=model.tensor_parallel_size,
        min_replicas=service.spec.replicas.min,
        max_replicas=service.spec.replicas.max,
        p99_context_tokens=model.max_model_length or 4096,
    )


def service_inputs(pool: ServingPool, services: Iterable[LLMService]) -> list[ServiceInput]:
    """Planner inputs of several services, sorted by name (plans must not depend on listing order)."""
    return [service_input(pool, s) for s in sorted(services, key=lambda s: s.name)]


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
