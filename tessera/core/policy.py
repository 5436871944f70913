"""The policy interface every scheduler implements and every engine drives.

Protocol (the same for the simulator and the worker; both shells call every hook):

1. The engine calls ``policy.add(req, now)`` when a request reaches the instance
   and ``policy.remove(req, now)`` when it finishes or is cancelled (``req.phase`` tells
   which: ``FINISHED`` after a completion). Between those the policy owns the request's
   place in its queue.
2. At every decision point — an arrival, a completion, an engine-side preemption,
   or a re-check the policy asked for — the engine builds an ``InstanceView`` and calls
   ``policy.observe(view)`` then ``policy.schedule(view)`` with it. ``observe`` is the
   engine's feedback (what vLLM's ``SchedulerInterface.update_from_output`` carries): the
   running requests' ``generated`` and token times and the engine's ``iteration`` have
   moved since the previous decision point; a policy that learns from progress (rates,
   throughput) takes it in there. The default does nothing.
3. The policy answers with a ``Decision``: ``run`` is the set of requests that
   should be in the batch from now on, highest priority first. The engine keeps
   running requests that are in ``run``, preempts running requests that are not,
   and admits the others in order while the batch limit and KV capacity allow,
   stopping at the first that does not fit (vLLM's head-of-line admission).
4. When KV runs out mid-decode, the engine preempts the running request that
   came last in the latest ``run`` (for FCFS: the latest arrival, as vLLM does)
   and asks the policy again.
5. Requests paused with ``preempt_mode="keep"`` hold their KV; when memory runs
   short (admission or decode) the engine drops that KV first (they resume by
   recompute).
6. ``prepare(view)`` returns work to run ahead of the next decision, or None (the default).
   It exists for policies with expensive work (ISRTF's predictor, QLM's MILP): the worker
   calls it before each decision and runs the callable on a thread, so its event loop keeps
   streaming; the callable may only touch the policy's own state and numbers taken in
   ``prepare``. ``schedule`` must still do whatever work is due itself, so a shell may skip
   ``prepare``: the simulator, with no stream to keep flowing, does, and its decisions do
   that work inline.

Instances of several models (``tessera.core.sharing``): in ``swapping`` mode the view is that of the
awake model (``active_model``; ``models`` is empty) and ``Decision.load_model`` swaps. In ``co-resident``
mode every model's engine is resident: ``active_model`` is None, ``models`` holds each engine's own
view (its KV share, its running requests, its own sequence limit) and the top-level KV fields are
their sums. ``run`` may then hold requests of several models: each shell admits a request on its
model's engine while the instance's ``max_batch``, that engine's ``max_running`` and its KV allow,
head-of-line per engine (an engine stops at its first request that does not fit; the others go on).

``InstanceView`` is filled the same way by both shells (``kv_blocks`` and
``resident_kv_tokens`` are the KV accounting both use; ``tests/test_conformance.py``
checks the two views field by field). Policies never mutate requests' engine state
(phase, generated, KV flags); they may write ``predicted_remaining`` and ``annotations``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal

from tessera.core.lora import admits, batch_adapters
from tessera.core.profile import StepProfile
from tessera.core.request import Phase, Request

PreemptMode = Literal["recompute", "swap", "keep"]


@dataclass(frozen=True, slots=True)
class ModelView:
    """One engine of a co-resident instance, as a policy sees it (module docstring)."""

    model: str
    profile: StepProfile  # the model's step times and its own KV capacity and block size
    kv_capacity_tokens: int  # the engine's KV share, whole blocks
    kv_used_tokens: int  # held by its resident requests
    running: int  # its requests in the batch now
    max_running: int | None = None  # the engine's own limit (vLLM's --max-num-seqs); None: max_batch only

    @property
    def kv_free_tokens(self) -> int:
        """KV tokens of this engine not held by resident requests."""
        return self.kv_capacity_tokens - self.kv_used_tokens


NO_MODELS: Mapping[str, ModelView] = MappingProxyType({})
NO_ADAPTERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What a policy may see of one engine instance at a decision point (read-only).

    Every field is filled by both shells; where an engine cannot know a value exactly the
    worker uses the estimate the simulator computes (``resident_kv_tokens``)."""

    now: float
    instance: str
    running: Sequence[Request]  # in the batch now, in admission order
    max_batch: int  # the engine's batch-size limit (Chiron's local autoscaler moves it)
    kv_capacity_tokens: int  # whole KV blocks only (``kv_capacity_whole_blocks``)
    kv_used_tokens: int  # KV blocks held by resident requests, in tokens (``resident_kv_tokens``)
    profile: StepProfile
    active_model: str | None = None  # model whose weights are loaded (None: any / single-model)
    iteration: int = 0  # engine iterations so far
    # Prefill tokens the engine admits in one iteration (vLLM V0's max_num_batched_tokens; None:
    # unbounded, or chunked prefill). Policies may use it, with kv_free_tokens, to avoid proposing
    # admissions that cannot happen now.
    prefill_budget_tokens: int | None = None
    # Host swap space left for preempted KV, in tokens (0: the engine cannot swap; None: unknown or
    # no limit). Andes prices a preemption as a swap only while it fits; past that the engine recomputes.
    swap_free_tokens: int | None = None
    # Co-resident instances of several models: each engine's view (empty otherwise; module docstring).
    models: Mapping[str, ModelView] = field(default_factory=lambda: NO_MODELS)
    # LoRA adapters served by this instance's engines (``tessera.core.lora``): adapter -> the base model
    # whose engine runs it (requests name the adapter as their model; ``models`` is keyed by engine, so
    # by base), and the adapters one batch may mix (vLLM's --max-loras; 0: no LoRA).
    adapter_of: Mapping[str, str] = field(default_factory=lambda: NO_ADAPTERS)
    max_loras: int = 0

    @property
    def kv_free_tokens(self) -> int:
        """KV tokens not held by resident requests."""
        return self.kv_capacity_tokens - self.kv_used_tokens

    def engine_of(self, model: str) -> str:
        """The engine (``models`` key) that runs ``model``: its base for an adapter, else itself."""
        return self.adapter_of.get(model, model)

    @property
    def co_resident(self) -> bool:
        """Whether several engines are resident at once (``models`` is filled)."""
        return bool(self.models)


def engine_slots(view: InstanceView, kept: Iterable[Request]) -> dict[str, float]:
    """Requests each engine of a co-resident view may still start, the ``kept`` ones holding their
    engines' slots (inf: only the instance's batch limit bounds the engine)."""
    slots = {m: math.inf if e.max_running is None else e.max_running for m, e in view.models.items()}
    for req in kept:
        engine = view.engine_of(req.model)
        if engine in slots:
            slots[engine] -= 1
    return slots


def kv_blocks(context_tokens: int, block_size: int) -> int:
    """KV blocks a resident request with ``context_tokens`` tokens holds: what its next step needs."""
    return context_tokens // block_size + 1  # == ceil((context + 1) / block)


def resident_kv_tokens(resident: Iterable[Request], block_size: int) -> int:
    """KV tokens held by ``resident`` requests (running, or paused with their KV): whole blocks."""
    return sum(kv_blocks(r.prompt_tokens + r.generated, block_size) for r in resident) * block_size


def remaining_service_time(req: Request, output_tokens: float, profile: StepProfile, batch: int) -> float:
    """Instance seconds ``output_tokens`` more tokens of ``req`` take in a full batch of ``batch``
    (``StepProfile.service_time``): a request without its KV re-prefills its prompt and the tokens it
    has generated; a swapped one reads its KV back instead."""
    context = req.prompt_tokens + req.generated
    if req.kv_resident or req.swapped:
        swap_in = profile.kv_swap_time(context) if req.swapped else 0.0
        return swap_in + profile.service_time(context, output_tokens, batch, prefill=False)
    return profile.service_time(context, output_tokens, batch)


def kv_capacity_whole_blocks(profile: StepProfile) -> int:
    """The KV capacity of ``profile`` in whole blocks, in tokens."""
    return profile.kv_capacity_tokens // profile.block_size * profile.block_size


@dataclass(slots=True)
class Decision:
    """A policy's answer at one decision point (see the module docstring for semantics)."""

    run: list[Request]
    preempt_mode: PreemptMode | None = None  # how to preempt requests leaving the batch; None: engine default
    load_model: str | None = None  # swap the instance to this model first (QLM model swapping)
    recheck_after_tokens: int | None = None  # call schedule again after this many decode iterations
    recheck_at: float | None = None  # ... or at this absolute time, whichever comes first


class Policy(ABC):
    """A scheduling policy: a pure object over its queue and the time passed in (module docstring:
    when the shells call each hook)."""

    name: ClassVar[str]
    oracle: ClassVar[bool] = False  # reads Request.true_output_tokens: simulation only

    @abstractmethod
    def add(self, req: Request, now: float) -> None:
        """A request arrived at this instance (or was routed back to it)."""

    @abstractmethod
    def remove(self, req: Request, now: float) -> None:
        """A request left: finished or cancelled."""

    def observe(self, view: InstanceView) -> None:  # noqa: B027 - optional hook
        """The engine's progress up to this decision point (called just before ``schedule``)."""

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """Work to run on another thread ahead of the next decision (None: nothing to do)."""
        return None

    @abstractmethod
    def schedule(self, view: InstanceView) -> Decision:
        """Decide which requests run from now on."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of requests the policy holds (waiting, preempted and running)."""


@dataclass(order=True, slots=True)
class _Entry:
    key: tuple
    seq: int
    req: Request = field(compare=False)


class PriorityPolicy(Policy):
    """Run the requests with the smallest ``key`` first.

    ``preemptive=False``: running requests keep their slots and only free slots are
    filled from the queue (FCFS, EDF, SJF). ``preemptive=True``: every decision
    re-ranks running and queued requests together and the top ``max_batch`` run
    (SRTF). Keys of queued requests are assumed fixed while they wait; keys of
    running requests are re-evaluated at every decision unless ``static_keys`` says
    they never change (then the key computed at queueing time is reused). The queue
    is popped only as far as the engine could admit now (free KV tokens, prefill
    budget, batch slots), so a decision costs O(running + admitted·log queue),
    independent of the queue length.

    Several models (CHOICE): one queue across the models in the policy's own order (each model's
    requests sit in a heap of their own, merged by key and arrival sequence, so the order is that of a
    single queue). On a co-resident instance each engine admits in that order into its own KV share
    and sequence limit and stops at its first request that does not fit (vLLM's head-of-line
    admission, per engine); the other engines go on filling the instance's batch. With one model
    every decision is exactly the single-queue one.
    """

    preemptive: ClassVar[bool] = False
    static_keys: ClassVar[bool] = False  # key(req, now) never changes for a request

    def __init__(self) -> None:
        self._heaps: dict[str, list[_Entry]] = {}  # model -> its queued entries; lazy deletion
        self._queued: dict[int, _Entry] = {}  # id(req) -> live heap entry
        self._running: dict[int, _Entry] = {}
        self._seq = itertools.count()

    @abstractmethod
    def key(self, req: Request, now: float) -> tuple:
        """Priority key: smaller runs first."""

    def add(self, req: Request, now: float) -> None:
        """Queue a new request."""
        self._push(req, now)

    def remove(self, req: Request, now: float) -> None:
        """Forget a finished or cancelled request."""
        self._running.pop(id(req), None)
        self._queued.pop(id(req), None)

    def __len__(self) -> int:
        return len(self._queued) + len(self._running)

    def _push(self, req: Request, now: float) -> None:
        self._push_entry(_Entry(self.key(req, now), next(self._seq), req))

    def _push_entry(self, entry: _Entry) -> None:
        self._queued[id(entry.req)] = entry
        heap = self._heaps.get(entry.req.model)
        if heap is None:
            heap = self._heaps[entry.req.model] = []
        heapq.heappush(heap, entry)

    def _heap_entries(self) -> int:
        """Heap entries, live or stale."""
        return sum(map(len, self._heaps.values()))

    def _rebuild_heaps(self) -> None:
        """The heaps from the live queued entries only (drops the stale ones re-keying left behind)."""
        self._heaps = {}
        for entry in self._queued.values():
            self._heaps.setdefault(entry.req.model, []).append(entry)
        for heap in self._heaps.values():
            heapq.heapify(heap)

    def _top(self, heap: list[_Entry]) -> _Entry | None:
        """The heap's least live entry, stale ones dropped on the way (not popped)."""
        queued = self._queued
        while heap:
            entry = heap[0]
            if queued.get(id(entry.req)) is entry:
                return entry
            heapq.heappop(heap)
        return None

    def _pop_queued(self, skip: set[str] | None = None) -> _Entry | None:
        """The least live queued entry over every model's heap (those of ``skip`` left out), dequeued."""
        heaps = self._heaps
        if len(heaps) == 1 and not skip:
            heap = next(iter(heaps.values()))
            while heap:
                entry = heapq.heappop(heap)
                if self._queued.get(id(entry.req)) is entry:
                    del self._queued[id(entry.req)]
                    return entry
            return None
        best: list[_Entry] | None = None
        for model, heap in heaps.items():
            if skip and model in skip:
                continue
            top = self._top(heap)
            if top is not None and (best is None or _entry_order(top) < _entry_order(best[0])):
                best = heap
        if best is None:
            return None
        entry = heapq.heappop(best)
        del self._queued[id(entry.req)]
        return entry

    def _sync_running(self, view: InstanceView) -> None:
        """Requests the engine preempted on its own go back to the queue with a fresh key."""
        mine = self._running
        if len(view.running) == len(mine) and all(map(mine.__contains__, map(id, view.running))):
            return  # the same set as after the last decision (the common case): nothing to sync
        now_running = dict(zip(map(id, view.running), view.running, strict=True))
        if len(now_running) != len(self._running) or not now_running.keys() >= self._running.keys():
            for rid, entry in list(self._running.items()):
                if rid not in now_running and entry.req.phase is not Phase.FINISHED:
                    del self._running[rid]
                    self._push(entry.req, view.now)
        for rid in now_running.keys() - self._running.keys():  # set difference at C speed, not a batch loop
            req = now_running[rid]
            # A fresh entry: the queued one may still sit in a heap (lazy deletion) and must not change.
            old = self._queued.pop(rid, None)
            key = old.key if old is not None else self.key(req, view.now)
            self._running[rid] = _Entry(key, next(self._seq), req)

    def schedule(self, view: InstanceView) -> Decision:
        """Keep or re-rank the running set, then fill free slots from the queue in key order."""
        self._sync_running(view)
        now = view.now
        entries = list(self._running.values())
        if not self.static_keys:  # fresh entries: an old one may still sit in a heap (lazy deletion)
            entries = [_Entry(self.key(e.req, now), e.seq, e.req) for e in entries]
            for entry in entries:
                self._running[id(entry.req)] = entry
        entries.sort(key=_entry_order)
        if self.preemptive:
            for entry in entries:
                self._push_entry(entry)
            self._running.clear()
            entries = []
        run = list(map(_entry_req, entries))
        former = entries if self.preemptive else []
        if view.models:
            self._admit_co_resident(view, run)
        else:
            self._admit(view, run)
        # Requests that were running keep their KV: they stay in the batch behind the stop point.
        for entry in former:
            if len(run) >= view.max_batch:
                break
            if id(entry.req) not in self._running:
                del self._queued[id(entry.req)]
                run.append(entry.req)
                self._running[id(entry.req)] = entry
        # Whatever the engine cannot admit returns to the queue at the next decision via _sync_running.
        return Decision(run=run, recheck_after_tokens=self.recheck_tokens())

    def _admit(self, view: InstanceView, run: list[Request]) -> None:
        """Fill ``run`` from the queue while one engine could admit: the engine stops at the first
        request that does not fit, so popping further than the free KV tokens and the prefill budget
        allow would only churn the heap."""
        room = view.kv_free_tokens
        budget = view.prefill_budget_tokens
        lora = _LoraSkip(view, run, self._heaps)
        while len(run) < view.max_batch:
            entry = self._pop_queued(lora.skip)
            if entry is None:
                break
            req = entry.req
            if not req.kv_resident:
                need = req.prompt_tokens + req.generated + 1
                if room <= 0 or (budget is not None and budget <= 0 and not req.swapped):
                    self._push_entry(entry)  # cannot start now: stays queued
                    break
                room -= need
                if budget is not None and not req.swapped:
                    budget -= need
            run.append(req)
            self._running[id(req)] = entry
            lora.joined(req)

    def _admit_co_resident(self, view: InstanceView, run: list[Request]) -> None:
        """``_admit`` over several resident engines: each engine's KV share, prefill budget and sequence
        limit, head-of-line per engine (a model whose next request does not fit is done)."""
        engines = view.models
        room = {m: e.kv_free_tokens for m, e in engines.items()}
        slots = engine_slots(view, run)
        budget = dict.fromkeys(engines, view.prefill_budget_tokens)
        lora = _LoraSkip(view, run, self._heaps)
        # Heaps (models) left out: those of engines not served here (never admitted) and, as the
        # engines fill, every model of a full engine (an adapter's engine is its base's).
        by_engine: dict[str, list[str]] = {}
        for m in self._heaps:
            by_engine.setdefault(view.engine_of(m), []).append(m)
        done = lora.skip
        for engine, members in by_engine.items():
            if engine not in engines or slots[engine] <= 0:
                done.update(members)
        while len(run) < view.max_batch:
            entry = self._pop_queued(done)
            if entry is None:
                break
            req = entry.req
            engine = view.engine_of(req.model)
            if not req.kv_resident:
                need = req.prompt_tokens + req.generated + 1
                left = budget[engine]
                if room[engine] <= 0 or (left is not None and left <= 0 and not req.swapped):
                    self._push_entry(entry)
                    done.update(by_engine[engine])
                    continue
                room[engine] -= need
                if left is not None and not req.swapped:
                    budget[engine] = left - need
            run.append(req)
            self._running[id(req)] = entry
            lora.joined(req)
            slots[engine] -= 1
            if slots[engine] <= 0:
                done.update(by_engine[engine])

    def recheck_tokens(self) -> int | None:
        """Decode iterations until the policy wants to re-rank without an event (None: only on events)."""
        return None


class _LoraSkip:
    """The queue heaps (models) an admission loop leaves out for LoRA's GPU slots: the adapters that
    cannot join the batch now (``tessera.core.lora.admits``), kept up to date as requests join. With no
    adapters it is an empty set and costs nothing."""

    def __init__(self, view: InstanceView, run: Iterable[Request], heaps: Mapping[str, object]) -> None:
        self.skip: set[str] = set()
        self._adapter_of = view.adapter_of
        self._max = view.max_loras
        if self._max <= 0 or not self._adapter_of:
            self._adapters: list[str] = []
            return
        self._adapters = [m for m in heaps if m in self._adapter_of]
        self._in_batch = set(batch_adapters(run, self._adapter_of))
        self._update()

    def _update(self) -> None:
        in_batch, adapter_of, most = self._in_batch, self._adapter_of, self._max
        self.skip.update(a for a in self._adapters if not admits(in_batch, a, adapter_of, most))

    def joined(self, req: Request) -> None:
        """``req`` joined the batch: its adapter now holds a slot."""
        if self._adapters and req.model in self._adapter_of and req.model not in self._in_batch:
            self._in_batch.add(req.model)
            self._update()


_entry_order = operator.attrgetter("key", "seq")
_entry_req = operator.attrgetter("req")
