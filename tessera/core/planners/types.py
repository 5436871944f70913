"""Plain, typed inputs and outputs of the operator's planners.

The planners are pure functions: these dataclasses are all they see. They do not
depend on the Kubernetes API models (``tessera.api``); ``convert.py`` maps those
onto these. Times are seconds, memory is bytes, rates are requests per second.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tessera.core.lora import ADAPTER_LOAD_S
from tessera.core.profile import StepProfile
from tessera.core.request import ServiceClass

Strategy = Literal["seallm", "dedicated"]
Role = Literal["interactive", "mixed", "batch"]
ROLES: tuple[Role, ...] = ("interactive", "mixed", "batch")


@dataclass(frozen=True, slots=True)
class PoolInput:
    """A GPU pool as the planners see it (from a ServingPool)."""

    name: str
    gpu_type: str
    gpu_memory_bytes: int
    max_gpus: int  # the pool's GPU budget (instances.max x gpus per instance)
    gpus_per_node: int = 8  # TP never crosses a node (SeaLLM §4.1)
    max_services_per_group: int = 2  # SeaLLM K_max
    min_gpus_per_instance: int = 1  # the pool's gpu.perInstance: smallest group size
    memory_fraction: float = 0.9  # SeaLLM γ: usable share of GPU memory
    activation_bytes_per_gpu: int = 4 * 2**30  # activation reserve: max, not sum, over co-located models
    # Whether the pool's engines can sleep (vLLM on GPUs): its groups of several models then swap them,
    # else their engines are co-resident (tessera.core.sharing.sharing_mode decides from this)
    engines_sleep: bool = True
    # SeaLLM's own model of a shared group instead (one KV pool, DB temporal sharing), which no pod runs:
    # only to compare with it (tessera bench seallm --set sharing=temporal)
    temporal_sharing: bool = False

    def __post_init__(self) -> None:
        if self.max_gpus < 1:
            raise ValueError(f"pool {self.name!r}: max_gpus must be >= 1, got {self.max_gpus}")
        if self.gpus_per_node < 1 or self.gpus_per_node & (self.gpus_per_node - 1):
            raise ValueError(
                f"pool {self.name!r}: gpus_per_node must be a power of two, got {self.gpus_per_node}"
            )
        if self.max_services_per_group < 1:
            raise ValueError(f"pool {self.name!r}: max_services_per_group must be >= 1")
        if self.min_gpus_per_instance < 1 or self.min_gpus_per_instance & (self.min_gpus_per_instance - 1):
            raise ValueError(
                f"pool {self.name!r}: GPUs per instance must be a power of two, "
                f"got {self.min_gpus_per_instance}"
            )
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"pool {self.name!r}: memory_fraction must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class HistoryRequest:
    """One request of a service's recent history (placement replays these). ``adapter``: the LoRA
    adapter the request named, of the service's base model (``ServiceInput.lora``); None: the service's
    own model."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    adapter: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(
                f"a history request has prompt and output tokens >= 0, not {self.prompt_tokens} and "
                f"{self.output_tokens}"
            )
        if self.adapter is not None and not self.adapter:
            raise ValueError("a history request's adapter is a name or None, not an empty string")


@dataclass(frozen=True, slots=True)
class LoraAdapters:
    """A base model's LoRA adapters as the placement estimators see them: their ``names`` (as its
    history's requests name them; idle ones too, since they size the engine), the adapters one batch
    mixes (``max_loras``, vLLM's --max-loras) and its engine holds (``max_cpu_loras``), as the operator
    renders them, and ``load_s``, what loading one the engine does not hold costs. The LoRA step
    overhead is not here: it is in the service's profile (``tessera.core.lora.charged_profile``)."""

    names: tuple[str, ...]
    max_loras: int
    max_cpu_loras: int
    load_s: float = ADAPTER_LOAD_S

    def __post_init__(self) -> None:
        if not self.names or any(not n for n in self.names) or len(set(self.names)) != len(self.names):
            raise ValueError(f"LoRA adapters need distinct, non-empty names, not {list(self.names)}")
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"LoRA adapters need max_loras >= 1 and max_cpu_loras >= max_loras, not {self.max_loras} "
                f"and {self.max_cpu_loras}"
            )
        if not 0 <= self.load_s <= 60:
            raise ValueError(f"an adapter load takes 0 to 60 seconds, not {self.load_s}")


@dataclass(frozen=True, slots=True)
class ServiceInput:
    """One LLM service (an LLMService) as the placement planner sees it."""

    name: str
    weights_bytes: int
    kv_bytes_per_token: int
    profile: StepProfile  # iteration times at the profile's own TP; at_tp scales them
    tp_min: int = 1  # smallest power-of-two TP the model fits (SeaLLM tp_min)
    request_rate: float = 0.0  # historical λ_s
    mean_prompt_tokens: float = 128.0
    mean_output_tokens: float = 256.0
    p99_context_tokens: int = 4096  # for KV_min: one request of P99 length
    slo_scale: float = 5.0  # SLO_r = slo_scale x exec_ref(r) (SeaLLM §6.1)
    history: tuple[HistoryRequest, ...] = ()
    min_replicas: int = 1
    max_replicas: int | None = None  # most instances hosting the service (LLMService replicas.max)
    # The class the estimators judge the service's requests by, as the workers judge them
    # (``tessera.core.slo.slo_met``: TTFT and ITL bounds, or a batch deadline); None, or a class with no
    # SLO: SeaLLM's latency bound ``slo_scale`` x isolated execution time.
    slo_class: ServiceClass | None = None
    # Requests outstanding (queued or running) when the plan is made: the simulated estimator serves them
    # first, with the mean lengths, before replaying the history.
    backlog: int = 0
    # The scheduling policy the service's pods run (its resolved ``scheduling.policy``; a group's pod runs
    # its first service's); None: SeaLLM's DB, the paper's
    policy: str | None = None
    # A base model's LoRA adapters, whose requests its history holds (they run on its engine); None: none
    lora: LoraAdapters | None = None

    def __post_init__(self) -> None:
        if self.tp_min < 1 or self.tp_min & (self.tp_min - 1):
            raise ValueError(f"service {self.name!r}: tp_min must be a power of two, got {self.tp_min}")
        if self.weights_bytes < 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"service {self.name!r}: weights and KV sizes must be >= 0")
        if self.backlog < 0:
            raise ValueError(f"service {self.name!r}: backlog must be >= 0")
        if self.request_rate < 0:
            raise ValueError(f"service {self.name!r}: request_rate must be >= 0")
        if self.slo_scale <= 0:
            raise ValueError(f"service {self.name!r}: slo_scale must be > 0")
        if self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"service {self.name!r}: max_replicas {self.max_replicas} is below min_replicas "
                f"{self.min_replicas} (and at least 1)"
            )
        adapters = frozenset(self.lora.names) if self.lora is not None else frozenset()
        if self.name in adapters:
            raise ValueError(f"service {self.name!r}: an adapter of its own cannot take its name")
        unknown = sorted({h.adapter for h in self.history if h.adapter is not None} - adapters)
        if unknown:
            raise ValueError(
                f"service {self.name!r}: its history names adapters {unknown} it has not "
                f"(its adapters: {sorted(adapters) or 'none'})"
            )

    def replica_cap(self) -> float:
        """Most instances that may host the service (inf when unbounded)."""
        return float("inf") if self.max_replicas is None else self.max_replicas

    def wait_slack_s(self, tp: int) -> float:
        """How long a mean request may queue at ``tp`` and still meet its SLO: its class's TTFT bound less
        its prefill (an interactive class with one; ITL is not a queueing matter), its batch deadline
        less its execution time, else the latency bound ``slo_scale`` x reference execution time less its
        execution time here. Never negative."""
        profile = self.profile.at_tp(tp)
        prompt, output = round(self.mean_prompt_tokens), max(1, round(self.mean_output_tokens))
        own = profile.exec_time(prompt, output)
        c = self.slo_class
        if c is not None and c.kind == "interactive" and c.ttft_slo_s is not None:
            return max(0.0, c.ttft_slo_s - profile.prefill(prompt))
        if c is not None and c.kind == "batch" and c.deadline_s is not None:
            return max(0.0, c.deadline_s - own)
        return max(0.0, self.slo_scale * self.mean_exec_s() - own)

    def mean_exec_s(self, tp: int | None = None) -> float:
        """Isolated execution time of a mean-length request at ``tp`` (default: the reference tp_min)."""
        return self.profile.at_tp(tp or self.tp_min).exec_time(
            round(self.mean_prompt_tokens), max(1, round(self.mean_output_tokens))
        )


@dataclass(frozen=True, slots=True)
class RoleCounts:
    """Instance counts by Chiron role."""

    interactive: int = 0
    mixed: int = 0
    batch: int = 0

    def __post_init__(self) -> None:
        if min(self.interactive, self.mixed, self.batch) < 0:
            raise ValueError(f"instance counts must be >= 0, got {self}")

    @property
    def total(self) -> int:
        """All instances."""
        return self.interactive + self.mixed + self.batch

    def get(self, role: Role) -> int:
        """Count of one role."""
        return getattr(self, role)

    def short(self) -> str:
        """``1i/2m/0b``: the counts as events and logs show them."""
        return f"{self.interactive}i/{self.mixed}m/{self.batch}b"


def assign_roles(desired: RoleCounts, current: Sequence[Role] = ()) -> tuple[Role, ...]:
    """The role of each instance ordinal for ``desired``, given the role each running ordinal has now.

    A group's pods are one StatefulSet: a smaller total removes the highest ordinals, a larger one
    starts new ordinals after the last, and any running pod can change role without a restart (the
    role only steers routing and dispatch). So the ordinals below the new total keep their role where
    the counts allow; the highest ordinals of a role over its count change to the roles under theirs,
    interactive first (a running instance serves at once, a new one after its cold start); the new
    ordinals take what is still missing, in ``ROLES`` order. Without running ordinals: interactive
    first, then mixed, then batch. The operator, local mode and the simulator's Chiron controller all
    carry out a decision with it, so a change of one role's count re-roles no other instance. (Roles by
    ordinal in a fixed order re-roled a batch instance, and removed the top one with its batch work,
    at every change of the interactive count.)"""
    kept = list(current[: desired.total])
    have = Counter(kept)
    missing = [r for r in ROLES for _ in range(max(0, desired.get(r) - have[r]))]
    for ordinal in reversed(range(len(kept))):
        role = kept[ordinal]
        if have[role] > desired.get(role):
            have[role] -= 1
            kept[ordinal] = missing.pop(0)
    return (*kept, *missing)


def parse_roles(value: object) -> tuple[Role, ...]:
    """A list of roles read back from stored JSON (status, ConfigMap); ValueError naming what is wrong."""
    if not isinstance(value, list) or not all(role in ROLES for role in value):
        raise ValueError(f"roles must be a list of {', '.join(ROLES)}, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One placement group: services co-located on instances of ``tp`` GPUs each.

    ``name`` depends only on (services, tp), so a group that survives a re-placement keeps its name and
    therefore its StatefulSet and pods (least churn)."""

    name: str
    services: tuple[str, ...]
    tp: int
    replicas: RoleCounts
    batch_size: int | None = None
    # The role of each pod ordinal: always ``assign_roles`` of ``replicas`` from the roles given, so a
    # copy with new counts (``replace(group, replicas=...)``) re-roles no more running pods than it must.
    roles: tuple[Role, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", assign_roles(self.replicas, self.roles))

    @property
    def key(self) -> tuple[tuple[str, ...], int]:
        """What identifies the group across plans."""
        return (self.services, self.tp)

    @property
    def gpus(self) -> int:
        """GPUs the group uses over all its replicas."""
        return self.tp * self.replicas.total


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """A placement: groups, plus what the planner's estimator predicted for it (SeaLLM M_est)."""

    strategy: str
    groups: tuple[GroupPlan, ...]
    estimated_slo_attainment: float | None = None
    estimated_norm_latency: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        """GPUs used by all groups."""
        return sum(g.gpus for g in self.groups)

    def groups_of(self, service: str) -> list[GroupPlan]:
        """Groups hosting ``service``."""
        return [g for g in self.groups if service in g.services]


# ---------------------------------------------------------------------------------------------------
# Chiron global autoscaler


@dataclass(frozen=True, slots=True)
class BatchGroup:
    """Queued batch requests with (nearly) the same absolute deadline (a QLM/Chiron request group)."""

    count: int
    deadline: float  # absolute time by which the group's last request must get its first token

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"batch group count must be >= 0, got {self.count}")


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What the global autoscaler measures of one scaling unit (a placement group) at one moment."""

    ready: RoleCounts  # instances serving now
    pending: RoleCounts = RoleCounts()  # instances starting (counted so scale-ups are not repeated)
    instances_with_interactive: int = 0  # U: I+M instances running >= 1 interactive request
    interactive_queued: int = 0  # interactive requests waiting for any I/M instance (routing step 4)
    batch_queue: tuple[BatchGroup, ...] = ()
    batch_running: int = 0  # batch requests running on batch or mixed instances
    batch_tokens_per_s: float | None = None  # measured batch-token throughput now (Θ_now)
    batch_instance_tokens_per_s: float | None = None  # measured per-batch-instance throughput (Θ_B)
    mean_output_tokens: float | None = None  # μ_o of batch requests (online fit)
    std_output_tokens: float | None = None  # σ_o
    interactive_arrival_rps: float | None = None  # interactive arrivals per second, recent (forecasting)


@dataclass(frozen=True, slots=True)
class ChironSettings:
    """Chiron global autoscaler settings (docs/papers.md, "Chiron: global autoscaler": our choices)."""

    over_provisioning: float = 1 / 3  # Θ_op
    band: float = 0.05  # δ_op
    eval_interval_s: float = 5.0  # T_eval
    load_time_s: float = 15.0  # T_load of a new instance
    min_instances: int = 0  # pool lower bound (all roles)
    max_instances: int = 50  # GPU cap in instances (all roles)
    min_interactive: int = 1
    scale_down_evaluations: int = 2  # consecutive low evaluations before a scale-down
    scale_up_cooldown_s: float = 0.0
    scale_down_cooldown_s: float = 120.0  # after any scaling, before a scale-down (stabilisation)
    z: float = 2.33  # quantile multiplier of the waiting-time estimate (QLM, p99)
    default_instance_tokens_per_s: float = 2000.0  # Θ_B before any measurement (profile seed)
    defer: bool = False  # count a batch group only when its deadline is within defer_horizon
    defer_horizon_fraction: float = 0.25  # H = fraction x TTFT SLO
    batch_slo_s: float = 3600.0  # batch TTFT SLO (for the defer horizon)
    throughput_ewma: float = 0.5
    # A batch group past its deadline that stays late with every free slot launched takes them all
    # (Alg. 2's loop to the cap) instead of the fewest instances reaching the least BBP (our choice).
    overdue_fills_cap: bool = True
    # Launch the fewest batch instances that meet the deadlines only at the latest evaluation that
    # still meets them (our choice; False: as soon as any group would be late, as Chiron). Until then
    # the held work fills the spare room of mixed instances, and the instances launched later run for
    # less time.
    just_in_time: bool = False
    # Load forecasting (our extension; off at 0): Θ_op follows the interactive arrival rate's trend.
    forecast_window_s: float = 0.0  # window of the measured arrival rate
    forecast_utilization: float = 0.8  # target busy share at the rate forecast one load time ahead

    def __post_init__(self) -> None:
        if not 0 < self.over_provisioning <= 1:
            raise ValueError("over_provisioning (Θ_op) must be in (0, 1]")
        if self.forecast_window_s < 0:
            raise ValueError("forecast_window_s must be >= 0 (0: no load forecasting)")
        if not self.band < self.forecast_utilization <= 1:
            raise ValueError("forecast_utilization must be in (band, 1]")
        if not 0 <= self.band < self.over_provisioning:
            raise ValueError("band (δ_op) must be in [0, Θ_op)")
        if self.min_instances < 0 or self.max_instances < max(1, self.min_instances):
            raise ValueError("instance bounds must satisfy 0 <= min_instances <= max_instances, max >= 1")
        if self.scale_down_evaluations < 1:
            raise ValueError("scale_down_evaluations must be >= 1")
        if not 0 < self.throughput_ewma <= 1:
            raise ValueError("throughput_ewma must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class AutoscalerState:
    """State the global autoscaler carries between evaluations (stored by the caller, e.g. in status)."""

    low_evaluations: int = 0  # consecutive evaluations with IBP below the band
    last_scale_up: dict[str, float] = field(default_factory=dict)  # role -> time
    last_scaling: float | None = None  # time of the latest change of the interactive or mixed count
    instance_tokens_per_s: float | None = None  # EWMA of Θ_B
    last_batch_launch_backpressure: int = 0  # BBP when batch instances were last launched
    # Load forecasting: (time, interactive arrival rate) measured over the last forecast window.
    arrival_history: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """The autoscaler's answer: desired counts by role, why, and the state to pass next time."""

    desired: RoleCounts
    reasons: tuple[str, ...]
    state: AutoscalerState
    ibp: float | None = None
    batch_backpressure: int = 0

    def changed(self, current: RoleCounts) -> bool:
        """Whether the desired counts differ from ``current``."""
        return self.desired != current
