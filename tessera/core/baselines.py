"""Baseline policies and oracle bounds.

- ``fcfs``: vLLM's default. Arrival order, non-preemptive; under KV pressure the
  engine preempts the latest arrival (the last of ``run``).
- ``edf``: earliest SLO deadline first (TTFT deadline for interactive classes,
  completion deadline for batch), non-preemptive.
- ``priority``: a class-priority queue, non-preemptive: interactive requests ahead of batch ones,
  arrival order within a kind. ``batch_delay_s`` tunes it: a batch request queues as if it had
  arrived that many seconds later (unset: interactive always first; 0: FCFS).
- ``sjf-oracle``: shortest true output length first, non-preemptive (simulation only).
- ``srtf-oracle``: shortest true remaining output first, preemptive at every
  decision point (simulation only). ``recheck_tokens`` bounds how long a running
  request may hold its slot between events (CHOICE: 50 tokens, ELIS' window).
  ``preempt_mode`` (CHOICE: ``keep``) is how its own preemptions leave the batch:
  as a bound it pauses requests with their KV kept instead of paying a recompute;
  the engine drops paused KV first when memory runs short.

Class priority (``ServiceClass.priority``, higher first) breaks ties of each policy's own order and
never overrides it: a key is (the policy's quantity, -priority, arrival). FCFS: among equal arrival
times the higher class runs first and, under KV pressure, the lower one is preempted first; EDF:
among equal deadlines; the oracles: among equal true (remaining) lengths, before arrival.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from tessera.core.policy import Decision, InstanceView, PreemptMode, PriorityPolicy
from tessera.core.registry import PolicySettings
from tessera.core.request import Request


class FCFS(PriorityPolicy):
    """First come, first served (vLLM default)."""

    name: ClassVar[str] = "fcfs"
    static_keys: ClassVar[bool] = True

    def key(self, req: Request, now: float) -> tuple:
        """Arrival time, then the higher class priority."""
        return (req.arrival, -req.service_class.priority)


class EDF(PriorityPolicy):
    """Earliest SLO deadline first."""

    name: ClassVar[str] = "edf"
    static_keys: ClassVar[bool] = True

    def key(self, req: Request, now: float) -> tuple:
        """Absolute SLO deadline, then the higher class priority, then arrival."""
        return (req.slo_deadline, -req.service_class.priority, req.arrival)


class PrioritySettings(PolicySettings):
    """Settings of ``priority``."""

    batch_delay_s: Annotated[float, Field(ge=0)] | None = Field(
        default=None,
        description="Seconds a batch request queues as if it had arrived later; unset: interactive first.",
    )


class ClassPriority(PriorityPolicy):
    """Interactive before batch (or batch set back by ``batch_delay_s``), arrival order within a kind."""

    name: ClassVar[str] = "priority"
    static_keys: ClassVar[bool] = True

    def __init__(self, batch_delay_s: float | None = None) -> None:
        super().__init__()
        if batch_delay_s is not None and batch_delay_s < 0:
            raise ValueError(f"batch_delay_s must be >= 0 seconds, got {batch_delay_s}")
        self._delay = batch_delay_s

    def key(self, req: Request, now: float) -> tuple:
        """(kind rank, arrival) with the strict order, else the batch-delayed arrival; then the higher
        class priority, then arrival."""
        batch = req.service_class.kind == "batch"
        if self._delay is None:
            return (int(batch), req.arrival, -req.service_class.priority)
        return (req.arrival + (self._delay if batch else 0.0), -req.service_class.priority, req.arrival)


def _true_length(req: Request) -> int:
    if req.true_output_tokens is None:
        raise ValueError(f"oracle policy needs the true output length of request {req.id}")
    return req.target_output_tokens


class SJFOracle(PriorityPolicy):
    """Shortest job first on the true output length (bound; simulation only)."""

    name: ClassVar[str] = "sjf-oracle"
    static_keys: ClassVar[bool] = True
    oracle: ClassVar[bool] = True

    def key(self, req: Request, now: float) -> tuple:
        """True total output length, then the higher class priority, then arrival."""
        return (_true_length(req), -req.service_class.priority, req.arrival)


class SRTFOracleSettings(PolicySettings):
    """Settings of ``srtf-oracle``."""

    recheck_tokens: Annotated[int, Field(ge=1)] = Field(
        default=50, description="Decode iterations a running request may keep its slot between re-rankings."
    )
    preempt_mode: PreemptMode = Field(
        default="keep",
        description="How displaced requests leave the batch: keep (KV kept), recompute or swap.",
    )


class SRTFOracle(PriorityPolicy):
    """Shortest remaining time first on the true remaining output (bound; simulation only)."""

    name: ClassVar[str] = "srtf-oracle"
    oracle: ClassVar[bool] = True
    preemptive: ClassVar[bool] = True

    def __init__(self, recheck_tokens: int = 50, preempt_mode: PreemptMode = "keep") -> None:
        super().__init__()
        if recheck_tokens < 1:
            raise ValueError("recheck_tokens must be >= 1")
        if preempt_mode not in ("recompute", "swap", "keep"):
            raise ValueError(f"preempt_mode must be recompute, swap or keep, got {preempt_mode!r}")
        self._recheck = recheck_tokens
        self._mode: PreemptMode = preempt_mode

    def schedule(self, view: InstanceView) -> Decision:
        """Re-rank everything; preempted requests leave with ``preempt_mode``."""
        decision = super().schedule(view)
        decision.preempt_mode = self._mode
        return decision

    def key(self, req: Request, now: float) -> tuple:
        """True remaining output tokens, then the higher class priority, then arrival."""
        return (_true_length(req) - req.generated, -req.service_class.priority, req.arrival)

    def recheck_tokens(self) -> int | None:
        """Re-rank every ``recheck_tokens`` decode iterations."""
        return self._recheck
