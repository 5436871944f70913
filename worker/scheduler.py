"""The real-time scheduling loop of one pod: one core Policy over every model, driving their engines.

The worker holds every accepted request of every model it serves, in one ``InstanceScheduler``: the
object one simulated instance holds (``tessera.sim.engine.SimInstance``), with the models' engines as
its executors (``EngineSlot``). How the pod shares its accelerator between models is
``tessera.core.sharing``'s mode (``InstanceScheduler.mode``). At each decision point (an arrival, a
completion, a cancellation, a recheck the policy asked for, the engine coming back) it builds an
``InstanceView`` and asks the policy; ``Decision.run`` becomes the in-flight set (protocol in
``tessera.core.policy``):

- in-flight requests not in ``run`` are preempted: their stream is closed, which aborts them in
  the engine (vLLM V1 preempts by recompute anyway; ``Decision.preempt_mode`` is therefore not
  applied: the KV stays only as far as vLLM's prefix cache keeps it); a pinned job (structured
  outputs: a resumed stream would restart the grammar) keeps running and holds its slot;
- requests of ``run`` not in flight start, in order, while the batch size allows (head-of-line);
  a resumed request is submitted as prompt ids + the ids it generated so far, with the remaining
  ``max_tokens``, so its output continues exactly (greedy decoding gives identical ids).

Classes may bound the queue time (``queue.maxQueueTimeSeconds``): a request that has not started
by then ends with ``QueueTimeout`` (HTTP 429, Retry-After), never silently. ``Decision.load_model``
goes to the pod's ``ModelSwapper`` (sleep / wake-up; see ``tessera.worker.swap``); while a swap is
under way nothing starts, and requests of a sleeping model wait in the queue.

With Chiron's local autoscaler on (``scheduling.autoscale.enabled``) the policy runs inside the
core's ``ChironPolicy``, the same wrapper the simulator runs: it moves the batch size at changes of
the running set and lets interactive requests evict batch ones; the scheduler only counts the
engine's decode iterations for it.
If an engine fails, its in-flight requests end with the engine's error (HTTP 503), queued ones stay
queued, nothing is admitted to it until a health probe sees it back; the other engines go on.

LoRA adapters (``adapter_of``) are models of the pod that run in their base's engine: they count in
its KV, its sequence limit and its busy time, never as an engine of their own (the view's ``models``
and the sharing mode are by engine). A decision's new requests start only while their base's batch
holds at most ``max_loras`` adapters (``tessera.core.lora.engine_batch``, vLLM's own rule, so that no
request waits inside vLLM out of the policy's reach). An adapter the engine does not hold is loaded
first (``adapter_loader``, the adapter's swap: its requests wait meanwhile, the others go on), and
the least recently used idle adapter is unloaded when the engine holds ``maxCpuLoras`` already.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.api.worker_config import AutoscaleSpec, BatchBounds
from tessera.core.chiron import ChironLocal, ChironPolicy
from tessera.core.lora import AdapterCache, engine_batch
from tessera.core.policy import (
    NO_MODELS,
    Decision,
    InstanceView,
    ModelView,
    Policy,
    kv_capacity_whole_blocks,
    resident_kv_tokens,
)
from tessera.core.profile import StepProfile
from tessera.core.qoe import request_qoe
from tessera.core.queue_share import tenant_queue_share
from tessera.core.request import Phase, Request
from tessera.core.sharing import SharingMode, sharing_mode
from tessera.core.slo import slo_met
from tessera.worker.engines.base import (
    Engine,
    EngineError,
    EngineJob,
    EngineStats,
    EngineUnavailable,
    TokenDelta,
)
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.swap import ModelSwapper

PROBE_INTERVAL_S = 0.5
# Consecutive failed policy decisions after which the worker reports not ready (it keeps serving
# in arrival order meanwhile, so nothing accepted stalls).
DECISION_FAILURES_NOT_READY = 5
log = logging.getLogger(__name__)


# Loads (True) or unloads (False) a LoRA adapter in its base's engine; raises EngineError on failure.
AdapterLoader = Callable[[str, bool], Awaitable[None]]


class QueueTimeout(EngineError):
    """The request waited longer than its class's ``queue.maxQueueTimeSeconds`` without starting."""

    status = 429
    code = "queue_timeout"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Exception):
    """The model's (or the class's) queue is at its bound; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False, slots=True)
class Job:
    """The worker's state of one accepted request."""

    req: Request
    prompt_ids: list[int]
    sampling: dict[str, Any]
    output_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue[TokenDelta | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finish_reason: str | None = None
    error: EngineError | None = None
    task: asyncio.Task[None] | None = None
    streams: int = 0  # engine streams opened (1 + resumptions)
    last_token_at: float | None = None
    engine_finish: str | None = None  # finish reason the engine sent (kept if preempted just after)
    first_prediction: float | None = None
    stops: tuple[str, ...] = ()  # stop strings, matched here (see __post_init__)
    held: str = ""  # text withheld from the client: it may be the start of a stop string
    # Never preempted once started: a resumed stream would restart the engine's state of it (the
    # grammar of structured outputs), not continue it.
    pinned: bool = False

    def __post_init__(self) -> None:
        # Stop strings are matched by the worker over the whole output, not by the engine: an
        # engine sees only its own stream, so a stop string that straddles a preemption would be
        # missed, and vLLM withholds the text that may start one, which an abort would lose.
        stop = self.sampling.pop("stop", None)
        if stop:
            self.stops = (stop,) if isinstance(stop, str) else tuple(stop)

    @property
    def class_name(self) -> str:
        """The request's class name."""
        return self.req.service_class.name


@dataclass(eq=False, slots=True)
class EngineSlot:
    """One model's engine in the pod, as the instance scheduler drives it: its profile (the configured
    one with the KV capacity and block size the engine reports), health, bounds and in-flight set."""

    engine: Engine
    configured_profile: StepProfile
    profile: StepProfile
    class_limits: dict[str, int | None]
    class_queue_times: dict[str, float | None]
    max_running: int | None = None  # the engine's own sequence limit (vLLM's --max-num-seqs)
    stats: EngineStats | None = None  # the engine's latest report
    reports: bool | None = None  # None until the engine was first asked
    ok: bool = True
    inflight: dict[Job, None] = field(default_factory=dict)  # this model's in-flight jobs
    live: Counter[str] = field(default_factory=Counter)  # accepted jobs by class
    running: Counter[str] = field(default_factory=Counter)  # in-flight jobs by class
    # The same by (class, tenant), and each tenant's weight: the queue bounds' tenant shares.
    tenant_live: Counter[tuple[str, str]] = field(default_factory=Counter)
    tenant_running: Counter[tuple[str, str]] = field(default_factory=Counter)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    busy_since: float | None = None  # when it last went from idle to busy (engine-time share)
    probe_task: asyncio.Task[None] | None = None

    @property
    def model(self) -> str:
        """The model this engine serves."""
        return self.engine.model

    @property
    def waiting(self) -> int:
        """Accepted requests of this model not in flight."""
        return sum(self.live.values()) - len(self.inflight)

    def tenants_waiting(self, cls: str | None = None) -> Counter[str]:
        """Accepted requests not in flight by tenant, of class ``cls`` (None: every class)."""
        out: Counter[str] = Counter()
        for key, n in self.tenant_live.items():
            if cls is None or key[0] == cls:
                out[key[1]] += n - self.tenant_running[key]
        return +out

    def apply_stats(self, stats: EngineStats | None) -> None:
        """The effective profile: the configured one with the engine's KV capacity and block size."""
        self.stats = stats
        base = self.configured_profile
        kv = (base.kv_capacity_tokens, base.block_size) if stats is None else (
            stats.kv_capacity_tokens, stats.block_size)  # fmt: skip
        if kv == (base.kv_capacity_tokens, base.block_size):
            self.profile = base
        elif kv != (self.profile.kv_capacity_tokens, self.profile.block_size):
            self.profile = replace(base, kv_capacity_tokens=kv[0], block_size=kv[1])


class InstanceScheduler:
    """Queue, policy and in-flight sets of every model of one pod: one core policy over all of them.

    A pod of one model is exactly the single-model instance. A pod of several runs as
    ``tessera.core.sharing`` says: ``swapping`` where its engines can sleep (the swapper's models),
    else ``co-resident``. Co-resident: the view holds each engine's ``ModelView`` and a decision may
    start requests of several models at once, each on its own engine while the instance's batch size,
    the engine's ``max_running`` and its KV allow. Swapping: the view is the awake model's;
    ``Decision.load_model`` preempts the awake model's in-flight requests and swaps (as the simulator
    does; a policy that wants them drained first, as QLM, keeps them in ``run`` and asks later); with
    no swap asked, when nothing of the awake model can run but ``run`` holds another model's request,
    that model is loaded (the simulator's rule)."""

    def __init__(
        self,
        engines: Mapping[str, Engine],
        policy: Policy,
        *,
        profiles: Mapping[str, StepProfile],
        batch: BatchBounds,
        autoscale: AutoscaleSpec,
        max_queued: int,
        class_limits: Mapping[str, dict[str, int | None]] | None = None,
        metrics: WorkerMetrics,
        class_queue_times: Mapping[str, dict[str, float | None]] | None = None,
        max_running: Mapping[str, int] | None = None,
        swapper: ModelSwapper | None = None,
        stats_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        adapter_of: Mapping[str, str] | None = None,
        max_loras: Mapping[str, int] | None = None,
        adapter_cache: Mapping[str, int] | None = None,
        adapter_loader: AdapterLoader | None = None,
        unload_after: Mapping[str, float] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("an instance scheduler needs at least one engine")
        self.adapter_of = dict(adapter_of or {})
        for adapter, base in self.adapter_of.items():
            if adapter not in engines or base not in engines or base in self.adapter_of:
                raise ValueError(f"adapter {adapter!r} needs its own engine and a full base model among the "
                                 f"pod's ({', '.join(engines)}), not {base!r}")  # fmt: skip
        # One batch's adapter slots: the least of the bases' (a pod's bases share the pool's maxLoras).
        self.max_loras = min((max_loras or {}).values(), default=0) if self.adapter_of else 0
        self.adapter_loader = adapter_loader
        # What each base's engine holds: every adapter at start, as the worker loads them there.
        self.adapter_caches: dict[str, AdapterCache] = {}
        for base, size in (adapter_cache or {}).items():
            held = [a for a, b in self.adapter_of.items() if b == base]
            if held:
                self.adapter_caches[base] = AdapterCache(max(size, 1), held[: max(size, 1)])
        self._loading: dict[str, asyncio.Task[None]] = {}  # adapter -> its load under way
        # Adapters unloaded after this many idle seconds (scale to zero of an adapter), and when each
        # was last busy.
        self.unload_after = {a: s for a, s in (unload_after or {}).items() if a in self.adapter_of}
        self._idle_since: dict[str, float] = {}
        self.adapter_loads = 0  # adapters loaded on demand (their swaps)
        limits = class_limits or {}
        queue_times = class_queue_times or {}
        seqs = max_running or {}
        self.slots: dict[str, EngineSlot] = {
            model: EngineSlot(
                engine,
                profiles[model],
                profiles[model],
                dict(limits.get(model, {})),
                dict(queue_times.get(model, {})),
                seqs.get(model),
            )
            for model, engine in engines.items()
        }
        # Engine (base) -> its slots: the base's first, then its adapters'.
        self.groups: dict[str, list[EngineSlot]] = {}
        for model, slot in self.slots.items():
            self.groups.setdefault(self._engine_of(model), []).append(slot)
        self.stats_interval_s = stats_interval_s
        self.metrics = metrics
        self.clock = clock
        self.max_queued = max_queued
        self.swapper = swapper
        self.autoscale = autoscale
        # Kept across reloads: a policy switch keeps the batch size learned so far.
        self.chiron = ChironLocal(
            batch.min, batch.max, batch.start, autoscale.alpha, autoscale.min_iterations,
            autoscale.min_interval_seconds,
        )  # fmt: skip
        self.policy = self._wrap(policy)
        # The batch-size limit the policy sees: the static size, or the bound Chiron moves within.
        self.max_batch = batch.max if autoscale.enabled else batch.start
        self.inflight: dict[Job, None] = {}  # insertion-ordered set: admission order, every model
        self._busy_engines = 0  # engines with requests in flight
        self.jobs: dict[Request, Job] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._recheck_tokens: int | None = None
        self._recheck_at: float | None = None
        self._iters = 0.0  # decode iterations since the last decision (estimated from tokens)
        self._iterations = 0.0  # decode iterations so far (estimated from tokens)
        self._completions: deque[float] = deque(maxlen=64)
        # (expiry, seq, job) of requests whose class bounds the queue time; lazily cleaned
        self._expiries: list[tuple[float, int, Job]] = []
        self._itl_hist: dict[tuple[str, str], Any] = {}  # per model and class: the ITL histogram child
        label = self.label
        self._decision_hist = metrics.decision_time.labels(label)
        self._seq = itertools.count()
        self._work_thread: ThreadPoolExecutor | None = None  # the policy's work ahead of decisions
        self.decision_failures = 0  # consecutive policy decisions that raised
        self.policy_faults = 0  # decisions that named a model this pod does not serve
        self._decision_failed = metrics.decision_failures.labels(label)
        self._gauge_batch()
        if swapper is not None:
            for model, slot in self.slots.items():
                swapper.register(model, lambda s=slot: len(s.inflight), self._wake.set)

    @property
    def models(self) -> list[str]:
        """The pod's models, in configuration order."""
        return list(self.slots)

    @property
    def label(self) -> str:
        """The ``model`` label of the instance's own metrics (decision time, failures): the model of a
        one-model pod, the pod's models joined by ``+`` otherwise."""
        return "+".join(self.slots)

    @property
    def mode(self) -> SharingMode:
        """How this pod shares its accelerator between its models (``tessera.core.sharing``)."""
        sleeps = self.swapper is not None and bool(self.swapper.swappable)
        return sharing_mode(len(self.groups), sleeps)

    @property
    def engine_ok(self) -> bool:
        """Whether every engine answered its last probe."""
        return all(slot.ok for slot in self.slots.values())

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the loop; each engine is probed before anything is admitted to it."""
        for slot in self.slots.values():
            self.metrics.engine_start_time.labels(slot.model).set(time.time())
            slot.ok = await slot.engine.healthy()
            if slot.ok and slot.model not in self.adapter_of:  # an adapter's figures are its base's
                await self._read_stats(slot)  # the first decisions already see the engine's capacity
            else:
                self._start_probe(slot)
        self._loop_task = asyncio.create_task(self._run(), name=f"scheduler-{self.label}")
        self._stats_task = asyncio.create_task(self._poll_stats(), name=f"stats-{self.label}")

    async def stop(self) -> None:
        """Stop the loop and end every stream (requests still held end with an error)."""
        tasks = [self._loop_task, self._stats_task, *(s.probe_task for s in self.slots.values())]
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for job in list(self.jobs.values()):
            self._end(job, None, EngineUnavailable("the worker is shutting down"))
        if self._work_thread is not None:
            self._work_thread.shutdown(wait=False, cancel_futures=True)
        await asyncio.sleep(0)

    @property
    def waiting(self) -> int:
        """Accepted requests not in flight, every model."""
        return len(self.jobs) - len(self.inflight)

    # ---------------------------------------------------------------- requests

    def submit(self, *jobs: Job) -> None:
        """Accept ``jobs`` (one, or the choices of one request: one model, one class, one arrival time,
        hence one deadline) or raise QueueFull for all of them (nothing accepted is ever dropped). The
        queue bounds are per model (``max_queued``) and per model and class, each split between the
        tenants waiting there by weight (``tessera.core.queue_share``)."""
        model = jobs[0].req.model
        slot = self.slots.get(model)
        if slot is None:
            raise ValueError(f"this pod does not serve model {model!r}; it serves {', '.join(self.slots)}")
        cls = jobs[0].class_name
        tenant, weight = jobs[0].req.tenant, jobs[0].req.tenant_weight
        self._check_share(slot, None, self.max_queued, tenant, weight, len(jobs), f"model {model}")
        limit = slot.class_limits.get(cls)
        if limit is not None:
            self._check_share(slot, cls, limit, tenant, weight, len(jobs), f"class {cls}")
        slot.tenant_weights[tenant] = weight
        now = self.clock()
        max_wait = slot.class_queue_times.get(cls)
        for job in jobs:
            job.req.arrival = now
            self.jobs[job.req] = job
            slot.live[cls] += 1
            slot.tenant_live[cls, tenant] += 1
            self.policy.add(job.req, now)
            if max_wait is not None:
                heapq.heappush(self._expiries, (now + max_wait, next(self._seq), job))
        self._gauges(slot, cls)
        self._wake.set()

    def _check_share(
        self, slot: EngineSlot, cls: str | None, bound: int, tenant: str, weight: float, n: int, what: str
    ) -> None:
        """QueueFull unless ``n`` more requests of ``tenant`` (of ``weight``) fit in its share of
        ``bound``, the queue of ``what`` (of class ``cls``, or of the whole model; the share:
        ``tessera.core.queue_share``)."""
        waiting = slot.tenants_waiting(cls)
        others = [slot.tenant_weights[t] for t in waiting if t != tenant]
        share = tenant_queue_share(bound, weight, others)
        excess = waiting[tenant] + n - share
        if excess > 0:
            whose = f"; tenant {tenant!r} holds its share, {share}" if others else ""
            raise QueueFull(f"the queue of {what} is full ({bound} waiting{whose})",
                            self._retry_after(excess))  # fmt: skip

    def cancel(self, job: Job) -> None:
        """The client went away: abort the stream (if any) and forget the request."""
        if not job.done.is_set():
            self._end(job, "cancelled", None)

    # ---------------------------------------------------------------- reconfiguration

    def reconfigure(
        self,
        policy: Policy,
        *,
        batch: BatchBounds,
        autoscale: AutoscaleSpec,
        max_queued: int,
        class_limits: Mapping[str, dict[str, int | None]] | None = None,
        class_queue_times: Mapping[str, dict[str, float | None]] | None = None,
        profiles: Mapping[str, StepProfile] | None = None,
        stats_interval_s: float | None = None,
    ) -> None:
        """Switch policy and bounds in place; every held request moves to the new policy.

        A changed queue-time bound applies to requests that arrive after the change; a new profile
        keeps the KV capacity and block size the engine reports."""
        now = self.clock()
        for model, slot in self.slots.items():
            if profiles is not None and model in profiles:
                slot.configured_profile = slot.profile = profiles[model]
                slot.apply_stats(slot.stats)
            slot.class_limits = dict((class_limits or {}).get(model, {}))
            slot.class_queue_times = dict((class_queue_times or {}).get(model, {}))
        if stats_interval_s is not None:
            self.stats_interval_s = stats_interval_s
        self.max_queued = max_queued
        self.autoscale = autoscale
        self.chiron.set_bounds(batch.min, batch.max)
        self.chiron.alpha = autoscale.alpha
        self.chiron.min_iterations = autoscale.min_iterations
        self.chiron.min_interval_s = autoscale.min_interval_seconds
        if not autoscale.enabled:
            self.chiron.initial = batch.start
        self.max_batch = batch.max if autoscale.enabled else batch.start
        wrapped = self._wrap(policy)
        for req in self.jobs:
            wrapped.add(req, now)
        self.policy = wrapped
        self._gauge_batch()
        self._wake.set()

    def _wrap(self, policy: Policy) -> Policy:
        """``policy`` inside Chiron's local autoscaler when it is on (the core's wrapper)."""
        if not self.autoscale.enabled:
            return policy
        return ChironPolicy(
            policy,
            self.chiron,
            interactive_itl_s=self.autoscale.interactive_itl_slo_seconds,
            batch_itl_s=self.autoscale.batch_itl_slo_seconds,
        )

    @property
    def batch_size(self) -> int:
        """The batch size in effect: Chiron's when its local autoscaler is on, else the static one."""
        return self.policy.batch_size() if isinstance(self.policy, ChironPolicy) else self.max_batch

    # ---------------------------------------------------------------- the loop

    async def _run(self) -> None:
        while True:
            expiry = self._expiries[0][0] if self._expiries else None
            due = [t for t in (self._recheck_at, expiry, self._next_unload()) if t is not None]
            timeout = max(0.0, min(due) - self.clock()) if due else None
            # asyncio.timeout, not wait_for: under Python 3.11's wait_for this task could stay stuck
            # while being cancelled (stop() hung with a policy's recheck time set).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            await self._prepare()
            self.decide()

    async def _prepare(self) -> None:
        """Run the policy's expensive work for the coming decision (ISRTF's text predictor, QLM's
        MILP: tens of ms to seconds on a CPU) on a thread, so streams keep flowing meanwhile
        (Policy protocol item 6)."""
        work = self.policy.prepare(self._view(self.clock()))
        if work is None:
            return
        if self._work_thread is None:
            self._work_thread = ThreadPoolExecutor(1, thread_name_prefix=f"policy-{self.label}")
        try:
            await asyncio.get_running_loop().run_in_executor(self._work_thread, work)
        except Exception:  # decide() does what is still due itself, and logs if that fails too
            log.exception("policy work ahead of a decision for %s failed", self.label)

    def _expire(self, now: float) -> None:
        """End requests that waited past their class's maximum queue time without starting."""
        while self._expiries and self._expiries[0][0] <= now:
            _, _, job = heapq.heappop(self._expiries)
            req = job.req
            if job.done.is_set() or req.first_scheduled_at is not None:
                continue  # finished, cancelled or started in time
            limit = self.slots[req.model].class_queue_times.get(job.class_name)
            self._end(job, None, QueueTimeout(
                f"request {req.id} waited {now - req.arrival:.3f} s in the queue of model "
                f"{req.model} without starting, past class {job.class_name}'s maximum queue time "
                f"of {limit} s; retry later, or raise queue.maxQueueTimeSeconds",
                self._retry_after(self.waiting + 1)))  # fmt: skip

    @property
    def policy_ok(self) -> bool:
        """False once the policy has failed ``DECISION_FAILURES_NOT_READY`` decisions in a row."""
        return self.decision_failures < DECISION_FAILURES_NOT_READY

    def decide(self) -> None:
        """One decision point: ask the policy and apply its answer.

        A policy that raises does not stop the pod: this decision falls back to arrival order
        (running requests keep running, then the oldest queued), the failure is counted in
        ``tessera_decision_failures_total``, and the policy is asked again at the next event. A request
        of ``run`` this pod does not hold, or a ``load_model`` it does not serve, is a policy fault:
        logged and counted, never a crash; the request stays where it was."""
        now = self.clock()
        if self._expiries:
            self._expire(now)
        if self.unload_after:
            self._unload_idle(now)
        t0 = time.perf_counter()
        try:
            view = self._view(now)
            self.policy.observe(view)
            decision = self.policy.schedule(view)
            self.decision_failures = 0
        except Exception:
            self.decision_failures += 1
            self._decision_failed.inc()
            if self.decision_failures == 1:  # once per run of failures, not at every event
                log.exception("policy %s failed a decision for %s; serving in arrival order until it "
                              "recovers", self.policy.name, self.label)  # fmt: skip
            decision = self._arrival_order()
        self._decision_hist.observe(time.perf_counter() - t0)
        self._gauge_batch()
        self._recheck_tokens = decision.recheck_after_tokens
        self._recheck_at = decision.recheck_at
        self._iters = 0.0
        chosen = {id(r) for r in decision.run}
        for job in list(self.inflight):
            if id(job.req) not in chosen and not job.pinned:
                self._preempt(job, now)
        if self.swapper is not None and self.swapper.swappable and not self._swap_allows(decision, now):
            return
        run = decision.run
        if self.max_loras:
            running = {job.req for job in self.inflight}
            run, _ = engine_batch(run, running, self.adapter_of, self.max_loras)
        for req in run:
            job = self.jobs.get(req)
            if job is None:
                self._fault(f"its decision named request {req.id} of model {req.model!r}, which this pod "
                            "does not hold")  # fmt: skip
                continue
            if job in self.inflight:
                continue
            if len(self.inflight) >= self.max_batch:
                break
            slot = self.slots[req.model]
            engine = self._engine_of(req.model)
            if not slot.ok or not self._awake(engine):
                continue  # its engine is down or asleep: it waits
            base = self.slots[engine]
            if base.max_running is not None and self._in_engine(engine) >= base.max_running:
                continue
            if not self._adapter_held(req.model):
                continue  # its adapter is loading: it waits, the others go on
            self._launch(job, now)

    def _awake(self, model: str) -> bool:
        swapper = self.swapper
        return swapper is None or swapper.may_admit(model)

    def _fault(self, what: str) -> None:
        self.policy_faults += 1
        self.metrics.policy_faults.labels(self.label).inc()
        if self.policy_faults == 1 or self.policy_faults % 1000 == 0:
            log.error("policy %s fault (%d so far): %s", self.policy.name, self.policy_faults, what)

    def _arrival_order(self) -> Decision:
        """The fallback decision: in-flight requests, then queued ones by arrival; asks again soon."""
        queued = sorted((r for r, j in self.jobs.items() if j not in self.inflight), key=lambda r: r.arrival)
        return Decision(
            run=[j.req for j in self.inflight] + queued, recheck_at=self.clock() + PROBE_INTERVAL_S
        )

    def _view(self, now: float) -> InstanceView:
        """The policy's view, every field filled as the simulator fills it. In-flight requests are the
        resident ones (a preempted stream is aborted: its KV is gone). KV capacity is each engine's
        (``stats``; the configured one if it reports none); KV use is the larger of the core's block
        accounting of its in-flight requests, which is current but blind to what else the engine
        holds, and the engine's own figure, which is true but up to a poll old: memory pressure is
        never under-stated. Prefill has no per-iteration budget (vLLM V1 chunks prompts; the sim
        adapter prefills all joining streams in one step) and nothing is swapped out (preemption
        recomputes). One model, or the awake one of a swapping pod, is the view's own; a co-resident
        pod's view holds every engine (``InstanceView.models``) and their sums."""
        # Whole iterations; the float sum of 1/B per token can land just below an integer.
        iteration = math.floor(self._iterations + 1e-6)
        running = tuple(job.req for job in self.inflight)
        if self.mode == "co-resident":
            engines: Mapping[str, ModelView] = {m: self._engine_view(m) for m in self.groups}
            kv_capacity = sum(e.kv_capacity_tokens for e in engines.values())
            kv_used = sum(e.kv_used_tokens for e in engines.values())
            profile, active = next(iter(engines.values())).profile, None
        else:  # one model, or the awake one (the first while a swap is under way)
            swapper = self.swapper
            active = (swapper.active if swapper is not None else None) or next(iter(self.groups))
            own = self._engine_view(active)
            engines, profile = NO_MODELS, own.profile
            kv_capacity, kv_used = own.kv_capacity_tokens, own.kv_used_tokens
        return InstanceView(
            now=now,
            instance=self.label,
            running=running,
            max_batch=self.max_batch,
            kv_capacity_tokens=kv_capacity,
            kv_used_tokens=kv_used,
            profile=profile,
            active_model=active,
            iteration=iteration,
            prefill_budget_tokens=None,
            swap_free_tokens=0,
            models=engines,
            adapter_of=self.adapter_of,
            max_loras=self.max_loras,
        )

    def _engine_view(self, engine: str) -> ModelView:
        """One engine as the policy sees it: the base's capacity and limits, with its adapters' requests
        counted in (they share its KV)."""
        slot = self.slots[engine]
        profile = slot.profile
        group = self.groups[engine]
        inflight = (job.req for s in group for job in s.inflight)
        used = resident_kv_tokens(inflight, profile.block_size)
        if slot.stats is not None:
            used = max(used, slot.stats.kv_used_tokens)
        return ModelView(
            model=engine,
            profile=profile,
            kv_capacity_tokens=kv_capacity_whole_blocks(profile),
            kv_used_tokens=used,
            running=self._in_engine(engine),
            max_running=slot.max_running,
        )

    def _engine_of(self, model: str) -> str:
        """The engine (``groups`` key) that runs ``model``: its base for an adapter, else itself."""
        return self.adapter_of.get(model, model)

    def _in_engine(self, engine: str) -> int:
        """Requests in flight on ``engine``, its adapters' included."""
        return sum(len(s.inflight) for s in self.groups[engine])

    def _adapter_held(self, model: str) -> bool:
        """Whether ``model``'s engine holds it (a base model always); an adapter it does not hold starts
        loading, its least recently used idle adapter unloaded first where the engine is full."""
        base = self.adapter_of.get(model)
        cache = self.adapter_caches.get(base) if base is not None else None
        if cache is None:
            return True
        if model in self._loading:  # a load, or an idle unload, under way: it waits for it
            return False
        if model in cache:
            cache.use(model)
            return True
        busy = {s.model for s in self.groups[base] if s.inflight}
        _, evicted = cache.use(model, busy)
        self._loading[model] = asyncio.create_task(self._load_adapter(model, evicted), name=f"lora-{model}")
        return False

    def _idle_adapters(self) -> list[tuple[str, float]]:
        """(adapter, when it may be unloaded) of the held adapters with an idle bound and no requests."""
        out = []
        for adapter, after in self.unload_after.items():
            cache = self.adapter_caches.get(self.adapter_of[adapter])
            slot = self.slots[adapter]
            if cache is None or adapter not in cache or adapter in self._loading or slot.live.total():
                self._idle_since.pop(adapter, None)
                continue
            since = self._idle_since.setdefault(adapter, self.clock())
            out.append((adapter, since + after))
        return out

    def _next_unload(self) -> float | None:
        return min((t for _, t in self._idle_adapters()), default=None)

    def _unload_idle(self, now: float) -> None:
        """Unload the adapters idle past their bound (scale to zero of an adapter; the base stays)."""
        for adapter, due in self._idle_adapters():
            if due <= now:
                self.adapter_caches[self.adapter_of[adapter]].drop(adapter)
                del self._idle_since[adapter]
                self._loading[adapter] = asyncio.create_task(self._unload(adapter), name=f"unlora-{adapter}")

    async def _unload(self, adapter: str) -> None:
        """Unload an idle adapter; a failure is logged (the engine may keep it: nothing else changes)."""
        try:
            if self.adapter_loader is not None:
                await self.adapter_loader(adapter, False)
            log.info("unloaded the idle LoRA adapter %s", adapter)
        except EngineError as exc:
            log.warning("unloading the idle LoRA adapter %s failed: %s", adapter, exc)
        finally:
            del self._loading[adapter]
            self._wake.set()

    async def _load_adapter(self, adapter: str, evicted: str | None) -> None:
        """Unload ``evicted`` (if any), then load ``adapter`` into its base's engine: the adapter's swap.
        A failed load drops it from the cache and ends its waiting requests with the engine's error."""
        loader = self.adapter_loader
        t0 = self.clock()
        try:
            if loader is not None:
                if evicted is not None:
                    await loader(evicted, False)
                await loader(adapter, True)
        except EngineError as exc:
            self.adapter_caches[self.adapter_of[adapter]].drop(adapter)
            log.error("loading the LoRA adapter %s failed: %s; its waiting requests end with this error",
                      adapter, exc)  # fmt: skip
            for job in [j for r, j in self.jobs.items() if r.model == adapter and j not in self.inflight]:
                self._end(job, None, exc)
        else:
            self.adapter_loads += 1
            self.metrics.adapter_loads.labels(adapter).inc()
            log.info("loaded the LoRA adapter %s in %.3f s%s", adapter, self.clock() - t0,
                     f" (unloaded {evicted})" if evicted else "")  # fmt: skip
        finally:
            del self._loading[adapter]
            self._wake.set()

    def _swap_allows(self, decision: Decision, now: float) -> bool:
        """Apply a swapping pod's load: ``load_model`` (or, with none asked, the model of the first
        request of ``run`` when nothing of the awake model can run) preempts the awake model's
        in-flight requests and swaps; False while nothing may start (a swap under way)."""
        swapper = self.swapper
        assert swapper is not None
        target = decision.load_model
        if target is not None and target not in self.slots:
            self._fault(f"its decision asked to load model {target!r}, which this pod does not serve")
            target = None
        active = swapper.active
        if target is None and active is not None and not self.slots[active].inflight:
            runnable = any(r.model == active and r in self.jobs for r in decision.run)
            if not runnable:
                target = next((r.model for r in decision.run if r.model != active and r in self.jobs), None)
        if target is not None and target != active:
            for job in [j for j in self.slots[active].inflight if not j.pinned] if active else []:
                self._preempt(job, now)
            swapper.request(target)
        swapper.poke()
        return not swapper.swapping and swapper.pending is None

    # ---------------------------------------------------------------- streams

    def _launch(self, job: Job, now: float) -> None:
        req = job.req
        if job.engine_finish is not None or req.generated >= req.max_tokens:  # preempted after its end
            self._end(job, job.engine_finish or "length", None)
            return
        slot = self.slots[req.model]
        req.phase = Phase.RUNNING
        req.kv_resident = True  # its KV lives in the engine while it streams (as the simulator marks it)
        if req.first_scheduled_at is None:
            req.first_scheduled_at = now
            job.first_prediction = req.predicted_remaining
            self.metrics.queue_wait.labels(req.model, job.class_name).observe(now - req.arrival)
        self.inflight[job] = None
        if not slot.inflight:
            slot.busy_since = now
        if not self._in_engine(self._engine_of(req.model)):
            self._busy_engines += 1
        slot.inflight[job] = None
        slot.running[job.class_name] += 1
        slot.tenant_running[job.class_name, req.tenant] += 1
        self._gauges(slot, job.class_name)
        engine_job = EngineJob(
            request_id=f"{req.id}-{job.streams}",
            prompt_ids=job.prompt_ids + job.output_ids,
            max_tokens=req.max_tokens - req.generated,
            sampling=job.sampling,
        )
        job.streams += 1
        job.task = asyncio.create_task(
            self._drive(slot, job, engine_job), name=f"stream-{engine_job.request_id}"
        )

    async def _drive(self, slot: EngineSlot, job: Job, engine_job: EngineJob) -> None:
        finish: str | None = None
        try:
            gen = slot.engine.stream(engine_job)
            try:
                async for delta in gen:
                    # A preempted stream's cancellation lands at its next real suspension; tokens
                    # already buffered before that belong to no one (the resumed stream redoes them).
                    if job.task is not asyncio.current_task():
                        return
                    self._on_tokens(job, delta)
                    finish = delta.finish_reason or finish
            finally:
                await gen.aclose()
        except EngineError as exc:
            if job.task is not asyncio.current_task():
                return
            if isinstance(exc, EngineUnavailable):
                self._engine_down(slot)
            self._end(job, None, exc)
            return
        if job.task is asyncio.current_task():
            self._end(job, finish or "stop", None)

    def _on_tokens(self, job: Job, delta: TokenDelta) -> None:
        n = len(delta.token_ids)
        if n == 0:
            if delta.text:
                job.events.put_nowait(delta)
            return
        now = self.clock()
        req = job.req
        labels = (req.model, job.class_name)
        if job.last_token_at is None:
            self.metrics.ttft.labels(*labels).observe(now - req.arrival)
            if req.first_scheduled_at is not None:
                self.metrics.engine_ttft.labels(req.model).observe(now - req.first_scheduled_at)
        else:
            itl = self._itl_hist.get(labels)
            if itl is None:  # a labels() lookup per token costs more than the rest of this method
                itl = self._itl_hist[labels] = self.metrics.itl.labels(*labels)
            itl.observe(now - job.last_token_at)
        for _ in range(n):
            req.tokens.append(now)
        req.generated += n
        if delta.text:  # the text so far: length predictors re-predict from it (ELIS)
            req.response_text = (req.response_text or "") + delta.text
        job.output_ids.extend(delta.token_ids)
        job.last_token_at = now
        job.engine_finish = delta.finish_reason
        stopped = False
        if job.stops and req.generated >= job.sampling.get("min_tokens", 0):
            delta, stopped = _match_stops(job, delta)
        job.events.put_nowait(delta)
        if stopped:  # ends the job; its stream closes (aborted in the engine) at its next step
            self._end(job, "stop", None)
            return
        # Instance iterations, as the simulator counts them: one step of every busy engine (each of an
        # engine's in-flight streams gets a token a step; with one model, the engine's own steps).
        iters = n / max(1, self._in_engine(self._engine_of(req.model)) * self._busy_engines)
        self._iters += iters
        self._iterations += iters
        if self._recheck_tokens is not None and self._iters >= self._recheck_tokens:
            self._recheck_tokens = None
            self._wake.set()

    def _leave(self, job: Job, now: float) -> EngineSlot:
        """Take ``job`` out of the in-flight sets (it was in flight); its engine's busy time is counted
        when the engine goes idle."""
        slot = self.slots[job.req.model]
        del self.inflight[job]
        del slot.inflight[job]
        slot.running[job.class_name] -= 1
        slot.tenant_running[job.class_name, job.req.tenant] -= 1
        if not self._in_engine(self._engine_of(job.req.model)):
            self._busy_engines -= 1
        if not slot.inflight and slot.busy_since is not None:
            self.metrics.engine_busy.labels(slot.model).inc(max(0.0, now - slot.busy_since))
            slot.busy_since = None
        return slot

    def _preempt(self, job: Job, now: float) -> None:
        slot = self._leave(job, now)
        if job.task is not None:
            job.task.cancel()
            job.task = None
        job.req.phase = Phase.PREEMPTED
        job.req.kv_resident = False  # aborted: it resumes by recompute
        job.req.preemptions += 1
        self.metrics.preemptions.labels(job.req.model, job.class_name).inc()
        self._gauges(slot, job.class_name)

    def _end(self, job: Job, finish_reason: str | None, error: EngineError | None) -> None:
        if job.done.is_set():
            return
        now = self.clock()
        req = job.req
        cls = job.class_name
        slot = self._leave(job, now) if job in self.inflight else self.slots[req.model]
        if job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()
        job.task = None
        req.phase = Phase.FINISHED
        req.kv_resident = False
        req.finished_at = now
        self.policy.remove(req, now)
        del self.jobs[req]
        slot.live[cls] -= 1
        key = (cls, req.tenant)
        slot.tenant_live[key] -= 1
        if not slot.tenant_live[key]:  # tenants come and go: keep only those with requests here
            del slot.tenant_live[key], slot.tenant_running[key]
            if all(t != req.tenant for _, t in slot.tenant_live):
                del slot.tenant_weights[req.tenant]
        job.finish_reason = finish_reason
        job.error = error
        if error is None and finish_reason != "cancelled":
            self._completions.append(now)
            self._record_finished(job, now)
        elif isinstance(error, QueueTimeout):
            self.metrics.rejected.labels(req.model, cls, "queue_timeout").inc()
        elif error is not None:
            self.metrics.failed.labels(req.model, cls).inc()
        self._gauges(slot, cls)
        job.events.put_nowait(None)
        job.done.set()
        self._wake.set()

    def _record_finished(self, job: Job, now: float) -> None:
        req = job.req
        labels = (req.model, job.class_name)
        self.metrics.e2e.labels(*labels).observe(now - req.arrival)
        self.metrics.prompt_tokens.labels(*labels).inc(req.prompt_tokens)
        if req.generated:
            self.metrics.qoe.labels(*labels).observe(request_qoe(req))
        if job.first_prediction is not None and req.first_scheduled_at is not None:
            self.metrics.predictor_error.labels(*labels).observe(abs(job.first_prediction - req.generated))
        met = slo_met(req)
        if met is not None:  # a class without an SLO counts in neither
            (self.metrics.slo_met if met else self.metrics.slo_missed).labels(*labels).inc()

    # ---------------------------------------------------------------- engine stats

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            for slot in self.slots.values():
                if slot.ok and slot.model not in self.adapter_of:  # an adapter's server is its base's
                    await self._read_stats(slot)

    async def _read_stats(self, slot: EngineSlot) -> None:
        """Ask the engine for its KV cache and request counts; without them, fall back (said once)."""
        model = slot.model
        try:
            stats = await slot.engine.stats()
        except EngineUnavailable:
            return  # the health probe deals with it; the last report stands meanwhile
        except Exception:  # a malformed report must not stop the poll; said once, as a fallback
            if slot.reports is not False:
                log.exception("reading the engine stats of model %s failed", model)
            stats = None
        reports = stats is not None
        if reports != slot.reports:
            configured = slot.configured_profile.kv_capacity_tokens
            if stats is None:
                log.warning("the engine of model %s reports no KV cache figures; policies see the "
                            "configured kvCapacityTokens %d", model, configured)  # fmt: skip
            else:
                log.info("the engine of model %s reports a KV cache of %d tokens in blocks of %d "
                         "(configured: %d)", model, stats.kv_capacity_tokens, stats.block_size,
                         configured)  # fmt: skip
            slot.reports = reports
        capacity_before = slot.profile.kv_capacity_tokens
        slot.apply_stats(stats)
        m = self.metrics
        m.engine_stats_fallback.labels(model).set(0 if reports else 1)
        m.engine_kv_capacity.labels(model).set(kv_capacity_whole_blocks(slot.profile))
        if stats is not None:
            m.engine_kv_used.labels(model).set(stats.kv_used_tokens)
            m.engine_running.labels(model).set(stats.running)
            m.engine_waiting.labels(model).set(stats.waiting)
            if stats.started_at is not None:
                m.engine_start_time.labels(model).set(stats.started_at)
        if slot.profile.kv_capacity_tokens != capacity_before:
            self._wake.set()  # the policy may admit more (or must admit less) now

    # ---------------------------------------------------------------- health

    def _engine_down(self, slot: EngineSlot) -> None:
        if slot.ok:
            slot.ok = False
            self._start_probe(slot)

    def _start_probe(self, slot: EngineSlot) -> None:
        if slot.probe_task is None or slot.probe_task.done():
            slot.probe_task = asyncio.create_task(self._probe(slot), name=f"probe-{slot.model}")

    async def _probe(self, slot: EngineSlot) -> None:
        while not await slot.engine.healthy():
            await asyncio.sleep(PROBE_INTERVAL_S)
        slot.ok = True
        self._wake.set()

    # ---------------------------------------------------------------- helpers

    def _gauge_batch(self) -> None:
        size = self.batch_size
        for model in self.slots:
            self.metrics.batch_size.labels(model).set(size)

    def _gauges(self, slot: EngineSlot, cls: str) -> None:
        labels = (slot.model, cls)
        self.metrics.inflight.labels(*labels).set(slot.running[cls])
        self.metrics.queue_length.labels(*labels).set(slot.live[cls] - slot.running[cls])
        base = self.adapter_of.get(slot.model)
        if base is not None:
            self.metrics.lora_requests.labels(slot.model, base, "running").set(len(slot.inflight))
            self.metrics.lora_requests.labels(slot.model, base, "waiting").set(slot.waiting)

    def _retry_after(self, excess: int) -> int:
        """Seconds until ``excess`` more requests will have completed at the recent completion rate."""
        if len(self._completions) >= 2:
            span = self._completions[-1] - self._completions[0]
            rate = (len(self._completions) - 1) / span if span > 0 else 0.0
            if rate > 0:
                return min(60, max(1, math.ceil(excess / rate)))
        return 1


def _match_stops(job: Job, delta: TokenDelta) -> tuple[TokenDelta, bool]:
    """The delta's text with vLLM's stop-string rules applied over the whole output: text up to
    (excluding) the first stop string, and whether one was found; the last ``len(stop) - 1``
    characters are withheld until they cannot start a stop string (flushed at the end)."""
    text = job.held + delta.text
    hits = [i for i in (text.find(s) for s in job.stops) if i >= 0]
    if hits:
        job.held = ""
        return replace(delta, text=text[: min(hits)], finish_reason="stop"), True
    if delta.finish_reason is not None:
        job.held = ""
        return replace(delta, text=text), False
    keep = max(len(s) for s in job.stops) - 1
    cut = max(0, len(text) - keep)
    job.held = text[cut:]
    return replace(delta, text=text[:cut]), False
