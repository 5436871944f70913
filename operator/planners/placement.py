"""Placement of LLM services onto GPU groups.

- ``dedicated``: one group per service, the pool's GPUs split evenly (SeaLLM's vLLM baseline, §9.5).
- ``seallm``: SeaLLM §4.1 / Alg. 1 — GPU-group partition (stage 1) and the greedy unserved-index
  allocation (stage 2), scored by an estimator of the group's serving under DB scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.operator.planners.naming import group_name
from tessera.operator.planners.types import GroupPlan, PlacementPlan, PoolInput, RoleCounts, ServiceInput


class PlacementError(ValueError):
    """No placement exists for the given pool and services (the message says what is short)."""


def validate_services(pool: PoolInput, services: Sequence[ServiceInput]) -> None:
    """Reject duplicate names and services that fit no instance of the pool."""
    names = [s.name for s in services]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PlacementError(f"service names must be unique; duplicated: {dupes}")
    for s in services:
        if s.tp_min > pool.gpus_per_node:
            raise PlacementError(
                f"service {s.name!r} needs {s.tp_min} GPUs per instance but nodes of pool {pool.name!r} "
                f"have {pool.gpus_per_node}; TP never crosses nodes"
            )
        if not fits(pool, [s], max(s.tp_min, pool.min_gpus_per_instance)):
            raise PlacementError(
                f"service {s.name!r} does not fit its tp_min={s.tp_min} instance of pool {pool.name!r}: "
                f"raise its tensorParallelSize or use GPUs with more memory"
            )


def fits(pool: PoolInput, services: Sequence[ServiceInput], tp: int) -> bool:
    """SeaLLM CanAllocate's memory test, per GPU: Σ W/p + max A + KV_min ≤ γ·M_gpu.

    Activations count once (temporal sharing runs one model per iteration); KV_min holds one request of
    P99 length of every co-located service."""
    weights = sum(s.weights_bytes for s in services) / tp
    kv_min = sum(s.kv_bytes_per_token * s.p99_context_tokens for s in services) / tp
    return weights + pool.activation_bytes_per_gpu + kv_min <= pool.memory_fraction * pool.gpu_memory_bytes


def plan_dedicated(pool: PoolInput, services: Sequence[ServiceInput]) -> PlacementPlan:
    """One group per service; the GPU budget is split evenly into replicas of the service's TP size.

    Every service gets at least ``max(min_replicas, 1)`` replicas; GPUs left after the even split go
    one replica at a time to the services with the highest load per replica."""
    validate_services(pool, services)
    if not services:
        return PlacementPlan(strategy="dedicated", groups=())
    tps = {s.name: max(s.tp_min, pool.min_gpus_per_instance) for s in services}
    need = sum(tps[s.name] * max(1, s.min_replicas) for s in services)
    if need > pool.max_gpus:
        raise PlacementError(
            f"pool {pool.name!r} has {pool.max_gpus} GPUs but its services need at least {need} "
            f"(one instance each at tp_min); raise instances.max or remove services"
        )
    share = pool.max_gpus // len(services)
    replicas = {s.name: max(max(1, s.min_replicas), share // tps[s.name]) for s in services}
    left = pool.max_gpus - sum(tps[n] * r for n, r in replicas.items())
    while True:
        candidates = [s for s in services if tps[s.name] <= left]
        if not candidates:
            break
        best = max(candidates, key=lambda s: (s.request_rate * s.mean_exec_s() / replicas[s.name], s.name))
        if best.request_rate <= 0:
            break
        replicas[best.name] += 1
        left -= tps[best.name]
    groups = tuple(
        GroupPlan(
            name=group_name((s.name,), tps[s.name]),
            services=(s.name,),
            tp=tps[s.name],
            replicas=RoleCounts(interactive=replicas[s.name]),
        )
        for s in services
    )
    return PlacementPlan(strategy="dedicated", groups=groups)
