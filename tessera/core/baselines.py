"""Baseline policies and oracle bounds.

- ``fcfs``: vLLM's default. Arrival order, non-preemptive; under KV pressure the
  engine preempts the latest arrival (the last of ``run``).
- ``edf``: earliest SLO deadline first (TTFT deadline for interactive classes,
  completion deadline for batch), non-preemptive. ``late_last`` (CHOICE, off by default: plain EDF)
  puts the requests already past their deadline behind every request still on time, so that under
  overload one late request does not make the next ones late too.
- ``priority``: a class-priority queue, non-preemptive: interactive requests ahead of batch ones,
  arrival order within a kind. ``batch_delay_s`` tunes it: a batch request queues as if it had
  arrived that many seconds later (unset: interactive always first; 0: FCFS).
- ``sjf-oracle``: shortest true service time first, non-preemptive (simulation only).
- ``srtf-oracle``: shortest true remaining service time first, preemptive at every
  decision point (simulation only). ``recheck_tokens`` bounds how long a running
  request may hold its slot between events (CHOICE: 50 tokens, ELIS' window).
  ``preempt_mode`` (CHOICE: ``keep``) is how its own preemptions leave the batch:
  as a bound it pauses requests with their KV kept instead of paying a recompute;
  the engine drops paused KV first when memory runs short.

CHOICE: an oracle's job size is the instance time the request's (remaining) work takes in the
decision's step profile (``StepProfile.service_time``): the prefill of its prompt and generated
tokens unless it holds its KV (a swapped one reads its KV back instead), then its share of a full
batch's decode iterations (``max_batch`` from the view) for its true remaining output. Not the output
length alone: on prompt-heavy traces the prefill is most of a request's cost (Mooncake: 12k prompt
tokens on average against 190 output tokens, negatively correlated), and ordering by output ran the
longest prompts first and let SRTF displace running requests for arrivals whose prefill alone outlasted
the displaced requests' remaining decode, whose KV the engine then dropped and recomputed.
Not the isolated time (batch 1, ``exec_time``) either: that charges each token a whole iteration's
fixed cost, which a full batch shares. A request is keyed at the first decision after it arrives
(the view brings the profile). Keys of queued requests stay fixed: one whose KV the engine drops
while it waits keeps the smaller key it had with the KV (seen once in the baseline bench's 8 SRTF runs
on the Mooncake and Azure code traces).

Class priority (``ServiceClass.priority``, higher first) breaks ties of each policy's own order and
never overrides it: a key is (the policy's quantity, -priority, arrival). FCFS: among equal arrival
times the higher class runs first and, under KV pressure, the lower one is preempted first; EDF:
among equal deadlines; the oracles: among equal true (remaining) service times and then output
lengths, before arrival.
"""

from __future__ import annotations

import heapq
from typing import Annotated, ClassVar

from pydantic import Field

from tessera.core.policy import Decision, InstanceView, PreemptMode, PriorityPolicy, remaining_service_time
from tessera.core.profile import StepProfile
from tessera.core.registry import PolicySettings
from tessera.core.request import Request


class FCFS(PriorityPolicy):
    """First come, first served (vLLM default)."""

    name: ClassVar[str] = "fcfs"
    static_keys: ClassVar[bool] = True

    def key(self, req: Request, now: float) -> tuple:
        """Arrival time, then the higher class priority."""
        return (req.arrival, -req.service_class.priority)


class EDFSettings(PolicySettings):
    """Settings of ``edf``."""

    late_last: bool = Field(
        default=False,
        description="A request past its SLO deadline waits behind every request still on time: it has "
        "missed already, and serving it first makes the next ones miss too (overload).",
    )


class EDF(PriorityPolicy):
    """Earliest SLO deadline first; with ``late_last``, the requests already past their deadline last."""

    name: ClassVar[str] = "edf"
    static_keys: bool = True  # per instance: late_last keys change once, when a deadline passes

    def __init__(self, late_last: bool = False) -> None:
        super().__init__()
        self.late_last = late_last
        self.static_keys = not late_last
        self._on_time: list[tuple[float, int, Request]] = []  # queued on time, by deadline (lazy)

    def key(self, req: Request, now: float) -> tuple:
        """(With ``late_last``: whether the deadline has passed, then) the absolute SLO deadline, then the
        higher class priority, then arrival."""
        if self.late_last:
            return (req.slo_deadline < now, req.slo_deadline, -req.service_class.priority, req.arrival)
        return (req.slo_deadline, -req.service_class.priority, req.arrival)

    def _push(self, req: Request, now: float) -> None:
        super()._push(req, now)
        if self.late_last and req.slo_deadline >= now:
            heapq.heappush(self._on_time, (req.slo_deadline, next(self._seq), req))

    def schedule(self, view: InstanceView) -> Decision:
        """Re-key the queued requests whose deadline passed since the last decision, then EDF."""
        while self._on_time and self._on_time[0][0] < view.now:
            _, _, req = heapq.heappop(self._on_time)
            entry = self._queued.get(id(req))
            if entry is not None and entry.key[0] is False:  # still queued with its on-time key
                self._push(req, view.now)
        if len(self._on_time) > 2 * len(self._queued) + 64:  # requests that left the queue: drop them
            self._on_time = [e for e in self._on_time if id(e[2]) in self._queued]
            heapq.heapify(self._on_time)
        return super().schedule(view)


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


class _ServiceTimeOracle(PriorityPolicy):
    """An oracle keyed by true service time in the instance's step profile (module docstring).

    The profile and the batch size come with the decision's view, so a request that arrives is
    keyed at the next decision, as ISRTF predicts its arrivals there."""

    oracle: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._arrived: dict[int, Request] = {}  # added, keyed at the next decision
        self._profile: StepProfile | None = None
        self._batch = 1

    def add(self, req: Request, now: float) -> None:
        """Hold a new request until the next decision keys it (its view carries the profile)."""
        _true_length(req)  # refuse a request without its true length now, not at the decision
        self._arrived[id(req)] = req

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._arrived.pop(id(req), None)
        super().remove(req, now)

    def __len__(self) -> int:
        return super().__len__() + len(self._arrived)

    def schedule(self, view: InstanceView) -> Decision:
        """Key the arrivals with this view's profile and batch size, then decide."""
        self._profile, self._batch = view.profile, view.max_batch
        for req in self._arrived.values():
            self._push(req, view.now)
        self._arrived.clear()
        return super().schedule(view)

    def service_left(self, req: Request) -> float:
        """Instance seconds the rest of ``req`` takes (``remaining_service_time`` of its true remaining
        output)."""
        assert self._profile is not None, "keyed before the first decision"
        return remaining_service_time(req, _true_length(req) - req.generated, self._profile, self._batch)


class SJFOracle(_ServiceTimeOracle):
    """Shortest job first on the true service time (bound; simulation only)."""

    name: ClassVar[str] = "sjf-oracle"
    static_keys: ClassVar[bool] = True

    def key(self, req: Request, now: float) -> tuple:
        """True service time, then true output length, then the higher class priority, then arrival."""
        return (self.service_left(req), _true_length(req), -req.service_class.priority, req.arrival)


class SRTFOracleSettings(PolicySettings):
    """Settings of ``srtf-oracle``."""

    recheck_tokens: Annotated[int, Field(ge=1)] = Field(
        default=50, description="Decode iterations a running request may keep its slot between re-rankings."
    )
    preempt_mode: PreemptMode = Field(
        default="keep",
        description="How displaced requests leave the batch: keep (KV kept), recompute or swap.",
    )


class SRTFOracle(_ServiceTimeOracle):
    """Shortest remaining time first on the true remaining service time (bound; simulation only)."""

    name: ClassVar[str] = "srtf-oracle"
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
        """True remaining service time, then true remaining output, then the higher class priority, then
        arrival."""
        left = _true_length(req) - req.generated
        return (self.service_left(req), left, -req.service_class.priority, req.arrival)

    def recheck_tokens(self) -> int | None:
        """Re-rank every ``recheck_tokens`` decode iterations."""
        return self._recheck
