"""ELIS iterative shortest-remaining-time-first (ELIS Alg. 1, §4.1; docs/papers.md, "ELIS: ISRTF scheduler").

Priority = predicted remaining service time, smallest first: the instance time the predicted remaining
output ŷ takes in the decision's step profile (``remaining_service_time``: the prefill of the prompt
and generated tokens unless the request holds its KV, then its share of a full batch's decode
iterations); ties go to the smaller ŷ, then to the higher class priority (``ServiceClass.priority``),
then to the earlier arrival. CHOICE: service time, not ŷ alone as in ELIS, whose prompts are short: on
prompt-heavy traces the prefill is most of a request's cost, and ordering by tokens ran the longest
prompts first and displaced running requests at window boundaries for arrivals whose prefill alone
outlasted their remaining decode (with exact predictions on the Mooncake trace's requests in ``tessera
bench baseline``'s setup at load 1, tail guard at its defaults: mean JCT 202 s by tokens, 38.7 s by
service time, FCFS 50.0 s; docs/bench.md, "The oracle bounds"). With short prompts the two orders
nearly agree (``tessera bench elis``: within 0.3 points of mean-JCT reduction at batch 1, 2 and 4).
Class priority never overrides the order: it decides only between equal keys (and so which of them is
displaced at a window boundary). A request is predicted once on arrival (prompt only,
``Predictor.init``) and again each time it has generated ``window_tokens`` more tokens
(``Predictor.iter``); requests waiting in the queue keep their last prediction. Every prediction due at
a decision is made in one batched ``predict_remaining`` call.

Preemption happens at window boundaries only (ELIS: "a window is never interrupted"): a decision at
which some running request reached its boundary re-ranks running and queued requests together and
the top ``max_batch`` run; any other decision (an arrival, a completion) only fills free slots
(CHOICE, ``join_midwindow``). With batch size 1 this is exactly ELIS' window loop; with larger
batches each request's window counts from its own last prediction (CHOICE: the engine re-checks when
the first running request reaches its boundary, instead of ELIS' batch-synchronous windows).

Tail guard (CHOICE, on by default; ELIS §3.4 mentions starvation control without details): a deferred
credit. A request that has waited longer than ``guard_after_jct_multiple`` times the recent mean JCT
(an exponential average over finished requests, weight ``1/64`` each; no guard before the first
finishes) starts gaining priority credit: its key (seconds of service) drops by ``guard_credit`` · (now
− t), t the moment it crossed that wait: for every token the instance decodes after t at a full batch,
its key drops by ``guard_credit`` tokens' worth of service (the credit of ``guard_credit`` × the decode
rate in tokens/s that the guard was tuned as while keys were tokens, at one token's share of a decode
step). A cost-free profile (no decode time) gives no credit. Requests under the wait keep the plain
order, so only those at risk of the tail move, and both the wait (in mean JCTs) and the pace (a share
of the decode rate) scale with the batch size by themselves, which a credit in tokens per second does
not. The defaults (``DEFAULT_GUARD_CREDIT``, ``DEFAULT_GUARD_AFTER_JCT_MULTIPLE``) are the point of a
sweep over ``tessera bench elis`` (docs/bench.md, "ISRTF's starvation guard") nearest its targets (p99
JCT <= 1.5x FCFS's, >= 80% of the guard-off mean-JCT gain): 1.44/1.51/1.50x keeping 78/78/80% at batch
1/2/4 with token keys (1.44/1.51/1.51x keeping 78/77/78% by service time), where linear aging needed
credits of 4, 8 and 13 tokens/s for about that tail and kept 76/71/75%. No setting met both targets at
every batch size. Guarded keys change with time, so each decision re-keys the guarded queued requests
(O(guarded · log queue); the others keep their fixed keys). ``guard_credit`` 0 turns the guard off.

Linear aging (``aging_tokens_per_s``, off by default): the key drops by ``aging_tokens_per_s`` · age
tokens' worth of service for every request from its arrival (each token at its own share of a full
batch's decode step; + a·arrival: keys stay fixed while a request waits). It reorders the whole queue,
not just the requests at risk. Both 0: the plain ELIS order.

Tail-aware variant ``isrtf-tail`` (``TailISRTF``): the plain ISRTF order (no guard, no aging by default) plus
a wait bound relative to the service's own latency. A request whose age exceeds
``max_wait_jct_multiple`` times the recent mean JCT (an exponential average over finished requests,
weight ``1/64`` each; no bound before the first finishes) is promoted: promoted requests go ahead of
all others, oldest first, until they finish. A request over the bound therefore waits at most one
window of the running requests (promotion displaces them only at their window boundary) plus the
service of the older promoted requests: under overload the tail degrades to FCFS among the starved
instead of growing without bound, while requests under the bound keep the shortest-first order.
(Promoting only the oldest one at a time kept more of the mean-JCT gain at batch 2 and 4 but left
p99 JCT at batch 4 at 1.7x FCFS's for every bound swept: docs/bench.md.)

Predicting off the caller's thread (the worker): ``prepare(view)`` returns the batched prediction of
what the next decision would predict (``predictions_due``) as work for another thread, so the worker's
event loop keeps streaming while the text predictor runs; ``schedule`` then predicts only what is
still due. The simulator just calls ``schedule``. A request's window counts
from the tokens it had when its prediction's input was taken, and finished requests are handed to
the predictor (``observe``/``forget``) at the next prediction, on the predicting thread, so the
predictor is only ever used by one thread at a time.

A predictor that cannot predict some requests (the text predictor without a prompt text, say) never
stops the policy: the batch is retried one request at a time and the requests it still fails get
the running-mean prediction of their class (``fallback_predictions`` counts them).

Displaced requests keep their KV while memory allows (CHOICE, ELIS is silent;
``preempt_mode="keep"``; the engine recompute-evicts under pressure); ``"recompute"`` re-prefills
every displaced request.
"""

from __future__ import annotations

import importlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from tessera.core.policy import Decision, InstanceView, PreemptMode, PriorityPolicy, remaining_service_time
from tessera.core.prediction import ConstantPredictor, LengthPredictor, RunningMeanPredictor
from tessera.core.profile import StepProfile
from tessera.core.registry import PolicySettings
from tessera.core.request import Request

TEXT_PREDICTOR = "tessera.predictor.model:TextLengthPredictor"
PREDICTED_AT = "isrtf_predicted_at"  # annotation: tokens generated when ŷ was last predicted
DEFAULT_GUARD_CREDIT = 0.1  # the tail guard's credit, a share of the decode rate (module docstring)
DEFAULT_GUARD_AFTER_JCT_MULTIPLE = 2.5  # the wait, in recent mean JCTs, after which the credit starts
DEFAULT_MAX_WAIT_JCT_MULTIPLE = 2.5  # isrtf-tail's promotion threshold, in recent mean JCTs
JCT_AVERAGE_WEIGHT = 1 / 64  # weight of each finished request in the recent mean JCT
log = logging.getLogger(__name__)


def _make_predictor(
    spec: LengthPredictor | str,
    checkpoint: str | None = None,
    encoder: str | None = None,
    online: bool = True,
) -> LengthPredictor:
    if not isinstance(spec, str):
        if not isinstance(spec, LengthPredictor):
            raise ValueError(f"predictor must have predict_remaining(requests), got {type(spec).__name__}")
        return spec
    if spec == "text":
        # loaded by name: the text predictor needs torch, which only ISRTF with it configured loads
        module_name, _, name = TEXT_PREDICTOR.partition(":")
        module = importlib.import_module(module_name)
        trained_on = str(module.load_metadata(checkpoint)["encoder"])
        # A head only reads the embeddings of the encoder it was trained on; ids compare by their last
        # part ("sentence-transformers/all-MiniLM-L6-v2" is the shipped head's "all-MiniLM-L6-v2").
        if encoder is not None and encoder.rsplit("/", 1)[-1] != trained_on.rsplit("/", 1)[-1]:
            raise ValueError(
                f"predictorEncoder {encoder!r} is not {trained_on!r}, the encoder the predictor at "
                f"{checkpoint or 'the shipped artifact'} was trained on: name that encoder or train a "
                "predictor on yours (`tessera predictor train`)"
            )
        # online: the text predictor's default learner (kept across reloads); off: None
        return getattr(module, name)(artifact_dir=checkpoint, **({} if online else {"online": None}))
    if spec == "running-mean":
        return RunningMeanPredictor()
    if spec == "constant":
        return ConstantPredictor()
    raise ValueError(f"unknown predictor {spec!r}: use 'text', 'running-mean', 'constant' or an object")


class ISRTFSettings(PolicySettings):
    """Settings of ``isrtf`` (the benches also pass a predictor object to the constructor)."""

    predictor: Literal["text", "running-mean", "constant"] = Field(
        default="text",
        description="Length predictor: text (the trained encoder + head; needs torch), running-mean (per "
        "class) or constant.",
    )
    window_tokens: Annotated[int, Field(ge=1)] = Field(
        default=50, description="Tokens a request generates between re-predictions (ELIS K)."
    )
    guard_credit: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = Field(
        default=DEFAULT_GUARD_CREDIT,
        description="Tail guard: a request waiting past guardAfterJctMultiple recent mean JCTs gains this "
        "share of the instance's decode rate (tokens/s) as priority credit (0 = off; the default keeps the "
        "ELIS bench's p99 JCT near 1.5x FCFS's with about 80% of the plain order's mean-JCT gain).",
    )
    guard_after_jct_multiple: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] = Field(
        default=DEFAULT_GUARD_AFTER_JCT_MULTIPLE,
        description="The wait, in recent mean JCTs, after which a request gains the guard's credit.",
    )
    aging_tokens_per_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=0.0,
        description="Linear aging from arrival: tokens of priority credit per second of age for every "
        "request (0 = off). With guardCredit 0 too: the plain ELIS order.",
    )
    preempt_mode: PreemptMode = Field(
        default="keep",
        description="How displaced requests leave the batch: keep (KV kept while memory allows), recompute "
        "or swap.",
    )
    predictor_checkpoint: str | None = Field(
        default=None,
        min_length=1,
        description="Directory of a trained text predictor (what `tessera predictor train --out DIR` "
        "writes: the head and its metadata); unset: the shipped one. predictor text only.",
    )
    predictor_encoder: str | None = Field(
        default=None,
        min_length=1,
        description="Sentence encoder the text predictor must read (a Hugging Face id); refused when the "
        "checkpoint was trained on another. predictor text only.",
    )

    predictor_online: bool = Field(
        default=True,
        description="The text predictor learns online from this worker's finished requests (a correction "
        "of the trained head refitted in the background; tessera.predictor.online). predictor text only.",
    )

    @field_validator("predictor_checkpoint", "predictor_encoder", "predictor_online")
    @classmethod
    def _text_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        predictor = info.data.get("predictor")
        if value not in (None, True) and predictor is not None and predictor != "text":
            raise ValueError(f"applies to predictor 'text' only, not {predictor!r}")
        return value


class ISRTF(PriorityPolicy):
    """Shortest predicted remaining output first, re-predicted every ``window_tokens`` tokens."""

    name: ClassVar[str] = "isrtf"
    preemptive: bool = True  # per decision: True only at a window boundary (see schedule)

    def __init__(
        self,
        predictor: LengthPredictor | str = "text",
        window_tokens: int = 50,
        aging_tokens_per_s: float = 0.0,
        preempt_mode: PreemptMode = "keep",
        predictor_checkpoint: str | None = None,
        predictor_encoder: str | None = None,
        guard_credit: float = DEFAULT_GUARD_CREDIT,
        guard_after_jct_multiple: float = DEFAULT_GUARD_AFTER_JCT_MULTIPLE,
        predictor_online: bool = True,
    ) -> None:
        super().__init__()
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if aging_tokens_per_s < 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0 (0 = off), got {aging_tokens_per_s}")
        if not guard_credit >= 0:
            raise ValueError(f"guard_credit must be >= 0 (0 = off), got {guard_credit}")
        if not guard_after_jct_multiple > 0:
            raise ValueError(f"guard_after_jct_multiple must be > 0, got {guard_after_jct_multiple}")
        if preempt_mode not in ("recompute", "swap", "keep"):
            raise ValueError(f"preempt_mode must be recompute, swap or keep, got {preempt_mode!r}")
        self.predictor = _make_predictor(predictor, predictor_checkpoint, predictor_encoder, predictor_online)
        self.preempt_mode: PreemptMode = preempt_mode
        self.window = window_tokens
        self.aging = aging_tokens_per_s
        self.guard_credit = guard_credit
        self.guard_after = guard_after_jct_multiple
        self.mean_jct: float | None = None  # recent mean JCT of finished requests (seconds)
        self._unguarded = _WaitWatch()  # queued once, not yet past the guard's wait
        self._guarded: dict[int, float] = {}  # id(req) -> when it crossed the guard's wait
        self._credit_rate = 0.0  # the guard's credit this decision: seconds of service per second waited
        self._profile: StepProfile | None = None  # the latest decision's, for the keys
        self._batch = 1
        self._pending: dict[int, Request] = {}  # arrived, not yet pushed (predicted at the next decision)
        self._finished: deque[Request] = deque()  # removed, not yet handed to the predictor
        self._rerank = False  # a request was re-predicted at its window boundary since the last decision
        self._next_check: int | None = None
        self.prediction_calls = 0  # batched predict_remaining calls so far
        self.predictions = 0  # requests predicted so far
        # Stands in for requests the predictor fails on; learns from every finished request.
        self.fallback = (
            self.predictor if isinstance(self.predictor, RunningMeanPredictor) else RunningMeanPredictor()
        )
        self.fallback_predictions = 0  # requests predicted by the fallback so far

    def key(self, req: Request, now: float) -> tuple:
        """Predicted remaining service time (minus the aging and guard credits), then predicted remaining
        tokens, then higher class priority, then arrival."""
        assert req.predicted_remaining is not None, "ISRTF keys only predicted requests"
        assert self._profile is not None, "ISRTF keys at decisions"
        predicted, prof, batch = req.predicted_remaining, self._profile, self._batch
        ranked = remaining_service_time(req, predicted, prof, batch)
        if self.aging:
            token = prof.service_time(req.prompt_tokens + req.generated, 1, batch, prefill=False)
            ranked += self.aging * req.arrival * token
        crossed = self._guarded.get(id(req))
        if crossed is not None:
            ranked -= self._credit_rate * (now - crossed)
        return (ranked, predicted, -req.service_class.priority, req.arrival)

    def add(self, req: Request, now: float) -> None:
        """Hold a new request until the next decision predicts it (batched with others)."""
        self._pending[id(req)] = req

    def remove(self, req: Request, now: float) -> None:
        """Forget a request; finished lengths feed predictors that learn from them, finished JCTs the
        recent mean JCT."""
        self._pending.pop(id(req), None)
        self._guarded.pop(id(req), None)
        if req.finished:
            jct = now - req.arrival
            self.mean_jct = (
                jct if self.mean_jct is None else self.mean_jct + JCT_AVERAGE_WEIGHT * (jct - self.mean_jct)
            )
        super().remove(req, now)
        self._finished.append(req)  # deque append/popleft are thread-safe: a prediction may be running

    def _hand_over_finished(self) -> None:
        forget = getattr(self.predictor, "forget", None)
        while self._finished:
            req = self._finished.popleft()
            if req.finished:
                self.fallback.observe(req)
            if forget is not None:
                forget(req)

    def __len__(self) -> int:
        return super().__len__() + len(self._pending)

    def _due(self, running: list[Request]) -> list[Request]:
        return [r for r in running if r.generated - int(r.annotations.get(PREDICTED_AT, 0)) >= self.window]

    def predictions_due(self, running: Sequence[Request]) -> list[Request]:
        """Requests the next decision would predict: new arrivals not predicted yet, and running
        requests at their window boundary."""
        new = [r for r in self._pending.values() if PREDICTED_AT not in r.annotations]
        return new + self._due(list(running))

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """The due predictions as work for another thread (Policy protocol item 6)."""
        due = self.predictions_due(view.running)
        return (lambda: self.predict(due)) if due else None

    def predict(self, reqs: Sequence[Request]) -> None:
        """Predict ``reqs`` in one batched call (safe on another thread than the decisions')."""
        self._hand_over_finished()
        if not reqs:
            return
        at = [r.generated for r in reqs]  # the predictor's input: tokens streamed so far
        try:
            preds = self._predict_batch(list(reqs))
        except Exception:
            preds = [self._predict_one(r) for r in reqs]
        self.prediction_calls += 1
        self.predictions += len(reqs)
        self._rerank |= any(PREDICTED_AT in r.annotations for r in reqs)
        for req, pred, generated in zip(reqs, preds, at, strict=True):
            req.predicted_remaining = max(0.0, float(pred))
            req.annotations[PREDICTED_AT] = generated

    def _predict_batch(self, reqs: list[Request]) -> list[float]:
        preds = self.predictor.predict_remaining(reqs)
        if len(preds) != len(reqs):
            raise ValueError(f"predictor returned {len(preds)} predictions for {len(reqs)} requests")
        return [float(p) for p in preds]

    def _predict_one(self, req: Request) -> float:
        try:
            return self._predict_batch([req])[0]
        except Exception as exc:
            if self.fallback_predictions == 0:  # once: the cause is usually the same for every request
                log.warning("length predictor failed on request %s (%s); using the class's running "
                            "mean for such requests", req.id, exc)  # fmt: skip
            self.fallback_predictions += 1
            return self.fallback.predict_remaining([req])[0]

    def schedule(self, view: InstanceView) -> Decision:
        """Predict what is due in one batch; re-rank everything at a window boundary, else fill free slots."""
        self.predict(self.predictions_due(view.running))
        self._profile, self._batch = view.profile, view.max_batch
        if self.guard_credit > 0:  # seconds of service per second: a cost-free profile sets no pace
            self._credit_rate = self.guard_credit if view.profile.decode_step(view.max_batch, 0) > 0 else 0.0
        self._queue_pending(view.now)
        # The instance attribute shadows the class default for this decision only: the base class
        # re-ranks running requests against the queue when preemptive, else only fills free slots.
        self.preemptive, self._rerank = self._rerank, False
        decision = super().schedule(view)
        self._next_check = min(
            (self.window - (r.generated - int(r.annotations.get(PREDICTED_AT, 0))) for r in decision.run),
            default=None,
        )
        decision.recheck_after_tokens = self.recheck_tokens()
        decision.preempt_mode = self.preempt_mode
        return decision

    def _queue_pending(self, now: float) -> None:
        """Move the requests predicted since the last decision into the priority queue; start the
        guard's credit of those past its wait, and re-key the guarded ones still queued."""
        new = list(self._pending.values())
        self._pending.clear()
        for req in new:
            self._push(req, now)
        if self.guard_credit <= 0:
            return
        self._unguarded.extend(new)
        if self.mean_jct is not None:
            wait = self.guard_after * self.mean_jct
            for req in self._unguarded.over(now, wait, self._live):
                self._guarded[id(req)] = req.arrival + wait
        for rid in self._guarded:
            entry = self._queued.get(rid)
            if entry is not None:  # a running one is re-keyed by every decision
                self._push(entry.req, now)
        if self._heap_entries() > 2 * len(self._queued) + 64:  # drop the entries re-keying left behind
            self._rebuild_heaps()

    def _live(self, req: Request) -> bool:
        return id(req) in self._queued or id(req) in self._running

    def recheck_tokens(self) -> int | None:
        """Decode iterations until the first running request reaches its window boundary."""
        return None if self._next_check is None else max(1, self._next_check)


class TailISRTFSettings(ISRTFSettings):
    """Settings of ``isrtf-tail``: ISRTF's (its tail guard off by default), plus the wait that promotes
    a request."""

    guard_credit: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = Field(
        default=0.0,
        description="As isrtf's, off by default (the wait bound guards).",
    )
    max_wait_jct_multiple: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        default=DEFAULT_MAX_WAIT_JCT_MULTIPLE,
        description="A request older than this many recent mean JCTs goes ahead of all unpromoted ones "
        "(oldest first): bounds the wait of long requests.",
    )


class TailISRTF(ISRTF):
    """ISRTF with a wait bound: requests older than a multiple of the recent mean JCT go first."""

    name: ClassVar[str] = "isrtf-tail"

    def __init__(
        self,
        predictor: LengthPredictor | str = "text",
        window_tokens: int = 50,
        aging_tokens_per_s: float = 0.0,
        preempt_mode: PreemptMode = "keep",
        predictor_checkpoint: str | None = None,
        predictor_encoder: str | None = None,
        max_wait_jct_multiple: float = DEFAULT_MAX_WAIT_JCT_MULTIPLE,
        guard_credit: float = 0.0,
        guard_after_jct_multiple: float = DEFAULT_GUARD_AFTER_JCT_MULTIPLE,
        predictor_online: bool = True,
    ) -> None:
        super().__init__(
            predictor,
            window_tokens,
            aging_tokens_per_s,
            preempt_mode,
            predictor_checkpoint,
            predictor_encoder,
            guard_credit,
            guard_after_jct_multiple,
            predictor_online,
        )
        if not max_wait_jct_multiple > 0:
            raise ValueError(f"max_wait_jct_multiple must be > 0, got {max_wait_jct_multiple}")
        self.max_wait_multiple = max_wait_jct_multiple
        self._unpromoted = _WaitWatch()  # queued once, not yet promoted
        self._promoted: set[int] = set()

    def key(self, req: Request, now: float) -> tuple:
        """Promoted requests first, by arrival; the others by ISRTF's key."""
        if id(req) in self._promoted:
            return (0, req.arrival, -req.service_class.priority, req.arrival)
        return (1, *super().key(req, now))

    def remove(self, req: Request, now: float) -> None:
        """Forget a request (its promotion too)."""
        self._promoted.discard(id(req))
        super().remove(req, now)

    def _queue_pending(self, now: float) -> None:
        new = list(self._pending.values())
        super()._queue_pending(now)
        self._unpromoted.extend(new)
        if self.mean_jct is None:
            return
        for req in self._unpromoted.over(now, self.max_wait_multiple * self.mean_jct, self._live):
            self._promoted.add(id(req))
            if id(req) in self._queued:  # re-keyed in the heap; a running one is re-keyed at each decision
                self._push(req, now)


class _WaitWatch:
    """Requests in arrival order, handed out once each when their wait passes a limit."""

    def __init__(self) -> None:
        self._by_arrival: deque[Request] = deque()

    def extend(self, reqs: Sequence[Request]) -> None:
        """Watch ``reqs`` (sorted here: those queued by one decision may come in any order)."""
        self._by_arrival.extend(sorted(reqs, key=lambda r: r.arrival))

    def over(self, now: float, limit: float, live: Callable[[Request], bool]) -> list[Request]:
        """The live watched requests that have waited longer than ``limit``, oldest first; they leave
        the watch. The scan stops at the first younger one (the deque is in arrival order)."""
        out = []
        while self._by_arrival and now - self._by_arrival[0].arrival > limit:
            req = self._by_arrival.popleft()
            if live(req):  # else finished or removed
                out.append(req)
        return out
