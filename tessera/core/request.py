"""Request state shared by every policy and engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from tessera.core.timeline import TokenTimeline


class Phase(StrEnum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued, never run
    RUNNING = "running"  # in the engine's current batch
    PREEMPTED = "preempted"  # ran before, now out of the batch (KV swapped or dropped)
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class ServiceClass:
    """A request class as the scheduler sees it (derived from the RequestClass custom resource).

    ``ttft_slo_s`` / ``itl_slo_s`` are the interactive SLOs; ``deadline_s`` is the
    completion deadline of batch work, relative to arrival. ``reading_speed_tps`` and
    ``ttft_target_s`` are Andes' QoE parameters (r and T*); ``ttft_target_s`` None
    means Andes' default ``max(P / 5000, 1)`` seconds. ``priority`` (RequestClass ``spec.priority``,
    0-1000, higher first) breaks the ties and decides the overload choices of each policy and never
    overrides the order the policy itself computes; with equal priorities every decision is as
    without it (each policy's module docstring says where it acts).
    """

    name: str = "default"
    kind: Literal["interactive", "batch"] = "interactive"
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    deadline_s: float | None = None
    reading_speed_tps: float = 4.8
    ttft_target_s: float | None = None
    priority: int = 0

    @property
    def slo_at_completion(self) -> bool:
        """Whether ``slo_deadline`` is a completion deadline (a batch class with ``deadline_s``)
        rather than a first-token one."""
        return self.kind == "batch" and self.deadline_s is not None

    def slo_deadline(self, arrival: float) -> float:
        """Absolute time by which the request's SLO wants it served (first token, or completion
        for batch classes); +inf when the class has no SLO."""
        if self.slo_at_completion:
            return arrival + self.deadline_s
        if self.ttft_slo_s is not None:
            return arrival + self.ttft_slo_s
        if self.deadline_s is not None:
            return arrival + self.deadline_s
        return float("inf")


@dataclass(eq=False, slots=True)
class Request:
    """One inference request: static description plus the state engines update.

    ``true_output_tokens`` is the real output length; only the simulator knows it
    (it decides when the request finishes there) and only oracle policies may read
    it. ``max_tokens`` is the client's cap. Identity is by object (``eq=False``), so
    requests can sit in sets and dicts.
    """

    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    model: str = "default"
    service_class: ServiceClass = field(default_factory=ServiceClass)
    true_output_tokens: int | None = None
    prompt_text: str | None = None
    response_text: str | None = None  # simulation: the text the model "generates" (predictor input)
    prefix_blocks: tuple[object, ...] = ()  # ids of the prompt's leading blocks; equal ids, equal prefix
    prefix_block_tokens: int = 0  # tokens per prefix block
    # Absolute SLO deadline of this request itself, on the clock of ``arrival`` (a batch job's expiry,
    # carried per request); None: the class's deadline from arrival.
    deadline: float | None = None
    # Who sent it (the router's API key tenant; "" unknown) and its fair-share weight
    # (``tessera.core.fair_share``).
    tenant: str = ""
    tenant_weight: float = 1.0

    phase: Phase = Phase.WAITING
    generated: int = 0
    kv_resident: bool = False  # KV blocks held on the instance (running, or paused with KV kept)
    swapped: bool = False  # KV lives in host memory (preempted by swap)
    instance: str | None = None
    first_scheduled_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    swaps: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the engine found in its prefix cache (not prefilled)
    tokens: TokenTimeline = field(default_factory=TokenTimeline)
    predicted_remaining: float | None = None  # set by length-aware policies
    annotations: dict[str, object] = field(default_factory=dict)  # policy scratch, never read by engines

    @property
    def target_output_tokens(self) -> int:
        """Tokens this request will produce in simulation: the true length capped by max_tokens."""
        if self.true_output_tokens is None:
            return self.max_tokens
        return min(self.true_output_tokens, self.max_tokens)

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV cache while resident: prompt plus generated."""
        return self.prompt_tokens + self.generated

    @property
    def first_token_at(self) -> float | None:
        """Delivery time of the first output token."""
        return self.tokens.first_time()

    @property
    def finished(self) -> bool:
        """Whether the request has completed."""
        return self.phase is Phase.FINISHED

    @property
    def slo_deadline(self) -> float:
        """Absolute SLO deadline: the request's own ``deadline`` when set, else its class's from arrival."""
        if self.deadline is not None:
            return self.deadline
        return self.service_class.slo_deadline(self.arrival)
