"""LoRA adapter LLMServices: which are valid beside their base, and the base's vLLM flags for them.

An adapter is an LLMService whose ``spec.model.adapter`` names another LLMService of the same pool and
namespace, its base. The placement places bases only; an adapter is served wherever its base runs, by
the base's vLLM servers (``--enable-lora``), as one more model of the base's pods. Pure: specs in,
decisions out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized

from tessera.api import LLMService, ServingPool

# Reasons of an adapter that cannot be served (its base keeps serving).
ADAPTER_BASE_NOT_FOUND = "AdapterBaseNotFound"
INVALID_ADAPTER = "InvalidAdapter"
# The container environment that lets the worker load and unload adapters at run time
# (/v1/load_lora_adapter, /v1/unload_lora_adapter).
RUNTIME_LORA_ENV = {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}


def is_adapter(service: LLMService) -> bool:
    """Whether ``service`` serves a LoRA adapter of another service's model."""
    return service.spec.model.adapter is not None


def adapter_problems(
    pool: ServingPool, services: Mapping[str, LLMService], rejected: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """Each adapter of ``services`` that cannot be served: (reason, message), by service name.

    ``services`` are the pool's valid services by name, ``rejected`` the messages of the pool's others
    (a base there is named with its own fault). An adapter is refused when its base is not a valid
    service of the pool or is itself an adapter, when its source names an adapter of ``tessera models
    pull`` (local mode puts the folder it built in its place first), or when its rank is above the
    pool's ``maxLoraRank``.
    """
    problems: dict[str, tuple[str, str]] = {}
    for name, service in services.items():
        adapter = service.spec.model.adapter
        if adapter is None:
            continue
        base = services.get(adapter.base)
        if adapter.base == name:
            problems[name] = (INVALID_ADAPTER, "spec.model.adapter.base names this service itself")
        elif base is None and adapter.base in rejected:
            problems[name] = (
                ADAPTER_BASE_NOT_FOUND,
                f"its base LLMService {adapter.base!r} is not served: {rejected[adapter.base]}",
            )
        elif base is None:
            problems[name] = (
                ADAPTER_BASE_NOT_FOUND,
                f"base LLMService {adapter.base!r} not found in ServingPool {pool.name!r} of this "
                "namespace; the base must be an LLMService of the adapter's pool and namespace",
            )
        elif is_adapter(base):
            problems[name] = (
                INVALID_ADAPTER,
                f"base LLMService {adapter.base!r} is itself an adapter (of "
                f"{base.spec.model.adapter.base!r}); an adapter's base must be a full model: name that one",
            )
        elif adapter.pulled:
            problems[name] = (
                INVALID_ADAPTER,
                f"spec.model.adapter.source {adapter.source!r} names an adapter that `tessera models pull` "
                "builds, which only local mode (`tessera local up`) serves from its cache; on a cluster give "
                "the adapter's directory in the engine container or a Hugging Face id (org/name)",
            )
        elif adapter.rank > pool.spec.max_lora_rank:
            problems[name] = (
                INVALID_ADAPTER,
                f"spec.model.adapter.rank {adapter.rank} is above ServingPool {pool.name!r}'s "
                f"maxLoraRank {pool.spec.max_lora_rank}; raise the pool's maxLoraRank or serve an adapter "
                "of a lower rank",
            )
    return problems


def adapters_of(base: str, services: Mapping[str, LLMService]) -> list[LLMService]:
    """The adapter services of the service named ``base``, sorted by name."""
    return sorted(
        (
            s
            for s in services.values()
            if s.spec.model.adapter is not None and s.spec.model.adapter.base == base
        ),
        key=lambda s: s.name,
    )


def lora_args(pool: ServingPool, adapters: list[LLMService]) -> list[str]:
    """The vLLM flags of a base model serving ``adapters`` (none without adapters).

    ``--max-loras`` (adapters one batch mixes, each a slot in GPU memory) is the pool's ``maxLoras``,
    else one slot per adapter; ``--max-cpu-loras`` holds every adapter of the base in CPU memory, so that
    an adapter leaving its GPU slot is not read from disk again (vLLM needs it at least ``--max-loras``).
    """
    if not adapters:
        return []
    slots, held = lora_slots(pool, adapters)
    return [
        "--enable-lora",
        "--max-loras",
        str(slots),
        "--max-lora-rank",
        str(pool.spec.max_lora_rank),
        "--max-cpu-loras",
        str(held),
    ]


def lora_slots(pool: ServingPool, adapters: Sized) -> tuple[int, int]:
    """(``--max-loras``, ``--max-cpu-loras``) of a base serving ``adapters`` (``lora_args``): what its
    vLLM server starts with, what the pod's scheduler bounds its batches and loads by, and what the
    placement's simulated estimator gives its engine."""
    slots = pool.spec.max_loras or len(adapters)
    return slots, max(slots, len(adapters))
