"""ServingPool: a pool of GPU instances shared by several LLMServices, with autoscaling and placement."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from tessera.api.base import ApiModel, Quantity, Resource, ResourceStatus, nested
from tessera.api.rules import LessOrEqual, MutuallyExclusive, NoFlags

# vLLM server flags the operator owns, and where each comes from; extraVllmArgs may not set them in any
# spelling vLLM 0.32's parser accepts (tests/test_vllm_owned_flags.py checks these against that parser).
VLLM_FLAG_SOURCES: tuple[tuple[str, str], ...] = (
    ("--model", "the operator sets from the LLMService's model (name, source or volume)"),
    ("--served-model-name", "the operator sets from the LLMService's model.name"),
    ("--host", "the operator sets (the worker reaches vLLM on loopback)"),
    ("--port", "the operator sets (the worker reaches vLLM on loopback)"),
    ("--uds", "the operator sets (the worker reaches vLLM on loopback TCP)"),
    ("--api-key", "the operator sets (the worker calls vLLM without a key)"),
    (
        "--tensor-parallel-size",
        "the operator sets from the LLMService's model.tensorParallelSize and the placement",
    ),
    ("-tp", "the operator sets from the LLMService's model.tensorParallelSize and the placement"),
    ("--pipeline-parallel-size", "the placement sets (an instance's GPUs are one tensor-parallel engine)"),
    ("-pp", "the placement sets (an instance's GPUs are one tensor-parallel engine)"),
    ("--data-parallel-size", "the placement sets (replicas are instances: ServingPool instances)"),
    ("-dp", "the placement sets (replicas are instances: ServingPool instances)"),
    ("--max-num-seqs", "the operator sets from the ServingPool's autoscaling.batchSize.max"),
    ("--dtype", "the operator sets from the LLMService's model.dtype"),
    ("--max-model-len", "the operator sets from the LLMService's model.maxModelLength"),
    ("--config", "would let a file set any of these flags: give its flags here instead"),
    ("--device-memory-utilization", "is vLLM's other name of --gpu-memory-utilization: use that name"),
    ("--kv-events-config", "the operator sets from the ServingPool's kvEvents (ports the router finds)"),
    ("--enable-lora", "the operator sets on a base model that LLMService adapters name (model.adapter)"),
    ("--no-enable-lora", "the operator sets --enable-lora on a base model that adapters name"),
    ("--max-loras", "the operator sets from the ServingPool's maxLoras and the base's adapters"),
    ("--max-lora-rank", "the operator sets from the ServingPool's maxLoraRank"),
    ("--max-cpu-loras", "the operator sets from the number of adapters of the base"),
)
OPERATOR_OWNED_VLLM_FLAGS = tuple(flag for flag, _ in VLLM_FLAG_SOURCES)
# vLLM flags extraVllmArgs may set that the operator reads there (the GPU memory share for placement and
# co-located models; vLLM's batched-token budget against --max-num-seqs): spelled exactly, or it would
# not see them.
GPU_MEMORY_FLAG = "--gpu-memory-utilization"
BATCHED_TOKENS_FLAG = "--max-num-batched-tokens"
VLLM_FLAGS_READ = (GPU_MEMORY_FLAG, BATCHED_TOKENS_FLAG)


def sets_flag(args: list[str], flag: str) -> bool:
    """Whether vLLM arguments ``args`` set ``flag`` as ``flag value`` or ``flag=value`` (the spellings
    extraVllmArgs allows for the flags in ``VLLM_FLAGS_READ``)."""
    return any(a.split("=", 1)[0] == flag for a in args)


DEFAULT_WORKER_IMAGE = "ghcr.io/tessera-dev/tessera-worker:0.1.0"
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"


MAX_INSTANCES = 1000  # instances of one pool: planning cost and memory grow with them
MAX_BATCH = 65536  # sequences in one engine batch
MAX_SERVICES_PER_GROUP = 8  # models in one pod: each has its own vLLM server and ports
# The ranks vLLM's --max-lora-rank accepts (its LoRAConfig refuses any other).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
MAX_LORAS = 256  # adapters in one engine batch: each slot holds the adapter's weights in GPU memory
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
DNS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class GPUSpec(ApiModel):
    """The GPUs of one instance."""

    type: str = Field(min_length=1, description="GPU model, e.g. H100, A100-80GB, L4 (used for profiles).")
    per_instance: int = Field(default=1, ge=1, le=16, description="GPUs per instance (pod).")
    memory: Quantity = Field(description="Memory of one GPU, e.g. '80Gi'.")
    resource_name: str = Field(
        default="nvidia.com/gpu",
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$",
        description="Extended resource the pods request, e.g. nvidia.com/gpu.",
    )


class Toleration(ApiModel):
    """A pod toleration (the Kubernetes core/v1 Toleration shape)."""

    key: str | None = Field(default=None, description="Taint key; unset with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; unset means all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated; unset means forever."
    )


class InstanceBounds(ApiModel):
    """Bounds on the number of instances (pods) of the pool, over all placement groups and roles."""

    RULES = (LessOrEqual("min", "max"), LessOrEqual("min", "desired"), LessOrEqual("desired", "max"))

    min: int = Field(default=0, ge=0, le=MAX_INSTANCES, description="Fewest instances.")
    max: int = Field(
        ge=1,
        le=MAX_INSTANCES,
        description="Most instances (the pool's GPU budget is max x gpu.perInstance); at most 1000, as the "
        "cost of planning a pool grows with its instances.",
    )
    desired: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INSTANCES,
        description="Instance count to hold when autoscaling is disabled (the scale subresource); "
        "unset means one instance per placed replica.",
    )


class BatchSizeBounds(ApiModel):
    """Bounds of the per-instance batch size (max concurrent sequences) set by the local autoscaler."""

    RULES = (LessOrEqual("min", "initial"), LessOrEqual("initial", "max"))

    min: int = Field(default=1, ge=1, le=MAX_BATCH, description="Smallest batch size.")
    initial: int = Field(
        default=256, ge=1, le=MAX_BATCH, description="Batch size at start (vLLM's default max_num_seqs)."
    )
    max: int = Field(
        default=8192,
        ge=1,
        le=MAX_BATCH,
        description="Largest batch size (Chiron BS_max); at most 65536 sequences, beyond any engine's.",
    )


class AutoscalingSpec(ApiModel):
    """Chiron hierarchical autoscaling: local batch size, global interactive/mixed/batch instance counts."""

    enabled: bool = Field(
        default=True, description="Run the autoscalers; when false, instances.desired holds."
    )
    interval_seconds: float = Field(
        default=5.0,
        ge=1,
        le=3600,
        allow_inf_nan=False,
        description="Period of the global autoscaler (Chiron T_eval), 1 s to 1 h: it reads metrics "
        "scraped every few seconds, so a shorter period only repeats the last decision.",
    )
    over_provisioning: float = Field(
        default=1 / 3,
        gt=0,
        le=1,
        description="Target share of interactive+mixed instances busy with interactive work (Chiron Θ_op; "
        "1/3 absorbs 3x spikes).",
    )
    over_provisioning_band: float = Field(
        default=0.05, ge=0, lt=1, description="Tolerance δ_op around the target before scaling."
    )
    scale_up_cooldown_seconds: float = Field(
        default=0.0,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="Least time between two scale-ups of the same role (at most a day).",
    )
    scale_down_cooldown_seconds: float = Field(
        default=120.0,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="Least time after any scaling before a scale-down (stabilisation; at most a day).",
    )
    forecast_window_seconds: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="Load forecasting (our extension of Chiron): the interactive target follows the trend of "
        "the interactive arrival rate over this window, one load time ahead, instead of the fixed "
        "overProvisioning; 0 turns it off (at most an hour).",
    )
    forecast_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="With load forecasting: the share of interactive instances busy at the forecast rate.",
    )
    batch_just_in_time: bool = Field(
        default=False,
        description="Launch the batch instances that held batch work needs to meet its deadlines only at the "
        "latest evaluation that still meets them (our extension of Chiron; false: as soon as a deadline "
        "would be missed with none added, as Chiron).",
    )
    batch_size: BatchSizeBounds = nested(BatchSizeBounds, "Bounds of the local autoscaler's batch size.")


class ReplacementInterval(ApiModel):
    """SeaLLM's adaptive re-placement interval (Eq. 8)."""

    RULES = (LessOrEqual("minSeconds", "initialSeconds"), LessOrEqual("initialSeconds", "maxSeconds"))

    initial_seconds: float = Field(
        default=300.0, ge=10, le=7 * 86400, allow_inf_nan=False, description="First interval I_0 in seconds."
    )
    min_seconds: float = Field(
        default=60.0,
        ge=10,
        le=7 * 86400,
        allow_inf_nan=False,
        description="Shortest interval I_min in seconds (at least 10 s: a re-placement moves pods).",
    )
    max_seconds: float = Field(
        default=1800.0,
        ge=10,
        le=7 * 86400,
        allow_inf_nan=False,
        description="Longest interval I_max in seconds (at most a week).",
    )
    beta: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="Adaptation rate β: shrink by (1-β) when the relative prediction error exceeds β, "
        "else grow by (1+β).",
    )
    load_shift_threshold: float = Field(
        default=0.5,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="Re-place before the boundary when a service's arrival rate over the last minSeconds "
        "departs from the rate its plan was made for by more than this fraction (and beyond Poisson noise); "
        "checked every minSeconds/2, never sooner than minSeconds after the last placement. 0 turns it "
        "off (boundaries only from the interval).",
    )


class PlacementSpec(ApiModel):
    """How services are placed onto groups of instances."""

    strategy: Literal["seallm", "dedicated"] = Field(
        default="seallm",
        description="seallm: co-locate services on GPU groups (SeaLLM); dedicated: one group per service.",
    )
    max_services_per_group: int = Field(
        default=2,
        ge=1,
        le=MAX_SERVICES_PER_GROUP,
        description="Most services sharing one group (SeaLLM K_max). Co-located models split the GPU memory "
        "and swap by vLLM's sleep mode where it has one (CUDA/ROCm); elsewhere (vLLM on CPU) they stay "
        "resident.",
    )
    replacement_interval: ReplacementInterval = nested(ReplacementInterval, "Adaptive re-placement interval.")
    handover_timeout_seconds: int = Field(
        default=900,
        ge=0,
        le=86400,
        description="Longest a group that a re-placement removes keeps serving while the groups taking over "
        "its services start (image pull, weights, warm-up); it is removed as soon as they are all ready, "
        "else after this many seconds (a cluster without room for both at once). 0 removes it at once.",
    )


class ImagesSpec(ApiModel):
    """Container images of the worker pods."""

    worker: str = Field(default=DEFAULT_WORKER_IMAGE, min_length=1, description="Tessera worker image.")
    vllm: str = Field(default=DEFAULT_VLLM_IMAGE, min_length=1, description="vLLM OpenAI server image.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )


class EngineResources(ApiModel):
    """CPU and memory of the model-server container, per GPU of the group's instance (a group at tensor
    parallel size 2 gets twice these); the worker container has its own fixed, small share."""

    cpu_per_gpu: Quantity = Field(
        default="4",
        description="CPU requested per GPU, e.g. '4' or '3500m' (tokenization, scheduling and the API "
        "server of each model run on CPU). No CPU limit is set: throttling an engine stalls its batch.",
    )
    memory_per_gpu: Quantity = Field(
        default="32Gi",
        description="Host memory per GPU, requested and limited (weights pass through host memory while "
        "loading). The /dev/shm size is added to it, since a memory-backed volume counts against the limit.",
    )


class ModelCacheSpec(ApiModel):
    """Where the model servers keep downloaded weights (HF_HOME). Unset claimName and hostPath: an
    emptyDir, so every pod start downloads the weights again."""

    RULES = (MutuallyExclusive("claimName", "hostPath"),)

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_NAME_PATTERN,
        description="PersistentVolumeClaim in the pool's namespace (ReadWriteMany to share it between "
        "pods), mounted read-write.",
    )
    host_path: str | None = Field(
        default=None,
        min_length=2,
        max_length=1024,
        pattern=r"^/",
        description="Absolute directory on the node (created when missing): a per-node cache.",
    )
    mount_path: str = Field(
        default="/var/cache/huggingface",
        min_length=2,
        max_length=1024,
        pattern=r"^/",
        description="Where the cache is mounted in the model-server container; HF_HOME points there.",
    )


class SecretKeyRef(ApiModel):
    """A key of a Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_NAME_PATTERN, description="Secret name.")
    key: str = Field(
        default="token",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key in the Secret holding the value.",
    )


class TopologySpread(ApiModel):
    """A topology spread constraint over the pods of one placement group (the operator sets the selector)."""

    topology_key: str = Field(
        min_length=1,
        max_length=316,
        pattern=LABEL_KEY_PATTERN,
        description="Node label to spread over, e.g. kubernetes.io/hostname or topology.kubernetes.io/zone.",
    )
    max_skew: int = Field(default=1, ge=1, le=MAX_INSTANCES, description="Largest allowed pod-count skew.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        default="ScheduleAnyway",
        description="ScheduleAnyway: prefer spreading; DoNotSchedule: leave pods pending rather than skew.",
    )


class EngineSecurity(ApiModel):
    """The user the model-server container runs as."""

    run_as_root: bool = Field(
        default=False,
        description="Run the model servers as root (the vLLM image's default user). false: as runAsUser, "
        "with HOME and the caches on writable volumes; set true only for an image that needs root.",
    )
    run_as_user: int = Field(
        default=1000, ge=1, le=2147483647, description="Non-root UID (and GID, fsGroup) of the model servers."
    )


class DisruptionBudget(ApiModel):
    """The PodDisruptionBudget of each placement group (voluntary evictions such as node drains)."""

    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=MAX_INSTANCES,
        description="Most pods of a group evicted at once; at least 1, so that node drains can proceed.",
    )


class WorkerPodSpec(ApiModel):
    """How the worker pods run on a GPU cluster."""

    resources: EngineResources = nested(EngineResources, "CPU and memory of the model servers.")
    shm_size: Quantity | None = Field(
        default=None,
        description="Size of /dev/shm (a memory-backed emptyDir) of the model servers; unset: 1Gi at "
        "tensor parallel size 1, 4Gi per GPU above (NCCL and vLLM's workers exchange data through it).",
    )
    model_cache: ModelCacheSpec = nested(ModelCacheSpec, "Model-weight cache (HF_HOME).")
    hub_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token (HF_TOKEN), for gated models.",
    )
    topology_spread: list[TopologySpread] = Field(
        default_factory=list, max_length=4, description="Topology spread constraints of each group's pods."
    )
    engine_security: EngineSecurity = nested(EngineSecurity, "User of the model-server container.")
    disruption_budget: DisruptionBudget = nested(DisruptionBudget, "PodDisruptionBudget of each group.")


class ServingPoolSpec(ApiModel):
    """Desired state of a ServingPool."""

    RULES = (NoFlags("extraVllmArgs", OPERATOR_OWNED_VLLM_FLAGS, VLLM_FLAG_SOURCES, VLLM_FLAGS_READ),)

    gpu: GPUSpec = Field(description="GPUs of each instance.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels of the GPU node pool the instances must run on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations for the taints of the GPU node pool."
    )
    instances: InstanceBounds = Field(description="Bounds on the instance count.")
    autoscaling: AutoscalingSpec = nested(AutoscalingSpec, "Autoscaling settings (Chiron).")
    placement: PlacementSpec = nested(PlacementSpec, "Placement settings (SeaLLM).")
    images: ImagesSpec = nested(ImagesSpec, "Container images.")
    pod: WorkerPodSpec = nested(
        WorkerPodSpec, "Resources, volumes, security and disruption budget of the pods."
    )
    extra_vllm_args: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra vLLM server arguments, e.g. ['--enable-prefix-caching']; flags the operator sets "
        "(--model, --port, --tensor-parallel-size/-tp, --max-num-seqs, --max-model-len, --config, ...) are "
        "refused in every spelling vLLM accepts (abbreviated, '_' for '-', flag=value); the operator reads "
        "--gpu-memory-utilization and --max-num-batched-tokens, which must be spelled so.",
    )
    kv_events: bool = Field(
        default=False,
        description="Each model's vLLM server publishes its KV events (--kv-events-config: a ZMQ publisher "
        "on port 8200 + the model's index in its pod, bound on every interface) and the router's "
        "precise-prefix route subscribes to them (tessera router --kubernetes discovers the ports). The "
        "events carry prompt token ids: apply manifests/network, which admits only the router there.",
    )
    max_lora_rank: LoraRank = Field(
        default=16,
        description="Largest LoRA rank the base models' vLLM servers accept (--max-lora-rank; one of 1, 8, "
        "16, 32, 64, 128, 256, 320, 512): an adapter LLMService of a higher rank is refused. vLLM reserves "
        "GPU memory for adapters of this rank.",
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=MAX_LORAS,
        description="Adapters one batch of a base model may mix (--max-loras: slots in GPU memory); the "
        "others wait in CPU memory (--max-cpu-loras, every adapter of the base). Unset: the number of "
        "adapters of the base.",
    )


class ReplicasByRole(ApiModel):
    """Instance counts of one group by Chiron role."""

    interactive: int = Field(default=0, ge=0, description="Instances serving interactive requests only.")
    mixed: int = Field(
        default=0, ge=0, description="Over-provisioned instances serving both (preemptible batch)."
    )
    batch: int = Field(default=0, ge=0, description="Instances serving batch requests only.")

    @property
    def total(self) -> int:
        """All instances of the group."""
        return self.interactive + self.mixed + self.batch


class PlacementGroup(ApiModel):
    """One placement group: a set of services co-located on instances of the same shape."""

    name: str = Field(description="Group name (also names its StatefulSet).")
    services: list[str] = Field(description="LLMServices placed in the group.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per instance used by the group.")
    replicas: ReplicasByRole = nested(ReplicasByRole, "Instances by role.")
    roles: list[Literal["interactive", "mixed", "batch"]] = Field(
        default_factory=list,
        description="The role of each pod by ordinal (pod N runs roles[N]): a change of the counts keeps "
        "each running pod's role where it can, so scaling one role re-roles no other pod.",
    )
    ready_replicas: int = Field(default=0, ge=0, description="Instances ready to serve.")
    batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Batch size the local autoscaler runs now: the mean of the workers' tessera_batch_size "
        "over the group's pods and models, rounded (unset until Prometheus reports it).",
    )
    sharing: Literal["single", "co-resident", "swapping"] | None = Field(
        default=None,
        description="How a pod of the group shares its accelerator between its models: single (one "
        "model), co-resident (every model's engine resident, run side by side under one scheduler) or "
        "swapping (one awake at a time, vLLM sleep mode).",
    )


class UnplacedService(ApiModel):
    """A valid LLMService of the pool that the placement in effect leaves out, and why."""

    name: str = Field(description="LLMService name.")
    reason: str = Field(description="Unplaceable, PoolFull or CannotShareGroup.")
    message: str = Field(description="What is short, and how to fix it.")


class RetiringGroup(ApiModel):
    """A group of an earlier placement that keeps serving until the groups taking over its services are
    ready (or the handover times out)."""

    name: str = Field(description="Group name.")
    services: list[str] = Field(default_factory=list, description="LLMServices its pods serve.")
    waiting_for: list[str] = Field(
        default_factory=list, description="Groups of the placement in effect not all ready yet."
    )
    since: datetime = Field(description="When the placement in effect stopped including it.")


class PlacementPlan(ApiModel):
    """The placement in effect."""

    groups: list[PlacementGroup] = Field(
        default_factory=list,
        description="Placement groups.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    strategy: str | None = Field(default=None, description="Strategy that produced the plan.")
    estimated_slo_attainment: float | None = Field(
        default=None, ge=0, le=1, description="SLO attainment the placement simulator predicted (M_est)."
    )
    estimated_norm_latency: float | None = Field(
        default=None,
        ge=0,
        description="Mean normalized latency (latency / isolated execution time) the placement simulator "
        "predicted (M_est).",
    )
    unplaced: list[UnplacedService] = Field(
        default_factory=list,
        description="The pool's valid LLMServices it cannot place (each also says so in its Placed "
        "condition); the others are placed.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    retiring: list[RetiringGroup] = Field(
        default_factory=list,
        description="Groups an earlier placement had, serving until their services' new groups are ready.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class GroupSleepStatus(ApiModel):
    """A group whose services all scale to zero: whether it is awake, asleep or waking, and the replicas it
    had awake (restored when a request wakes it)."""

    group: str = Field(description="Group name.")
    state: Literal["Ready", "Cold", "Waking"] = Field(
        description="Ready (awake), Cold (at zero replicas) or Waking (replicas restored, no pod ready yet)."
    )
    since: datetime = Field(description="When it entered this state.")
    replicas: ReplicasByRole = nested(ReplicasByRole, "Instances by role while awake.")


class ScalingDecision(ApiModel):
    """One scaling action of the global autoscaler or the placement loop."""

    time: datetime = Field(description="When the decision was made.")
    group: str | None = Field(default=None, description="Placement group concerned; unset means the pool.")
    role: Literal["interactive", "mixed", "batch", "all"] = Field(default="all", description="Role scaled.")
    from_replicas: int = Field(ge=0, description="Instances before.")
    to_replicas: int = Field(ge=0, description="Instances after.")
    reason: str = Field(description="Why, e.g. 'IBP 0.52 > 0.38' or 'batch backpressure: 3 groups late'.")


SCALING_HISTORY_LENGTH = 20


class IntervalPerformance(ApiModel):
    """What the workers measured over one re-placement interval (SeaLLM's M_real)."""

    slo_attainment: float = Field(
        ge=0, le=1, description="Fraction of finished requests that met their class's SLO."
    )
    norm_latency: float = Field(
        ge=0, description="Mean end-to-end latency over the isolated execution time of a mean request."
    )
    requests: int = Field(default=0, ge=0, description="Requests finished in the interval.")
    window_seconds: float = Field(gt=0, description="Length of the measured interval in seconds.")


class ServingPoolStatus(ResourceStatus):
    """Observed state of a ServingPool."""

    placement: PlacementPlan = nested(PlacementPlan, "Placement plan in effect.")
    last_placement_time: datetime | None = Field(default=None, description="When the plan was last computed.")
    next_placement_time: datetime | None = Field(
        default=None, description="When the plan is next recomputed."
    )
    replacement_interval_seconds: float | None = Field(
        default=None, gt=0, description="Current adaptive re-placement interval I_t in seconds."
    )
    inputs_digest: str | None = Field(
        default=None,
        description="Digest of the specs the plan in effect was made from (the pool's, its services' and "
        "their classes'): the operator re-plans when they change, and not on a restart when they did not.",
    )
    measured: IntervalPerformance | None = Field(
        default=None, description="What the last completed interval measured (compared with its estimate)."
    )
    estimate_error: float | None = Field(
        default=None,
        ge=0,
        description="Relative error of the last interval's estimate against its measurement (SeaLLM Eq. 8: "
        "the larger of the attainment's and the normalized latency's); above beta the interval shrinks.",
    )
    replicas: int = Field(default=0, ge=0, description="Instances of the pool (all groups and roles).")
    ready_replicas: int = Field(default=0, ge=0, description="Instances ready to serve.")
    selector: str | None = Field(
        default=None, description="Label selector of the pool's pods (scale subresource)."
    )
    scaling_history: list[ScalingDecision] = Field(
        default_factory=list,
        max_length=SCALING_HISTORY_LENGTH,
        description=f"Last {SCALING_HISTORY_LENGTH} scaling decisions, oldest first.",
    )
    scale_to_zero: list[GroupSleepStatus] = Field(
        default_factory=list,
        description="The groups whose services all have scaleToZero: asleep, waking or awake since when.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["group"]},
    )


class ServingPool(Resource):
    """A pool of GPU instances shared by LLMServices, with its autoscaling and placement settings."""

    kind: Literal["ServingPool"] = Field(default="ServingPool", description="ServingPool.")
    spec: ServingPoolSpec = Field(description="Desired state.")
    status: ServingPoolStatus | None = Field(
        default=None, description="Observed state (set by the operator)."
    )
