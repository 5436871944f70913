"""LLMService: one model served from a ServingPool, the request classes it accepts and how it schedules."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from tessera.api.base import (
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    ApiModel,
    Quantity,
    Resource,
    ResourceStatus,
    nested,
)
from tessera.api.fair_share import FairShareSpec
from tessera.api.request_class import ClassOverrides, RequestClassSpec
from tessera.api.rules import ExcludedWhen, KeysAllowed, LessOrEqual, ListedIn, MutuallyExclusive
from tessera.api.worker_config import ToolParserName
from tessera.core.activation import IdlePolicy
from tessera.core.registry import settings_model, validate_settings
from tessera.core.request import ServiceClass

# Bounds the list so that the API server's CEL cost estimate of the defaultClass rule stays small.
MAX_CLASSES_PER_SERVICE = 32
MAX_MODEL_LENGTH = 2**24  # tokens: longer than any model's context; placement sizes KV from it


class VolumeSource(ApiModel):
    """Model weights on a PersistentVolumeClaim."""

    claim_name: str = Field(pattern=NAME_PATTERN, description="Name of the PersistentVolumeClaim.")
    path: str = Field(default="/", description="Directory inside the volume holding the model files.")


# Where an adapter's files are: an absolute directory the base's vLLM server reads (a mounted volume or
# the pool's model cache), a Hugging Face id (hf://org/name or org/name) it downloads, or the name of an
# adapter `tessera models pull` builds (a bare name, no slash: local mode serves its cache folder).
PULLED_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
ADAPTER_SOURCE_PATTERN = rf"^(/.+|(hf://)?[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+|{PULLED_NAME_PATTERN})$"
MAX_ADAPTER_RANK = 512  # vLLM's largest --max-lora-rank


class AdapterSpec(ApiModel):
    """A LoRA adapter of a base model: served by the base's vLLM servers under this service's model name."""

    base: str = Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="Name of the LLMService of the base model, in the same namespace and pool; it must be "
        "a full model (not itself an adapter).",
    )
    source: str = Field(
        min_length=2,
        max_length=1024,
        pattern=ADAPTER_SOURCE_PATTERN,
        description="The adapter's files: an absolute directory in the engine container (a mounted volume "
        "or the pool's model cache), a Hugging Face id (org/name or hf://org/name), or the name of an "
        "adapter that `tessera models pull` builds (e.g. smollm2-lora): local mode serves the folder it "
        "built; the operator refuses such a name (a cluster has no such cache).",
    )
    rank: int = Field(
        ge=1,
        le=MAX_ADAPTER_RANK,
        description="The adapter's LoRA rank (r); at most the pool's maxLoraRank.",
    )

    @property
    def pulled(self) -> bool:
        """Whether ``source`` names an adapter of ``tessera models pull`` (a bare name) rather than files."""
        return "/" not in self.source


class ModelSpec(ApiModel):
    """The model to serve and how vLLM loads it."""

    RULES = (
        MutuallyExclusive("source", "volume"),
        MutuallyExclusive("adapter", "source"),
        MutuallyExclusive("adapter", "volume"),
    )

    name: str = Field(
        min_length=1,
        description="Model name as clients send it, e.g. meta-llama/Llama-3.1-8B-Instruct; also the "
        "Hugging Face id to load when neither source nor volume is set.",
    )
    source: str | None = Field(
        default=None,
        pattern=r"^(hf|s3|gs|https?|file)://.+$",
        description="Where to load weights from: an hf://, s3://, gs://, http(s):// or file:// URI.",
    )
    volume: VolumeSource | None = Field(
        default=None, description="Load weights from a PersistentVolumeClaim."
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto", description="Weight and activation dtype passed to vLLM (--dtype)."
    )
    max_model_length: Annotated[int, Field(ge=16, le=MAX_MODEL_LENGTH)] | None = Field(
        default=None,
        description="Context length limit in tokens (--max-model-len); unset: vLLM serves the model's own, "
        "while placement and the worker assume 4096 tokens (within the KV cache). At most 16777216 (2^24): "
        "beyond any model's context, and placement sizes KV memory from it.",
    )
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        default=1, description="Smallest number of GPUs one replica of the model needs (tensor parallel)."
    )
    weights_size: Quantity | None = Field(
        default=None,
        description="Size of the weights, e.g. '16Gi'; used for placement; unset means estimated.",
    )
    tool_parser: ToolParserName | None = Field(
        default=None,
        description="vLLM's tool parser for the model's tool-call format (the names of vLLM's "
        "--tool-call-parser, e.g. hermes, llama3_json, mistral, pythonic): the worker serves tool_choice "
        "auto, the default when a request gives tools, by reading the calls back from the generated "
        "text with it; unset: such requests are refused (400).",
    )
    adapter: AdapterSpec | None = Field(
        default=None,
        description="Serve a LoRA adapter of another LLMService's model (its base) under this name, on the "
        "base's instances: the service keeps its own request classes, SLOs and scheduling. Weights, dtype, "
        "tensor parallelism and context length are the base's (source and volume may not be set).",
    )


class PoolReference(ApiModel):
    """The ServingPool (in the same namespace) that serves the model."""

    name: str = Field(pattern=NAME_PATTERN, description="Name of the ServingPool.")


class AcceptedClass(ApiModel):
    """A RequestClass the service accepts, with optional per-service overrides."""

    name: str = Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="Name of a RequestClass in the same namespace.",
    )
    overrides: ClassOverrides | None = Field(
        default=None, description="Values that replace the class's for this service only."
    )


ServicePolicy = Literal["fcfs", "edf", "isrtf", "qoe", "qlm", "seallm", "round-robin-sharing", "auto"]


def _settings_keys() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each policy's settings fields by JSON name (camelCase, as every field of the resources)."""
    policies = [p for p in typing.get_args(ServicePolicy) if p != "auto"]
    return tuple(
        (p, tuple(f.alias or n for n, f in settings_model(p).model_fields.items())) for p in policies
    )


class SchedulingSpec(ApiModel):
    """The worker's queue scheduling policy and its settings."""

    # The API server refuses unknown settings fields too; types and bounds are checked on load.
    RULES = (KeysAllowed(field="settings", selector="policy", allowed=_settings_keys()),)

    policy: ServicePolicy = Field(
        default="auto",
        description="fcfs (vLLM order), edf (earliest SLO deadline), isrtf (ELIS), qoe (Andes), qlm (QLM), "
        "seallm (SeaLLM's doubling budget across a pod's models), round-robin-sharing (the models of a pod "
        "take turns); auto picks qlm when a batch class is accepted, else qoe. A pod of several models "
        "runs its first service's policy over all of them.",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The policy's settings (camelCase keys; docs/reference.md lists each policy's); "
        "unknown fields and wrong types are refused, naming them. auto takes none: name the policy to "
        "set any.",
        json_schema_extra={"maxProperties": 64},
    )
    fair_share: FairShareSpec = Field(
        default_factory=FairShareSpec,
        description="VTC fair share between the tenants of the router's API keys: within a class, the "
        "least served backlogged tenant's request is admitted next, around the policy's own order. "
        "Co-located services run the first service's.",
    )

    @field_validator("settings")
    @classmethod
    def _settings_valid(cls, settings: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        policy = info.data.get("policy")
        if policy == "auto":
            if settings:
                raise ValueError(
                    f"policy 'auto' takes no settings (it picks qlm or qoe from the classes); got "
                    f"{', '.join(sorted(settings))}: name the policy to give it settings"
                )
        elif policy is not None:
            validate_settings(policy, settings)
        return settings

    def resolved_policy(self, has_batch_class: bool) -> str:
        """The concrete policy name, with ``auto`` resolved."""
        if self.policy != "auto":
            return self.policy
        return "qlm" if has_batch_class else "qoe"


class PredictorSpec(ApiModel):
    """The ELIS response-length predictor (encoder plus regression head) of the isrtf policy.

    It becomes isrtf's settings where ``scheduling.settings`` does not set them (those take precedence):
    enabled → predictor (text, else the running mean per class), repredictEveryTokens → windowTokens,
    checkpoint → predictorCheckpoint, encoder → predictorEncoder, online → predictorOnline. No other
    policy predicts lengths from text (QLM estimates from its token statistics), so the block does not
    concern them.
    """

    enabled: bool = Field(
        default=True,
        description="Predict response lengths with the trained text predictor (isrtf); false: the running "
        "mean of each class's finished lengths.",
    )
    encoder: str = Field(
        default="sentence-transformers/all-MiniLM-L6-v2",
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?$",
        description="Sentence encoder (a Hugging Face id) the checkpoint was trained on; the worker refuses "
        "a checkpoint trained on another.",
    )
    checkpoint: str | None = Field(
        default=None,
        min_length=2,
        max_length=1024,
        pattern=r"^/.+$",
        description="Absolute directory, in the worker container (image or mounted volume), of a trained "
        "predictor (what `tessera predictor train --out DIR` writes); unset means the shipped one.",
    )
    online: bool = Field(
        default=True,
        description="The text predictor learns online from the worker's finished requests (isrtf "
        "predictorOnline): a correction of the trained head refitted in the background.",
    )
    repredict_every_tokens: int = Field(
        default=50,
        ge=1,
        le=65536,
        description="Re-predict the remaining length after this many generated tokens (isrtf windowTokens).",
    )


class ReplicaBounds(ApiModel):
    """Bounds on the number of replicas of the service across the pool."""

    RULES = (LessOrEqual("min", "max"),)

    min: int = Field(default=1, ge=0, description="Fewest replicas (0 allows scaling the service to zero).")
    max: int = Field(default=4, ge=1, description="Most replicas.")


class ExpectedLoad(ApiModel):
    """The load a service expects: placement uses it until the workers' metrics measure the real one."""

    requests_per_second: float | None = Field(
        default=None,
        ge=0,
        le=1e6,
        allow_inf_nan=False,
        description="Expected request rate in requests/s; unset means 0 (placed by memory only).",
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Expected mean prompt length in tokens; unset means 128.",
    )
    output_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Expected mean output length in tokens; unset means 256.",
    )


class ScaleToZero(ApiModel):
    """The idle policy: a service without requests for ``afterSeconds`` is put to sleep, and the router's
    activator holds the requests that arrive for it until it is awake again."""

    after_seconds: float = Field(
        ge=1,
        le=7 * 86400,
        allow_inf_nan=False,
        description="Seconds without any request after which the service sleeps (1 to 604800).",
    )
    hold_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Longest wait of a held request for the wake-up before a 503 with Retry-After; unset "
        "means its class's TTFT SLO, or 60 for a class without one.",
    )
    max_held: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Requests held at most while the service wakes; beyond it the router answers 429.",
    )

    def policy(self) -> IdlePolicy:
        """The idle policy the router's activator and the operator apply."""
        return IdlePolicy(self.after_seconds, self.hold_seconds, self.max_held)


class LLMServiceSpec(ApiModel):
    """Desired state of an LLMService."""

    RULES = (
        ListedIn(field="defaultClass", items="requestClasses"),
        # predictor.enabled false turns isrtf's text predictor off; settings that turn it on contradict it
        ExcludedWhen(
            field="scheduling.settings.predictor", value="text", when="predictor.enabled", when_value=False
        ),
    )

    model: ModelSpec = Field(description="The model to serve.")
    pool_ref: PoolReference = Field(description="The ServingPool to place the model on.")
    request_classes: list[AcceptedClass] = Field(
        min_length=1,
        max_length=MAX_CLASSES_PER_SERVICE,
        description="RequestClasses the service accepts (at least one), matched by header.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    default_class: str | None = Field(
        default=None,
        max_length=NAME_MAX_LENGTH,
        description="Class of requests whose header names no accepted class; unset means the first listed.",
    )
    scheduling: SchedulingSpec = nested(SchedulingSpec, "Queue scheduling policy and its settings.")
    predictor: PredictorSpec = nested(PredictorSpec, "Response-length predictor settings.")
    replicas: ReplicaBounds = nested(ReplicaBounds, "Replica bounds.")
    expected_load: ExpectedLoad | None = Field(
        default=None,
        description="Load to place the service for before any is measured (a new service); measured rates "
        "and output lengths replace it once the workers report them.",
    )
    scale_to_zero: ScaleToZero | None = Field(
        default=None,
        description="Put the service to sleep when idle and wake it on the first request; unset: always on.",
    )

    @field_validator("request_classes")
    @classmethod
    def _unique_class_names(cls, classes: list[AcceptedClass]) -> list[AcceptedClass]:
        names = [c.name for c in classes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"each class may be listed once; duplicated: {duplicates}")
        return classes

    @property
    def default_class_name(self) -> str:
        """The class given to requests that name no accepted class."""
        return self.default_class or self.request_classes[0].name

    def service_classes(self, classes: Mapping[str, RequestClassSpec]) -> dict[str, ServiceClass]:
        """Runtime classes of this service, overrides applied, from the RequestClass specs by name.

        Raises KeyError naming the missing classes when ``classes`` lacks one this service accepts.
        """
        missing = [c.name for c in self.request_classes if c.name not in classes]
        if missing:
            raise KeyError(
                f"RequestClass not found: {missing}; create it or remove it from spec.requestClasses"
            )
        return {
            c.name: classes[c.name].with_overrides(c.overrides).to_service_class(c.name)
            for c in self.request_classes
        }


class PlacementRef(ApiModel):
    """Where the service's replicas run: one placement group of the pool."""

    group: str = Field(description="Placement group name in the pool's status.")
    replicas: int = Field(default=0, ge=0, description="Replicas of the service in that group.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica in that group.")


class ClassAttainment(ApiModel):
    """Measured SLO attainment of one request class over the last measurement window."""

    name: str = Field(description="RequestClass name.")
    attainment: float = Field(ge=0, le=1, description="Fraction of finished requests that met their SLO.")
    requests: int = Field(default=0, ge=0, description="Requests measured.")
    p99_ttft_seconds: float | None = Field(default=None, ge=0, description="99th percentile TTFT in seconds.")
    mean_itl_seconds: float | None = Field(
        default=None, ge=0, description="Mean inter-token latency in seconds."
    )
    mean_qoe: float | None = Field(default=None, ge=0, le=1, description="Mean Andes QoE.")


LoadSource = Literal["measured", "declared", "default"]


class LoadSources(ApiModel):
    """Where each figure of a planned load came from: the workers' metrics (measured), the spec's
    expectedLoad (declared), or the documented default."""

    requests_per_second: LoadSource = Field(description="Source of the request rate.")
    prompt_tokens: LoadSource = Field(description="Source of the mean prompt length.")
    output_tokens: LoadSource = Field(description="Source of the mean output length.")


class PlannedLoad(ApiModel):
    """The load the pool's last placement planned this service for."""

    requests_per_second: float = Field(ge=0, description="Request rate in requests/s.")
    mean_prompt_tokens: float = Field(ge=0, description="Mean prompt length in tokens.")
    mean_output_tokens: float = Field(ge=0, description="Mean output length in tokens.")
    window_seconds: float | None = Field(
        default=None, gt=0, description="Window the measured figures cover, in seconds."
    )
    outstanding_requests: float | None = Field(
        default=None,
        ge=0,
        description="Requests the workers held (queued or running) at the end of the measured window; "
        "they count as arrivals of the window, since its rate is demand, not throughput.",
    )
    sources: LoadSources = Field(description="Where each figure came from.")


class LLMServiceStatus(ResourceStatus):
    """Observed state of an LLMService."""

    placement: list[PlacementRef] = Field(default_factory=list, description="Groups serving this model.")
    replicas: int = Field(default=0, ge=0, description="Replicas placed.")
    ready_replicas: int = Field(default=0, ge=0, description="Replicas ready to serve.")
    endpoint: str | None = Field(
        default=None, description="In-cluster URL of the OpenAI-compatible endpoint."
    )
    policy: str | None = Field(default=None, description="Scheduling policy in effect (auto resolved).")
    state: Literal["Ready", "Sleeping", "Cold", "Waking"] | None = Field(
        default=None,
        description="Scale to zero: Ready (serving), Sleeping (scaled to zero, pods stopping), Cold (no pod: "
        "the router holds its requests and wakes it), Waking (pods starting for held requests).",
    )
    wake_requested_at: datetime | None = Field(
        default=None,
        description="Set by the router when it holds a request for the service while it is scaled to zero: "
        "the operator wakes it (restores its replicas) when this is later than the time it went to sleep.",
    )
    slo_attainment: float | None = Field(
        default=None, ge=0, le=1, description="Measured SLO attainment over all classes (fraction 0-1)."
    )
    slo_attainment_by_class: list[ClassAttainment] = Field(
        default_factory=list,
        description="Measured SLO attainment per request class.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    measured_at: datetime | None = Field(default=None, description="When SLO attainment was last measured.")
    load: PlannedLoad | None = Field(
        default=None, description="The load the last placement planned the service for, and its sources."
    )


class LLMService(Resource):
    """A model served from a ServingPool, with the request classes it accepts and its scheduling policy."""

    kind: Literal["LLMService"] = Field(default="LLMService", description="LLMService.")
    spec: LLMServiceSpec = Field(description="Desired state.")
    status: LLMServiceStatus | None = Field(default=None, description="Observed state (set by the operator).")
