"""Local mode's control plane: the operator's decisions for one machine, without a cluster.

Pure: resources in, the worker instances to start out. It runs exactly what the operator runs for a
reconcile (``tessera.control.pool_plan.desired_pool``: spec validation, the placement planner, the
children builders) and reads each group's worker configuration and role counts from the ConfigMap the
operator would apply. Only the engine differs: every model entry is rewritten for the local engine
(``sim``; or ``vllm`` launching a server on a local model directory, or using a running server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tessera.api import LLMService, RequestClass, ServingPool
from tessera.api.worker_config import WorkerConfig
from tessera.control.adapters import RUNTIME_LORA_ENV, adapters_of, lora_args
from tessera.control.pool_plan import PoolDesired, Problem, desired_pool
from tessera.core.planners import GroupPlan, RoleCounts, assign_roles

Role = Literal["interactive", "mixed", "batch"]
# Local workers read their admin token from here (the supervisor sets it): local mode may switch the
# policy of running workers without restarting their engines.
ADMIN_TOKEN_ENV = "TESSERA_LOCAL_ADMIN_TOKEN"


class LocalPlanError(ValueError):
    """The resources cannot run locally; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """Which engine the local workers use.

    ``sim``: the simulated engine. ``vllm``: real vLLM, either launched by each worker on
    ``model_dir`` (one server per instance) or an already running server at ``vllm_url`` (then the
    LLMService's model name must be the server's served model name).
    """

    kind: Literal["sim", "vllm"] = "sim"
    model_dir: str | None = None
    vllm_url: str | None = None
    kv_cache_gib: int = 1
    max_model_len: int | None = None  # overrides every model's context length (small local models)
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"  # vLLM --dtype of a launched server
    enforce_eager: bool = False  # vLLM --enforce-eager: a launched server skips the torch.compile warm-up
    # The step-time profile of a launched model (the worker's ProfileSpec JSON) where one was measured on
    # this kind of machine; None: the operator's configuration (a GPU-scale default).
    profile: dict[str, float] | None = None
    # With vllm_url: where that server publishes its KV events (its --kv-events-config endpoint, as
    # tcp://HOST:PORT), for a route that reads what the engine holds. A launched server's publisher is
    # set up by the supervisor instead (a free port per server).
    vllm_kv_events: str | None = None
    # With vllm_url: the served model's tokenizer folder. The workers tokenize with it instead of asking
    # the server, and the router can tokenize text completion prompts as they do (a launched model's
    # folder serves both already).
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        for value, flag in ((self.vllm_kv_events, "--vllm-kv-events"), (self.tokenizer, "--tokenizer")):
            if value is not None and self.vllm_url is None:
                raise LocalPlanError(f"{flag} is about the server at --vllm-url; give both")
        if self.kind == "vllm" and (self.model_dir is None) == (self.vllm_url is None):
            raise LocalPlanError("--engine vllm needs exactly one of --model DIR or --vllm-url URL (or an "
                                 "LLMService naming a model of `tessera models list`)")  # fmt: skip
        if self.kind == "sim" and (self.model_dir or self.vllm_url):
            raise LocalPlanError("--model and --vllm-url need --engine vllm")

    def rewrite(self, entry: dict[str, Any], lora: Sequence[str] = ()) -> dict[str, Any]:
        """A worker model entry (as the operator builds it) rewritten for this engine. ``lora``: the LoRA
        flags the operator gives a base model's vLLM (``lora_args``), which a launched server then runs
        with (and with runtime adapter loading on); an adapter runs in the server its base launched."""
        # The operator's profile is the pool's GPUs' step times; local workers run on this machine.
        out = {k: v for k, v in entry.items() if k not in ("url", "launch", "engine", "profile")}
        if self.max_model_len is not None:
            out["maxModelLen"] = self.max_model_len
        if self.kind == "sim":
            return {**out, "engine": "sim"}
        if self.vllm_url is not None:
            if self.tokenizer is not None:
                out["tokenizer"] = self.tokenizer
            return {**out, "engine": "vllm", "url": self.vllm_url}
        if self.profile is not None:
            out["profile"] = self.profile
        if entry.get("adapterOf") is not None:
            return {**out, "engine": "vllm"}
        launch = {"modelDir": self.model_dir, "kvCacheGib": self.kv_cache_gib, "dtype": self.dtype,
                  "enforceEager": self.enforce_eager}  # fmt: skip
        if lora:
            launch |= {"extraArgs": list(lora), "env": {RUNTIME_LORA_ENV["name"]: RUNTIME_LORA_ENV["value"]}}
        return {**out, "engine": "vllm", "launch": launch}


@dataclass(frozen=True, slots=True)
class LocalInstance:
    """One worker instance to start."""

    name: str
    pool: str
    group: str
    ordinal: int
    role: Role
    config: WorkerConfig
    kv_events: tuple[tuple[str, str], ...] = ()  # (model, endpoint): where its engines publish KV events


@dataclass(frozen=True, slots=True)
class LocalGroup:
    """One placement group as planned: what its autoscaler reads and how to start more instances."""

    pool: str
    desired: PoolDesired  # the pool's decision (classes, services, the whole plan)
    group: GroupPlan  # role counts as the operator planned them
    config: WorkerConfig  # the worker configuration, rewritten for the local engine
    instance_cap: int | None  # local mode's cap of instances per group
    kv_events: tuple[tuple[str, str], ...] = ()  # (model, endpoint) of a running server's KV events

    def instance(self, ordinal: int, role: Role) -> LocalInstance:
        """The instance of this group at ``ordinal`` (named as the StatefulSet names its pods)."""
        return LocalInstance(f"{self.pool}-{self.group.name}-{ordinal}", self.pool, self.group.name, ordinal,
                        role, self.config, self.kv_events)  # fmt: skip

    def roles(self, counts: RoleCounts, current: Sequence[Role] = ()) -> list[Role]:
        """The role of each ordinal for ``counts`` (``assign_roles`` from the roles the running ordinals
        have, ``current``), within the local cap."""
        roles = list(assign_roles(counts, current))
        return roles if self.instance_cap is None else roles[: self.instance_cap]


@dataclass(frozen=True, slots=True)
class LocalPlan:
    """What local mode starts, and what it could not serve (with reasons)."""

    instances: tuple[LocalInstance, ...]
    problems: tuple[str, ...]
    groups: tuple[LocalGroup, ...] = ()


def _body(resource: ServingPool | LLMService | RequestClass) -> dict[str, Any]:
    """The API body of a resource, with the uid the API server would set (owner references need one)."""
    body = resource.to_json()
    meta = body.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", f"local-{resource.kind}-{resource.name}")
    return body


def _lora_flags(desired: PoolDesired, group: GroupPlan) -> dict[str, list[str]]:
    """The LoRA flags of each base model of ``group`` that adapters name, by model name: the operator's
    rendering (``lora_args``), so that a launched server runs as the base's container would."""
    flags: dict[str, list[str]] = {}
    for name in group.services:
        args = lora_args(desired.pool, adapters_of(name, desired.services))
        if args:
            flags[desired.services[name].spec.model.name] = args
    return flags


def plan_local(
    resources: Sequence[ServingPool | LLMService | RequestClass],
    engine: LocalEngine,
    *,
    max_instances_per_group: int | None = None,
    now: float = 0.0,
    adapter_folders: Mapping[str, str] | None = None,
) -> LocalPlan:
    """Decide every pool as the operator would and list the worker instances to start.

    ``max_instances_per_group`` caps each group's instances for a small machine (the first ordinals
    stay, as a StatefulSet scaled down keeps them). ``adapter_folders``: the folder of each adapter
    source that names an adapter of ``tessera models pull`` (found by the caller, in the model cache),
    put in the source's place before the operator's decision. Raises LocalPlanError when nothing can run.
    """
    if max_instances_per_group is not None and max_instances_per_group < 1:
        raise LocalPlanError(f"the instance cap must be >= 1, got {max_instances_per_group}")
    bodies = [_body(r) for r in resources]
    folders = adapter_folders or {}
    for body in bodies:
        adapter = body["spec"]["model"].get("adapter") if body["kind"] == "LLMService" else None
        if adapter is not None and adapter["source"] in folders:
            adapter["source"] = folders[adapter["source"]]
    pools = [b for b in bodies if b["kind"] == "ServingPool"]
    services = [b for b in bodies if b["kind"] == "LLMService"]
    classes = [b for b in bodies if b["kind"] == "RequestClass"]
    if not pools:
        raise LocalPlanError("no ServingPool in the files; add one (see examples/quickstart.yaml)")
    instances: list[LocalInstance] = []
    problems: list[str] = []
    groups: list[LocalGroup] = []
    for pool_body in pools:
        pool_name = pool_body["metadata"]["name"]
        desired = desired_pool(pool_body, services, classes, None, now)
        if isinstance(desired, Problem):
            problems.append(f"ServingPool {pool_name}: {desired.message}")
            continue
        problems += [f"LLMService {name}: {p.message}" for name, p in sorted(desired.rejected.items())]
        if desired.placement_problem:
            problems.append(f"ServingPool {pool_name}: {desired.placement_problem}")
        for group_plan in desired.plan.groups if desired.plan is not None else ():
            config = desired.configs[group_plan.name].to_json()
            lora = _lora_flags(desired, group_plan)
            config["models"] = [engine.rewrite(m, lora.get(m["name"], ())) for m in config["models"]]
            config["admin"] = {"tokenEnv": ADMIN_TOKEN_ENV}
            # every instance's worker sends to the one running server: they share its cache and its events
            feeds = tuple((m["name"], engine.vllm_kv_events) for m in config["models"]
                          if engine.vllm_kv_events is not None)  # fmt: skip
            local = LocalGroup(pool_name, desired, group_plan, WorkerConfig.model_validate(config),
                               max_instances_per_group, feeds)  # fmt: skip
            groups.append(local)
            instances += [local.instance(i, role) for i, role in enumerate(local.roles(group_plan.replicas))]
    if not instances:
        detail = "\n  ".join(problems) or "no LLMService names a pool in the files"
        raise LocalPlanError(f"nothing to serve:\n  {detail}")
    return LocalPlan(tuple(instances), tuple(problems), tuple(groups))
