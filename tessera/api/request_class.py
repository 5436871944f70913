"""RequestClass: the SLOs, QoE parameters, priority and queue bounds of one class of requests."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tessera.api.base import ApiModel, Resource, ResourceStatus, Seconds, nested
from tessera.api.rules import RequiredWhen
from tessera.core.request import ServiceClass

# Andes' measured average reading speed (tokens/s) of human readers.
DEFAULT_READING_SPEED_TPS = 4.8
DEFAULT_CLASS_HEADER = "X-Tessera-Class"
# RFC 9110 token characters: what an HTTP header name may contain.
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"


class SLO(ApiModel):
    """Latency objectives of a class; a request meets its SLO when it meets every objective that is set."""

    ttft_seconds: Seconds | None = Field(
        default=None, description="Time to first token objective in seconds (interactive classes)."
    )
    itl_seconds: Seconds | None = Field(
        default=None, description="Mean inter-token latency objective in seconds (interactive classes)."
    )
    deadline_seconds: Seconds | None = Field(
        default=None,
        description="Completion deadline in seconds after arrival (required for batch classes).",
    )


class QoE(ApiModel):
    """Andes' token-level quality-of-experience parameters: how fast the reader consumes tokens."""

    reading_speed_tokens_per_second: Annotated[float, Field(gt=0)] = Field(
        default=DEFAULT_READING_SPEED_TPS,
        description="Reading speed r of the user in tokens/s (Andes default 4.8).",
    )
    ttft_target_seconds: Seconds | None = Field(
        default=None,
        description="Expected time to first token T* in seconds; unset means max(prompt tokens / 5000, 1).",
    )


class QueueBounds(ApiModel):
    """Admission bounds of the class's queue on each worker; requests beyond them are rejected (HTTP 429)."""

    max_queued: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="Most requests of this class waiting on one worker, split between the tenants "
        "waiting by weight (a tenant alone may hold all); unset means unbounded.",
    )
    max_queue_time_seconds: Seconds | None = Field(
        default=None,
        description="Longest a request may wait before its first token is scheduled; unset means unbounded.",
    )


class Match(ApiModel):
    """How a client picks this class: an HTTP header carrying a value."""

    header: str = Field(
        default=DEFAULT_CLASS_HEADER,
        pattern=HEADER_NAME_PATTERN,
        description="HTTP header that names the class (case-insensitive).",
    )
    value: str | None = Field(
        default=None, min_length=1, description="Header value that selects this class; unset means the name."
    )


class QoEOverride(ApiModel):
    """QoE fields to override; unlike QoE it has no defaults, so unset fields keep the class's value."""

    reading_speed_tokens_per_second: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="Reading speed r in tokens/s to use instead of the class's."
    )
    ttft_target_seconds: Seconds | None = Field(
        default=None, description="TTFT target T* in seconds to use instead of the class's."
    )


class ClassOverrides(ApiModel):
    """Per-service overrides of a RequestClass: only the fields set here replace the class's values."""

    slo: SLO | None = Field(
        default=None, description="Objectives to use instead of the class's (field by field)."
    )
    qoe: QoEOverride | None = Field(default=None, description="QoE parameters to use instead of the class's.")
    priority: Annotated[int, Field(ge=0, le=1000)] | None = Field(
        default=None, description="Priority to use instead of the class's."
    )
    queue: QueueBounds | None = Field(default=None, description="Queue bounds to use instead of the class's.")


class RequestClassSpec(ApiModel):
    """Desired state of a RequestClass."""

    RULES = (
        RequiredWhen(field="slo.deadlineSeconds", when="kind", value="batch"),
        RequiredWhen(field="slo.ttftSeconds", when="kind", value="interactive"),
    )

    kind: Literal["interactive", "batch"] = Field(
        default="interactive",
        description="interactive: a person reads the stream (TTFT/ITL SLOs); batch: judged by its deadline.",
    )
    slo: SLO = nested(SLO, "Latency objectives of the class.")
    qoe: QoE = nested(QoE, "Andes QoE parameters (reading speed and TTFT target).")
    priority: int = Field(
        default=0,
        ge=0,
        le=1000,
        description="Relative importance, higher first, when SLOs cannot all be met.",
    )
    queue: QueueBounds = nested(QueueBounds, "Queue bounds per worker.")
    match: Match = nested(Match, "How requests are matched to this class.")

    def with_overrides(self, overrides: ClassOverrides | None) -> RequestClassSpec:
        """This spec with the fields set in ``overrides`` replaced (nested objects field by field)."""
        if overrides is None:
            return self
        merged = self.to_json()
        for key, value in overrides.to_json().items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
        return RequestClassSpec.model_validate(merged)

    def header_value(self, name: str) -> str:
        """The header value that selects this class, given the RequestClass's name."""
        return self.match.value or name

    def to_service_class(self, name: str) -> ServiceClass:
        """The scheduler's runtime view of this class."""
        return ServiceClass(
            name=name,
            kind=self.kind,
            ttft_slo_s=self.slo.ttft_seconds,
            itl_slo_s=self.slo.itl_seconds,
            deadline_s=self.slo.deadline_seconds,
            reading_speed_tps=self.qoe.reading_speed_tokens_per_second,
            ttft_target_s=self.qoe.ttft_target_seconds,
            priority=self.priority,
        )


class RequestClassStatus(ResourceStatus):
    """Observed state of a RequestClass."""

    used_by: list[str] = Field(
        default_factory=list, description="LLMServices in this namespace that accept it."
    )


class RequestClass(Resource):
    """A class of requests (interactive or batch) with its SLOs, QoE parameters, priority and queue bounds."""

    kind: Literal["RequestClass"] = Field(default="RequestClass", description="RequestClass.")
    spec: RequestClassSpec = Field(description="Desired state.")
    status: RequestClassStatus | None = Field(
        default=None, description="Observed state (set by the operator)."
    )
