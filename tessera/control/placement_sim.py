"""A placement plan served on the simulator (``tessera.sim``): SeaLLM's SimulatePerformance.

Every instance of a plan is a ``tessera.sim`` engine instance on ``tp`` GPUs holding the group's
services (SeaLLM §3, §4.4; docs/papers.md, "SeaLLM"), each service's step profile at the group's TP
(``StepProfile.at_tp``). A group of several services is played as its pods run it (``Sharing``; the
mode ``tessera.core.sharing.sharing_mode`` gives for the pool, as the operator's
``children.swaps_models`` asks it):

- ``co-resident`` (engines that cannot sleep: the sim engine, vLLM on a CPU): one engine per model, each
  with its own KV share as the operator's ``children.memory_plan`` splits the GPUs' memory
  (``separate_kv_bytes``), side by side at the co-resident cost (``tessera.sim.coresident``);
- ``swapping`` (vLLM on GPUs): the same KV shares, one model awake at a time, a swap paying the weights'
  load (``StepProfile.model_load_time``) and dropping the KV of the requests it interrupts;
- ``temporal``: SeaLLM's own model, which no pod runs (kept for the before/after comparison of
  ``tessera bench seallm --set sharing=temporal``): one KV pool per group, ``γ·M − Σ W/p − A`` bytes
  per GPU (``kv_capacity_bytes``), shared by the models (the engine's ``shared_kv``: every model
  resident, switching keeps every request's KV); a block holds the same bytes for every model, so each
  model's block is ``BLOCK_TOKENS`` tokens of the group's largest KV per token in its own tokens
  (rounded to whole tokens); every iteration time x ``1 + SHARING_OVERHEAD``;
- the policy is a core policy: a group's pods run its first service's (``ServiceInput.policy``; SeaLLM's
  ``DoublingBudget`` with the placement's statistics where that is seallm or unset), unless the caller
  names one (the benches' ``FCFS``, ``RoundRobinSharing``);
- a base's LoRA adapters (``ServiceInput.lora``) are models of its instances' engine, as the pods run
  them (``tessera.sim.engine``): their requests (``HistoryRequest.adapter``) take the engine's
  ``max_loras`` slots (``engine_batch``) and a first use loads the adapter (``lora_engine``), except on a
  co-resident group of several models, where they replay as the base's own (``simulated_adapters``);
- the dispatcher is the core ``least-loaded`` route (fewest outstanding requests, SeaLLM §3) over the
  instances whose KV pool can hold the request; a request none can hold is rejected (never served).

Outcomes follow SeaLLM's unserved index (§4.1): ``L_r`` is the latency, or ``end − a_r + exec_ref(r)`` for a
request not finished by ``end`` (censored); the SLO is met when ``L_r ≤ slo_scale·exec_ref(r)`` (isolated
execution time at the service's tp_min); ``L_N = L_r / L̂_s``. Pure: a virtual clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tessera.core.lora import LoraCost
from tessera.core.planners.types import HistoryRequest, PlacementPlan, PoolInput, ServiceInput
from tessera.core.policies.seallm import DoublingBudget, ServiceStats
from tessera.core.policy import Policy
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.sharing import CoResidentCost, sharing_mode
from tessera.core.slo import slo_met
from tessera.sim.cluster import (
    Cluster,
    ClusterConfig,
    ClusterController,
    ClusterView,
    RouteRouter,
    Unservable,
)
from tessera.sim.engine import EngineConfig, SimInstance, blocks_for

SHARING_OVERHEAD = 0.04  # temporal sharing's ε_share: iteration time x (1 + ε) (CHOICE)
BLOCK_TOKENS = 16  # KV block of the group's largest model per token (temporal), of a KV share (pods)
Sharing = Literal["co-resident", "swapping", "temporal"]
# DB's admission test keeps 1 % of the KV pool free when admitting prefills (CHOICE): the engine's watermark
ENGINE = EngineConfig(max_batch=256, token_budget=8192, watermark=0.01, shared_kv=True)
# Co-resident engines on a GPU time-slice it: their steps serialise (CoResidentCost's default, CHOICE)
ENGINES: dict[Sharing, EngineConfig] = {
    "temporal": ENGINE,
    "swapping": EngineConfig(max_batch=256, token_budget=8192, watermark=0.01),
    "co-resident": EngineConfig(
        max_batch=256, token_budget=8192, watermark=0.01, co_resident=True, coresident_cost=CoResidentCost()
    ),
}


def pool_sharing(pool: PoolInput) -> Sharing:
    """How the pool's pods run a group of several models (``sharing_mode``: swapping where the engines
    can sleep, else co-resident); ``temporal`` only where the pool asks for SeaLLM's own model."""
    if pool.temporal_sharing:
        return "temporal"
    return "swapping" if sharing_mode(2, engines_sleep=pool.engines_sleep) == "swapping" else "co-resident"


def sharing_factor(pool: PoolInput, models: int) -> float:
    """What sharing a group of ``models`` models costs its busy time, for the analytic estimate: temporal
    sharing's ``1 + SHARING_OVERHEAD``; co-resident engines' ``CoResidentCost`` factor; 1 when swapping
    (one model runs at a time; the swaps themselves are not charged there: the simulated estimate that
    scores the plans plays them)."""
    if models < 2:
        return 1.0
    mode = pool_sharing(pool)
    if mode == "temporal":
        return 1 + SHARING_OVERHEAD
    if mode == "co-resident":
        return ENGINES["co-resident"].coresident_cost.factor(models)
    return 1.0


def kv_share_bytes(pool: PoolInput, services: Sequence[ServiceInput], tp: int) -> float:
    """Per-GPU KV bytes one of a group's models has (0 when none): its equal part of the unified pool
    (temporal), else its own engine's share (``separate_kv_bytes``)."""
    if len(services) < 2 or pool_sharing(pool) == "temporal":
        return max(0.0, kv_capacity_bytes(pool, services, tp)) / len(services)
    try:
        return separate_kv_bytes(pool, services, tp)
    except ValueError:
        return 0.0


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """Stall of a newly started group (CHOICE): weights per GPU over host-to-device bandwidth,
    plus engine initialisation. Pulls from storage are overlapped with serving (not charged)."""

    h2d_bytes_per_s: float = 20e9
    init_s: float = 5.0

    def __post_init__(self) -> None:
        if self.h2d_bytes_per_s <= 0 or self.init_s < 0:
            raise ValueError("switch cost needs h2d_bytes_per_s > 0 and init_s >= 0")

    def stall_s(self, services: Sequence[ServiceInput], tp: int) -> float:
        """Seconds a new group of ``services`` on ``tp`` GPUs is unavailable."""
        return sum(s.weights_bytes for s in services) / tp / self.h2d_bytes_per_s + self.init_s


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's result: its service, latency (censored if unfinished), SLO met, TTFT."""

    service: str
    arrival: float
    latency: float
    norm_latency: float
    slo_met: bool
    ttft: float | None
    finished: bool
    instance: str | None = None  # the instance that served it last (None: never routed)


def kv_capacity_bytes(pool: PoolInput, services: Sequence[ServiceInput], tp: int) -> float:
    """Per-GPU bytes of the unified KV pool: γ·M − Σ W/p − max A (SeaLLM §4.4)."""
    return (
        pool.memory_fraction * pool.gpu_memory_bytes
        - sum(s.weights_bytes for s in services) / tp
        - pool.activation_bytes_per_gpu
    )


def separate_kv_bytes(pool: PoolInput, services: Sequence[ServiceInput], tp: int) -> float:
    """Per-GPU KV bytes of each model of a group whose models run separate engines (the operator's
    ``children.memory_plan``): the budget ``γ·M`` less every model's weights and an activation reserve
    each, split equally. ValueError when nothing is left."""
    budget = pool.memory_fraction * pool.gpu_memory_bytes
    weights = sum(s.weights_bytes for s in services) / tp
    each = (budget - weights - len(services) * pool.activation_bytes_per_gpu) / len(services)
    if each <= 0:
        raise ValueError(f"services {sorted(s.name for s in services)} leave no KV memory on a TP{tp} group")
    return each


def kv_tokens(s: ServiceInput, kv_bytes_per_gpu: float, tp: int) -> int:
    """Tokens of ``s``'s KV cache in ``kv_bytes_per_gpu`` on each of ``tp`` GPUs, whole blocks."""
    tokens = int(kv_bytes_per_gpu // (s.kv_bytes_per_token / tp))
    return tokens - tokens % BLOCK_TOKENS


def group_profiles(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    tp: int,
    *,
    stall_s: float = 0.0,
    sharing: Sharing | None = None,
) -> dict[str, StepProfile]:
    """Each service's step profile on a group of ``tp`` GPUs shared with the others (see the module
    docstring; ``sharing``: how several services share it, default ``pool_sharing``); ``stall_s`` is the
    group's start-up time. ValueError when no KV memory is left."""
    mode = sharing or pool_sharing(pool)
    if len(services) > 1 and mode != "temporal":
        each = separate_kv_bytes(pool, services, tp)
        return {
            s.name: replace(
                s.profile.at_tp(tp),
                name=s.name,
                kv_capacity_tokens=kv_tokens(s, each, tp),
                kv_bytes_per_token=s.kv_bytes_per_token,
                weights_bytes=s.weights_bytes,
                cold_start_s=stall_s,
            )
            for s in services
        }
    capacity = kv_capacity_bytes(pool, services, tp)
    if capacity <= 0:
        raise ValueError(f"services {sorted(s.name for s in services)} leave no KV memory on a TP{tp} group")
    per_token = {s.name: max(1.0, s.kv_bytes_per_token / tp) for s in services}
    block_bytes = BLOCK_TOKENS * max(per_token.values())
    blocks = int(capacity // block_bytes)
    slow = 1 + SHARING_OVERHEAD if len(services) > 1 else 1.0
    out = {}
    for s in services:
        p = s.profile.at_tp(tp)
        block = max(1, round(block_bytes / per_token[s.name]))
        out[s.name] = replace(
            p.slowed(slow),
            name=s.name,
            block_size=block,
            kv_capacity_tokens=blocks * block,
            kv_bytes_per_token=s.kv_bytes_per_token,
            weights_bytes=s.weights_bytes,
            cold_start_s=stall_s,
        )
    return out


def exec_ref(s: ServiceInput, prompt: int, output: int) -> float:
    """Isolated execution time of one request at the service's tp_min (its SLO and censoring)."""
    return s.profile.at_tp(s.tp_min).exec_time(prompt, max(1, output))


def service_stats(services: Sequence[ServiceInput]) -> dict[str, ServiceStats]:
    """DB statistics from each service's history at its reference TP (L̂_s, std, θ_s = 0.5·SLO_s)."""
    return {s.name: stats_of(s, [(h.prompt_tokens, h.output_tokens) for h in s.history]) for s in services}


def stats_of(s: ServiceInput, lengths: Sequence[tuple[int, int]]) -> ServiceStats:
    """L̂_s and Var_s (std) of isolated execution time at tp_min over ``lengths`` (prompt, output);
    the service's mean lengths when empty. Starvation threshold θ_s = 0.5·SLO_s (CHOICE)."""
    if lengths:
        execs = [exec_ref(s, p, o) for p, o in lengths]
        mean = sum(execs) / len(execs)
        std = math.sqrt(sum((e - mean) ** 2 for e in execs) / len(execs))
    else:
        mean, std = s.mean_exec_s(), 0.0
    return ServiceStats(mean_exec_s=mean, std_exec_s=std, starvation_s=0.5 * s.slo_scale * mean)


def holds(inst: SimInstance, req: Request) -> bool:
    """Whether ``inst``'s KV pool, emptied of everything else, holds ``req`` to its last token (the
    engine's own admission test)."""
    prof = inst.profiles[req.model]
    cap = prof.kv_capacity_tokens // prof.block_size
    need = blocks_for(req.prompt_tokens + req.target_output_tokens, prof.block_size)
    return need <= cap - int(inst.config.watermark * cap)


class Dispatcher(RouteRouter):
    """SeaLLM's dispatcher (SeaLLM §3): the core ``least-loaded`` route over the instances whose KV pool
    can hold the request; a request none can hold is unservable (the cluster rejects it)."""

    def __init__(self) -> None:
        super().__init__("least-loaded")

    def route(self, req: Request, view: ClusterView) -> SimInstance:
        """The instance with the fewest outstanding requests among those that can hold ``req``."""
        able = [i for i in view.serving(req.model) if holds(i, req)]
        if not able:
            raise Unservable(f"request {req.id}: no instance of {req.model!r} holds its KV")
        return super().route(req, replace(view, instances=able))


def to_requests(
    requests: Iterable[tuple[str, HistoryRequest]],
    services: Sequence[ServiceInput] = (),
    adapters: Mapping[str, str] | None = None,
) -> list[Request]:
    """Simulator requests (model = service name, or the adapter a request named where ``adapters``, the
    adapters run as adapters (``simulated_adapters``), holds it), in arrival order; each in its
    service's ``slo_class`` where ``services`` gives one (else the default class, which sets no SLO)."""
    classes = {s.name: s.slo_class for s in services if s.slo_class is not None}
    adapters = adapters or {}
    ordered = sorted(requests, key=lambda x: x[1].arrival)
    return [
        Request(
            f"r{i}", h.arrival, h.prompt_tokens, max(1, h.output_tokens),
            model=h.adapter if h.adapter in adapters else name,
            true_output_tokens=max(1, h.output_tokens), service_class=classes.get(name, ServiceClass()),
        )
        for i, (name, h) in enumerate(ordered)
    ]  # fmt: skip


def adapter_bases(services: Sequence[ServiceInput]) -> dict[str, str]:
    """Each LoRA adapter of ``services`` -> the service (its base) whose requests it serves."""
    return {a: s.name for s in services if s.lora is not None for a in s.lora.names}


def simulated_adapters(
    services: Sequence[ServiceInput], plan: PlacementPlan, sharing: Sharing
) -> dict[str, str]:
    """The adapters a replay of ``plan`` runs as adapters, in their base's engine slots (adapter -> its
    base): every base's, except those of a base that a co-resident group shares with another model (the
    simulator does not model adapters there: their requests are replayed as the base's own, so the slot
    limit is not charged on such a group)."""
    shared = (
        {n for g in plan.groups if len(g.services) > 1 for n in g.services}
        if sharing == "co-resident"
        else set()
    )
    return {a: b for a, b in adapter_bases(services).items() if b not in shared}


def lora_engine(
    engine: EngineConfig, services: Sequence[ServiceInput], adapters: Mapping[str, str]
) -> EngineConfig:
    """``engine`` for an instance of ``services`` whose bases run their ``adapters`` (adapter -> base):
    the bases' adapter slots (``LoraAdapters``; one instance has one slot count, the largest of its
    bases': a pool's ``maxLoras`` gives every base the same, and unset gives each one slot per adapter,
    never binding), an adapter cache holding all their held adapters, and the cost of a load. No step
    overhead: the services' profiles already pay it on every step (``charged_profile``)."""
    loras = [s.lora for s in services if s.lora is not None and s.name in adapters.values()]
    if not loras:
        return engine
    return replace(
        engine,
        max_loras=max(x.max_loras for x in loras),
        max_cpu_loras=sum(x.max_cpu_loras for x in loras),
        lora_cost=LoraCost(load_s=max(x.load_s for x in loras), step_overhead=0.0),
    )


def pod_policy(services: Sequence[ServiceInput], stats: dict[str, ServiceStats]) -> Callable[[], Policy]:
    """The policy a group's pods run: its first service's (``children.worker_config``), with its default
    settings (CHOICE: the placement does not see ``scheduling.settings``); SeaLLM's DB with ``stats`` (the
    placement's service monitor) where that is seallm or unset."""
    name = services[0].policy
    if name is None or name == "seallm":
        return lambda: DoublingBudget(dict(stats))
    return lambda: make_policy(name)


def new_cluster(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    policy: Callable[[], Policy],
    controller: ClusterController | None = None,
    engine: EngineConfig | None = None,
    *,
    sharing: Sharing | None = None,
    adapters: Mapping[str, str] | None = None,
) -> Cluster:
    """An empty cluster for ``services`` (instances come from ``add_group``); ``engine`` defaults to the
    one of ``sharing`` (default: ``pool_sharing``); ``adapters`` (adapter -> its base, one of
    ``services``) run on their base's instances."""
    profiles = {s.name: s.profile.at_tp(s.tp_min) for s in services}
    engine = engine or ENGINES[sharing or pool_sharing(pool)]
    config = ClusterConfig(profiles=profiles, instances=0, engine=engine, adapters=dict(adapters or {}))
    return Cluster(config, policy, router=Dispatcher(), controller=controller)


def add_group(
    cluster: Cluster,
    pool: PoolInput,
    services: Sequence[ServiceInput],
    tp: int,
    *,
    switch: SwitchCost | None = None,
    sharing: Sharing | None = None,
    policy: Callable[[], Policy] | None = None,
) -> SimInstance:
    """Start one instance of a group of ``services`` on ``tp`` GPUs now (after ``switch``'s stall), its
    models sharing it as ``sharing`` says (``group_profiles``), under ``policy`` (default: the
    cluster's), its bases' adapters (the cluster's) in their slots (``lora_engine``)."""
    stall = switch.stall_s(services, tp) if switch is not None else 0.0
    profiles = group_profiles(pool, services, tp, stall_s=stall, sharing=sharing)
    engine = lora_engine(cluster.config.engine, services, cluster.config.adapters)
    return cluster.add_instance(
        models=list(profiles), profiles=profiles, cold=switch is not None, policy=policy, engine=engine
    )


def outcomes(
    services: Sequence[ServiceInput],
    stats: dict[str, ServiceStats],
    requests: Iterable[Request],
    end: float,
) -> list[RequestOutcome]:
    """The requests' outcomes as seen at ``end``: a request not finished by then (or never served) is
    censored at ``end``: ``end − a + exec_ref``. A finished request meets its SLO as the workers judge
    it (``tessera.core.slo.slo_met``) when its class sets one, else when its latency is within
    ``slo_scale`` x ``exec_ref`` (SeaLLM's bound). An adapter's request is its base service's."""
    by_name = {s.name: s for s in services}
    base_of = adapter_bases(services)
    out = []
    for r in requests:
        s = by_name[base_of.get(r.model, r.model)]
        ref = exec_ref(s, r.prompt_tokens, r.target_output_tokens)
        done = r.finished_at is not None and r.finished_at <= end
        lat = r.finished_at - r.arrival if done else max(end, r.arrival) - r.arrival + ref
        first = r.first_token_at
        judged = slo_met(r) if done else None
        met = done and (judged if judged is not None else lat <= s.slo_scale * ref)
        out.append(
            RequestOutcome(
                service=s.name,
                arrival=r.arrival,
                latency=lat,
                norm_latency=lat / stats[s.name].mean_exec_s,
                slo_met=met,
                ttft=first - r.arrival if done and first is not None else None,
                finished=done,
                instance=r.instance,
            )
        )
    return out


def serve(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    plan: PlacementPlan,
    requests: Sequence[tuple[str, HistoryRequest]],
    *,
    stats: dict[str, ServiceStats],
    policy: Callable[[], Policy] | None = None,
    horizon: float = math.inf,
    engine: EngineConfig | None = None,
    sharing: Sharing | None = None,
) -> tuple[list[RequestOutcome], Cluster]:
    """Serve ``requests`` (service name, request) on a fixed ``plan`` until every one has finished or the
    clock passes ``horizon`` (default: none): outcomes are censored there, so nothing later can change
    them, and an overloaded plan's backlog is not played out for nothing. ``policy`` makes every
    instance's policy (default: each group's pods' own, ``pod_policy``); ``sharing`` says how a group's
    models share it (default: as the pool's pods do, ``pool_sharing``); ``engine`` replaces the
    instances' engine settings. A base's LoRA adapters run in its engine's slots, as the pods run them
    (``simulated_adapters``; DB gives an adapter its base's statistics)."""
    by_name = {s.name: s for s in services}
    unplaced = sorted({n for n, _ in requests} - {n for g in plan.groups for n in g.services})
    if unplaced:
        raise ValueError(f"plan hosts no instance of services {unplaced} that have requests")
    adapters = simulated_adapters(services, plan, sharing or pool_sharing(pool))
    with_adapters = {**stats, **{a: stats[b] for a, b in adapters.items()}}
    factory = policy or (lambda: DoublingBudget(dict(with_adapters)))
    cluster = new_cluster(pool, services, factory, engine=engine, sharing=sharing, adapters=adapters)
    for g in plan.groups:
        members = [by_name[n] for n in g.services]
        own = policy or pod_policy(members, with_adapters)
        for _ in range(g.replicas.total):
            add_group(cluster, pool, members, g.tp, sharing=sharing, policy=own)
    reqs = to_requests(requests, services, adapters)
    if reqs:
        cluster.run(reqs, until=horizon)
    end = horizon if math.isfinite(horizon) else max((r.finished_at or 0.0 for r in reqs), default=0.0)
    return outcomes(services, stats, reqs, end), cluster
