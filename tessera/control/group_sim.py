"""Discrete-event simulator of SeaLLM sharing groups (SeaLLM §3-§4; docs/papers.md, "SeaLLM").

One group = one engine on ``tp`` GPUs hosting one or more services. Each iteration runs **one service in
one phase** (temporal sharing): a prefill batch (prompts up to the token budget) or a decode batch.
The co-located services share one KV pool (unified KV cache, accounted in bytes per GPU): every model's
weights stay resident and a request's KV stays in the pool while other services' iterations run, so
switching models between iterations costs nothing but the sharing overhead ε_share. Schedulers:

- ``db``: SeaLLM's doubling budget (the worker policy's ``DBBook``), starvation first;
- ``fcfs``: the oldest request picks the service and phase (AlpaServe-port order, head-of-line blocking);
- ``vllm``: vLLM's continuous batching: prefill first (oldest waiting request, when its prompt fits the
  KV pool), otherwise decode every resident request; FCFS order; preempts the newest (the vLLM baseline);
- ``rr``: services take turns iteration by iteration, vLLM order inside a service (round-robin sharing).

Decode runs advance ``chunk`` iterations at a time in closed form (CHOICE: 8; scheduling decisions are
taken every ``chunk`` decode iterations, so cost grows with events, not tokens).

``GroupEngine`` is the steppable engine (requests can be submitted at any time, and taken out for
migration); ``simulate_group`` replays a fixed request list on one group. Requests left at a ``horizon``
are censored as in SeaLLM's unserved index: ``L_r = horizon − a_r + exec_ref(r)``. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tessera.core.planners.types import HistoryRequest, PoolInput, ServiceInput
from tessera.core.policies.seallm import Budget, DBBook, ServiceStats

Scheduler = Literal["db", "fcfs", "vllm", "rr"]
SCHEDULERS: tuple[Scheduler, ...] = ("db", "fcfs", "vllm", "rr")
SHARING_OVERHEAD = 0.04  # ε_share: iteration time x (1 + ε) when several models share the group (CHOICE)
PREFILL_WATERMARK = 0.99  # DB's admission test (CHOICE): keep 1 % of the KV pool free when admitting prefills


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request as the group simulator tracks it (its progress survives migration between groups)."""

    service: str
    arrival: float
    prompt: int
    output: int
    exec_ref: float  # isolated execution time at the service's reference TP (SLO and censoring)
    seq: int
    generated: int = 0
    resident: bool = False  # KV (prompt + generated) held
    first_token: float | None = None
    finished: float | None = None
    budget: Budget | None = None
    ver: int = 0  # bumped when the request leaves or re-enters the waiting heaps (lazy deletion)
    rejected: bool = False  # no KV pool it was sent to could hold it: never served (an SLO miss)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's result: its service, latency (censored if unfinished), SLO met, TTFT."""

    service: str
    arrival: float
    latency: float
    norm_latency: float
    slo_met: bool
    ttft: float | None
    finished: bool


@dataclass(slots=True)
class GroupResult:
    """Outcomes of one group's simulation."""

    outcomes: list[RequestOutcome] = field(default_factory=list)
    preemptions: int = 0
    iterations: int = 0


def kv_capacity_bytes(pool: PoolInput, services: Sequence[ServiceInput], tp: int) -> float:
    """Per-GPU bytes of the unified KV pool: γ·M − Σ W/p − max A (SeaLLM §4.4)."""
    return (
        pool.memory_fraction * pool.gpu_memory_bytes
        - sum(s.weights_bytes for s in services) / tp
        - pool.activation_bytes_per_gpu
    )


def service_stats(services: Sequence[ServiceInput]) -> dict[str, ServiceStats]:
    """DB statistics from each service's history at its reference TP (L̂_s, std, θ_s = 0.5·SLO_s)."""
    out = {}
    for s in services:
        out[s.name] = stats_of(s, [(h.prompt_tokens, h.output_tokens) for h in s.history])
    return out


def stats_of(s: ServiceInput, lengths: Sequence[tuple[int, int]]) -> ServiceStats:
    """L̂_s and Var_s (std) of isolated execution time at tp_min over ``lengths`` (prompt, output);
    the service's mean lengths when empty. Starvation threshold θ_s = 0.5·SLO_s (CHOICE)."""
    if lengths:
        execs = [s.profile.at_tp(s.tp_min).exec_time(p, max(1, o)) for p, o in lengths]
        mean = sum(execs) / len(execs)
        std = math.sqrt(sum((e - mean) ** 2 for e in execs) / len(execs))
    else:
        mean, std = s.mean_exec_s(), 0.0
    return ServiceStats(mean_exec_s=mean, std_exec_s=std, starvation_s=0.5 * s.slo_scale * mean)


def make_request(s: ServiceInput, h: HistoryRequest, seq: int) -> SimRequest:
    """A fresh simulator request of service ``s``."""
    out = max(1, h.output_tokens)
    return SimRequest(
        s.name,
        h.arrival,
        h.prompt_tokens,
        out,
        s.profile.at_tp(s.tp_min).exec_time(h.prompt_tokens, out),
        seq,
    )


def outcome(r: SimRequest, stats: ServiceStats, slo_scale: float, end: float) -> RequestOutcome:
    """The request's outcome; an unfinished one is censored at ``end``: ``end − a_r + exec_ref(r)``."""
    lat = r.finished - r.arrival if r.finished is not None else max(end, r.arrival) - r.arrival + r.exec_ref
    return RequestOutcome(
        service=r.service,
        arrival=r.arrival,
        latency=lat,
        norm_latency=lat / stats.mean_exec_s,
        slo_met=r.finished is not None and lat <= slo_scale * r.exec_ref,
        ttft=None if r.first_token is None else r.first_token - r.arrival,
        finished=r.finished is not None,
    )


class GroupEngine:
    """One sharing group's engine, advanced one scheduling decision (one iteration or decode chunk) at a
    time. ``now`` is the end of the last iteration (or the time the group becomes ready)."""

    def __init__(
        self,
        pool: PoolInput,
        services: Sequence[ServiceInput],
        tp: int,
        *,
        stats: dict[str, ServiceStats],
        scheduler: Scheduler = "db",
        start: float = 0.0,
        chunk: int = 8,
        max_batch: int = 256,
        token_budget: int = 8192,
    ) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown group scheduler {scheduler!r}; use one of {SCHEDULERS}")
        if chunk < 1 or max_batch < 1 or token_budget < 1:
            raise ValueError("chunk, max_batch and token_budget must be >= 1")
        self.by_name = {s.name: s for s in services}
        self.names = [s.name for s in services]
        self.tp = tp
        self.profiles = {s.name: s.profile.at_tp(tp) for s in services}
        self.scheduler = scheduler
        self.book = DBBook(stats)
        self.capacity = kv_capacity_bytes(pool, services, tp)
        if self.capacity <= 0:
            raise ValueError(f"services {sorted(self.by_name)} leave no KV memory on a TP{tp} group")
        self.kv_per_token = {n: s.kv_bytes_per_token / tp for n, s in self.by_name.items()}
        self.overhead = 1 + SHARING_OVERHEAD if len(services) > 1 else 1.0
        self.chunk, self.max_batch, self.token_budget = chunk, max_batch, token_budget
        self.now = start
        self.used = 0.0
        self.active = 0
        self.preemptions = 0
        self.iterations = 0
        self.rejected = 0  # requests the KV pool cannot hold (see ``submit``)
        self._waiting: dict[str, list[tuple[tuple, int, SimRequest]]] = {n: [] for n in self.names}
        self._starve: dict[str, list[tuple[float, int, int, SimRequest]]] = {n: [] for n in self.names}
        self._resident: dict[str, list[SimRequest]] = {n: [] for n in self.names}
        self._members: dict[SimRequest, None] = {}  # unfinished requests held, in submission order
        self._rr_turn = 0

    # --- queues ---
    def _prio(self, r: SimRequest) -> tuple:
        if self.scheduler == "db":
            return (self.book.priority(r.service, r.budget), r.arrival, r.seq)
        return (r.arrival, r.seq)

    def _enqueue(self, r: SimRequest) -> None:
        # A waiting request's key is fixed: only running requests are charged.
        r.ver += 1
        heapq.heappush(self._waiting[r.service], (self._prio(r), r.ver, r))
        if self.scheduler == "db":
            heapq.heappush(self._starve[r.service], (r.budget.last_run, r.seq, r.ver, r))

    def _head(self, n: str) -> SimRequest | None:
        h = self._waiting[n]
        while h and (h[0][2].resident or h[0][2].finished is not None or h[0][1] != h[0][2].ver):
            heapq.heappop(h)
        return h[0][2] if h else None

    def _starved_head(self, n: str) -> SimRequest | None:
        h = self._starve[n]
        while h and (h[0][3].resident or h[0][3].finished is not None or h[0][2] != h[0][3].ver):
            heapq.heappop(h)
        return h[0][3] if h else None

    def _evict(self, target: float, keep: set) -> None:
        """Recompute-preempt resident requests, largest priority key first, outside ``keep`` (CHOICE)."""
        victims = sorted(
            (r for n in self.names for r in self._resident[n] if r not in keep), key=self._prio, reverse=True
        )
        for r in victims:
            if self.used <= target:
                break
            self._preempt(r)

    def _preempt(self, r: SimRequest) -> None:
        """Free ``r``'s KV and queue it again with its progress (recompute preemption)."""
        self._resident[r.service].remove(r)
        r.resident = False
        self.used -= self._kv(r)
        self.preemptions += 1
        self._enqueue(r)

    # --- public interface ---
    @property
    def outstanding(self) -> int:
        """Requests queued or running here (the dispatcher's load measure, SeaLLM §3)."""
        return self.active

    def _kv(self, r: SimRequest) -> float:
        """KV bytes of ``r``'s prompt and progress."""
        return (r.prompt + r.generated) * self.kv_per_token[r.service]

    def _fits_now(self, r: SimRequest) -> bool:
        """Whether a prefill of ``r`` fits the free KV now (below the prefill watermark)."""
        return self.used + self._kv(r) <= self.capacity * PREFILL_WATERMARK

    def holds(self, r: SimRequest) -> bool:
        """Whether the KV pool, emptied of everything else, can hold ``r``'s prompt and progress."""
        return self._kv(r) <= self.capacity * PREFILL_WATERMARK

    def submit(self, r: SimRequest) -> None:
        """Queue ``r`` (new, or migrated with its progress and budget); it runs from the next decision.
        A request the pool cannot hold is rejected, as vLLM refuses a prompt its KV cache cannot
        hold: it is marked, counted in ``rejected`` and never served (its outcome is an SLO miss
        with SeaLLM's censored latency)."""
        if r.service not in self.by_name:
            raise ValueError(f"group of {self.names} does not host service {r.service!r}")
        if not self.holds(r):
            r.rejected = True
            self.rejected += 1
            return
        if not self.active:
            self.now = max(self.now, r.arrival)
        if self.scheduler == "db" and r.budget is None:
            r.budget = self.book.start(r.service, r.arrival)
        self._enqueue(r)
        self._members[r] = None
        self.active += 1

    def run_until(self, t: float) -> list[SimRequest]:
        """Run decisions that start before ``t``; returns the requests that finished."""
        done: list[SimRequest] = []
        while self.active and self.now < t:
            done.extend(self.step(t))
        return done

    def evacuate(self) -> list[SimRequest]:
        """Take every unfinished request out (group stopped for re-placement): KV freed, progress kept; the
        caller re-dispatches them (their KV is recomputed where they land: TP and block shape may differ)."""
        out = [r for r in self._members if r.finished is None]
        for r in out:
            r.resident = False
            r.ver += 1
        self._members.clear()
        for n in self.names:
            self._waiting[n].clear()
            self._starve[n].clear()
            self._resident[n].clear()
        self.used = 0.0
        self.active = 0
        return out

    def _pick_seed(self) -> SimRequest:
        names, res = self.names, self._resident
        if self.scheduler == "rr":
            while True:
                service = names[self._rr_turn % len(names)]
                self._rr_turn += 1
                seed = self._vllm_seed([service])
                if seed is not None:
                    return seed
        if self.scheduler == "vllm":
            seed = self._vllm_seed(names)
            assert seed is not None
            return seed
        if self.scheduler == "db":
            cands = [x for n in names if (x := self._starved_head(n)) is not None]
            cands += [x for n in names for x in res[n]]
            cands = [x for x in cands if self.book.starved(x.service, x.budget, self.now)]
            if cands:
                return self._admissible(min(cands, key=lambda x: (x.budget.last_run, x.seq)))
        cands = [x for n in names if (x := self._head(n)) is not None]
        cands += [min(res[n], key=self._prio) for n in names if res[n]]
        return self._admissible(min(cands, key=self._prio))

    def _admissible(self, seed: SimRequest) -> SimRequest:
        """``seed``, or a resident request to decode when ``seed`` is a prefill that does not fit the free
        KV slots: prefills are admitted only into free slots (CHOICE); evicting residents for a
        prefill would let requests whose priorities cross evict each other without end."""
        if seed.resident:
            return seed
        if self._fits_now(seed):
            return seed
        # Decode the seed's own service when it has residents (their finishes free the slots the seed
        # needs), else the best resident of any service.
        running = self._resident[seed.service] or [r for n in self.names for r in self._resident[n]]
        return min(running, key=self._prio) if running else seed

    def _vllm_seed(self, names: Iterable[str]) -> SimRequest | None:
        """vLLM order over ``names``: the oldest waiting request if its prompt fits (or nothing in the
        group runs), else the oldest resident request of ``names`` (a decode), else None. A prefill
        that does not fit waits while *any* service holds KV: with round-robin turns, letting a
        service without residents evict the other's made two requests that cannot co-reside evict
        each other without end (seen: 12M preemptions of one 75k-token prompt)."""
        names = list(names)
        heads = [x for n in names if (x := self._head(n)) is not None]
        running = [r for n in names for r in self._resident[n]]
        if heads:
            seed = min(heads, key=self._prio)
            idle = not any(self._resident[n] for n in self.names)
            if idle or self._fits_now(seed):
                return seed
        return min(running, key=self._prio) if running else None

    def _decode_run(self, batch: list[SimRequest], until: float) -> int:
        """How many decode iterations to run before the next decision. Decisions can only change at a
        finish, at a submission (``until``), when the free KV runs out, and under DB when a running budget
        runs out or a waiting request starves (running budgets only shrink, so the batch keeps winning
        until then); ``rr`` alternates services every ``chunk`` iterations."""
        k = min(r.output - r.generated for r in batch)
        others = len(batch) < self.active
        if self.scheduler == "rr" and others:
            return min(k, self.chunk)
        span = until - self.now
        if self.scheduler == "db" and others:
            span = min(span, min(r.budget.left for r in batch))
            # The earliest starvation among the others: heads of the waiting heaps (by last run) and the
            # residents left out.
            running = set(batch)
            outside = [h for n in self.names if (h := self._starved_head(n)) is not None]
            outside += [r for n in self.names for r in self._resident[n] if r not in running]
            waits = [r.budget.last_run + self.book.stats[r.service].starvation_s - self.now for r in outside]
            if waits and min(waits) <= 0:
                # Someone is starved: this batch may have been picked for starvation (or as the fallback
                # of a starved prefill that does not fit), which running clears, so decide again soon.
                return min(k, self.chunk)
            if waits:
                span = min(span, min(waits))
        if math.isfinite(span):
            step0 = self.overhead * self.profiles[batch[0].service].decode_step(len(batch), 0)
            k = min(k, max(1, math.ceil(span / step0)))
        grow = self.kv_per_token[batch[0].service] * len(batch)
        if self.used + grow * k > self.capacity:
            k = max(1, min(k, int((self.capacity - self.used) / grow)))
        return k

    def step(self, until: float = math.inf) -> list[SimRequest]:
        """One scheduling decision and its iteration (a prefill, or up to ``chunk`` decodes); returns the
        finished requests. Decodes run on in closed form until the next time a decision can differ
        (``_decode_run``); ``until`` is the next time something may be submitted."""
        seed = self._pick_seed()
        service = seed.service
        kvt = self.kv_per_token[service]
        lat = self.profiles[service]
        res = self._resident[service]
        cap = self.capacity
        if not seed.resident:
            # prefill batch: the seed, then the service's other waiting requests in priority order
            batch, tokens = [], 0
            seed.ver += 1  # leaves the waiting heaps
            r: SimRequest | None = seed
            while r is not None:
                ctx = r.prompt + r.generated
                if batch and (tokens + ctx > self.token_budget or len(batch) >= self.max_batch):
                    break
                if self.used + ctx * kvt > cap * PREFILL_WATERMARK:
                    if batch:
                        break
                    self._evict(cap * PREFILL_WATERMARK - ctx * kvt, {seed})
                    if self.used + ctx * kvt > cap * PREFILL_WATERMARK:
                        raise ValueError(
                            f"a {seed.prompt}-token prompt of {service} does not fit the KV pool"
                        )
                batch.append(r)
                r.resident = True
                r.ver += 1
                tokens += ctx
                self.used += ctx * kvt
                r = self._head(service)
            dt = lat.prefill(tokens) * self.overhead
            self.now += dt
            self.iterations += 1
            for r in batch:
                res.append(r)
                if r.first_token is None:
                    r.first_token = self.now
                if r.generated == 0:
                    r.generated = 1
                    self.used += kvt
                if r.budget is not None:
                    self.book.charge(r.service, r.budget, dt, self.now)
        else:
            batch = sorted(res, key=self._prio)[: self.max_batch]
            k = self._decode_run(batch, until)
            if self.used + kvt * k * len(batch) > cap:
                self._evict(cap - kvt * k * len(batch), set(batch))
                while len(batch) > 1 and self.used + kvt * k * len(batch) > cap:
                    # still no room: preempt (recompute) from the batch's low-priority end (CHOICE);
                    # merely leaving it out would keep its KV and starve the pool
                    self._preempt(batch.pop())
            b = len(batch)
            ctx = sum(r.prompt + r.generated for r in batch)
            a = lat.decode_step(b, ctx)
            g = lat.decode_step(b, ctx + b) - a
            dt = (k * a + g * k * (k - 1) / 2) * self.overhead
            self.now += dt
            self.iterations += k
            for r in batch:
                r.generated += k
                if r.budget is not None:
                    self.book.charge(r.service, r.budget, dt, self.now)
            self.used += kvt * k * b
        done = [x for x in batch if x.generated >= x.output]
        for r in done:
            r.finished = self.now
            r.resident = False
            res.remove(r)
            self._members.pop(r, None)
            self.used -= (r.prompt + r.generated) * kvt
            self.active -= 1
        return done


def simulate_group(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    tp: int,
    requests: Sequence[tuple[str, HistoryRequest]],
    *,
    scheduler: Scheduler = "db",
    horizon: float,
    stats: dict[str, ServiceStats] | None = None,
    chunk: int = 8,
    max_batch: int = 256,
    token_budget: int = 8192,
) -> GroupResult:
    """Serve ``requests`` (service name, request) on one group until ``horizon``; return their outcomes."""
    by_name = {s.name: s for s in services}
    stats = stats or service_stats(services)
    eng = GroupEngine(
        pool,
        services,
        tp,
        stats=stats,
        scheduler=scheduler,
        chunk=chunk,
        max_batch=max_batch,
        token_budget=token_budget,
    )
    reqs = sorted(
        (make_request(by_name[n], h, i) for i, (n, h) in enumerate(requests)),
        key=lambda r: (r.arrival, r.seq),
    )
    for r in reqs:
        eng.run_until(min(r.arrival, horizon))
        eng.submit(r)
    eng.run_until(horizon)
    end = max(horizon, eng.now) if math.isfinite(horizon) else eng.now
    result = GroupResult(preemptions=eng.preemptions, iterations=eng.iterations)
    result.outcomes = [outcome(r, stats[r.service], by_name[r.service].slo_scale, end) for r in reqs]
    return result
