"""Discrete-event simulator of SeaLLM sharing groups (seallm_spec §4, §5, §8, §9.1).

One group = one engine on ``tp`` GPUs hosting one or more services. Each iteration runs **one service in
one phase** (temporal sharing): a prefill batch (prompts up to the token budget) or a decode batch.
The co-located services share one KV pool (unified KV cache, accounted in bytes per GPU). Schedulers:

- ``db``: SeaLLM's doubling budget (the worker policy's ``DBBook``), starvation first;
- ``fcfs``: the oldest request picks the service and phase (AlpaServe-port / vLLM order);
- ``rr``: services take turns iteration by iteration, FCFS inside a service (round-robin sharing).

Decode runs advance ``chunk`` iterations at a time in closed form (CHOICE: 8; scheduling decisions are
taken every ``chunk`` decode iterations, so cost grows with events, not tokens). Requests left at
``horizon`` are censored as in spec §6.2: ``L_r = horizon − a_r + exec_ref(r)``. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tessera.operator.planners.types import HistoryRequest, PoolInput, ServiceInput
from tessera.worker.policies.seallm import Budget, DBBook, ServiceStats

Scheduler = Literal["db", "fcfs", "rr"]
SHARING_OVERHEAD = 0.04  # ε_share: iteration time x (1 + ε) when several models share the group (§9.1)


@dataclass(slots=True, eq=False)
class _Req:
    service: str
    arrival: float
    prompt: int
    output: int
    exec_ref: float
    seq: int
    generated: int = 0
    resident: bool = False  # KV (prompt + generated) held
    first_token: float | None = None
    finished: float | None = None
    budget: Budget | None = None
    ver: int = 0  # bumped when the request leaves or re-enters the waiting heaps (lazy deletion)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's result: its service, latency (censored if unfinished), SLO met, TTFT."""

    service: str
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
    """Per-GPU bytes of the unified KV pool: γ·M − Σ W/p − max A (spec §8 item 4)."""
    return (
        pool.memory_fraction * pool.gpu_memory_bytes
        - sum(s.weights_bytes for s in services) / tp
        - pool.activation_bytes_per_gpu
    )


def service_stats(services: Sequence[ServiceInput]) -> dict[str, ServiceStats]:
    """DB statistics from each service's history at its reference TP (L̂_s, std, θ_s = 0.5·SLO_s)."""
    out = {}
    for s in services:
        if s.history:
            execs = [s.latency.exec_time(s.tp_min, h.prompt_tokens, h.output_tokens) for h in s.history]
            mean = sum(execs) / len(execs)
            std = math.sqrt(sum((e - mean) ** 2 for e in execs) / len(execs))
        else:
            mean, std = s.mean_exec_s(), 0.0
        out[s.name] = ServiceStats(mean_exec_s=mean, std_exec_s=std, starvation_s=0.5 * s.slo_scale * mean)
    return out


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
    book = DBBook(stats)
    capacity = kv_capacity_bytes(pool, services, tp)
    if capacity <= 0:
        raise ValueError(f"services {sorted(by_name)} leave no KV memory on a TP{tp} group")
    kv_per_token = {n: s.kv_bytes_per_token / tp for n, s in by_name.items()}
    overhead = 1 + SHARING_OVERHEAD if len(services) > 1 else 1.0
    reqs = sorted(
        (
            _Req(
                n,
                h.arrival,
                h.prompt_tokens,
                max(1, h.output_tokens),
                by_name[n].latency.exec_time(by_name[n].tp_min, h.prompt_tokens, max(1, h.output_tokens)),
                i,
            )
            for i, (n, h) in enumerate(requests)
        ),
        key=lambda r: (r.arrival, r.seq),
    )
    result = GroupResult()
    names = [s.name for s in services]
    waiting: dict[str, list[tuple[tuple, int, _Req]]] = {n: [] for n in names}  # lazy heaps by priority
    starve: dict[str, list[tuple[float, int, int, _Req]]] = {n: [] for n in names}  # lazy heaps by last run
    resident: dict[str, list[_Req]] = {n: [] for n in names}
    n_active = 0
    used = 0.0
    nxt = 0
    now = 0.0
    rr_turn = 0

    def prio(r: _Req) -> tuple:
        if scheduler == "db":
            return (book.priority(r.service, r.budget), r.arrival, r.seq)
        return (r.arrival, r.seq)

    def enqueue(r: _Req) -> None:
        # A waiting request's key is fixed: only running requests are charged.
        r.ver += 1
        heapq.heappush(waiting[r.service], (prio(r), r.ver, r))
        if scheduler == "db":
            heapq.heappush(starve[r.service], (r.budget.last_run, r.seq, r.ver, r))

    def head(n: str) -> _Req | None:
        h = waiting[n]
        while h and (h[0][2].resident or h[0][2].finished is not None or h[0][1] != h[0][2].ver):
            heapq.heappop(h)
        return h[0][2] if h else None

    def starved_head(n: str) -> _Req | None:
        h = starve[n]
        while h and (h[0][3].resident or h[0][3].finished is not None or h[0][2] != h[0][3].ver):
            heapq.heappop(h)
        return h[0][3] if h else None

    def evict(target: float, keep: set) -> None:
        """Recompute-preempt resident requests, largest O first, outside ``keep`` (spec §8 item 8)."""
        nonlocal used
        victims = sorted((r for n in names for r in resident[n] if r not in keep), key=prio, reverse=True)
        for r in victims:
            if used <= target:
                break
            resident[r.service].remove(r)
            r.resident = False
            used -= (r.prompt + r.generated) * kv_per_token[r.service]
            result.preemptions += 1
            enqueue(r)

    while nxt < len(reqs) or n_active:
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            if scheduler == "db":
                r.budget = book.start(r.service, r.arrival)
            enqueue(r)
            n_active += 1
            nxt += 1
        if not n_active:
            now = reqs[nxt].arrival
            continue
        if now >= horizon:
            break
        # --- pick the service and phase (one model, one phase per iteration) ---
        seed = None
        if scheduler == "rr":
            while True:
                service = names[rr_turn % len(names)]
                rr_turn += 1
                seed = head(service)  # vLLM order inside a service: prefill first
                if seed is None and resident[service]:
                    seed = min(resident[service], key=prio)
                if seed is not None:
                    break
        else:
            if scheduler == "db":
                cands = [x for n in names if (x := starved_head(n)) is not None]
                cands += [x for n in names for x in resident[n]]
                cands = [x for x in cands if book.starved(x.service, x.budget, now)]
                if cands:
                    seed = min(cands, key=lambda x: (x.budget.last_run, x.seq))
            if seed is None:
                cands = [x for n in names if (x := head(n)) is not None]
                cands += [min(resident[n], key=prio) for n in names if resident[n]]
                seed = min(cands, key=prio)
            service = seed.service
        kvt = kv_per_token[service]
        lat = by_name[service].latency
        if not seed.resident:
            # prefill batch: the seed, then the service's other waiting requests in priority order
            batch, tokens = [], 0
            seed.ver += 1  # leaves the waiting heaps
            r: _Req | None = seed
            while r is not None:
                ctx = r.prompt + r.generated
                if batch and (tokens + ctx > token_budget or len(batch) >= max_batch):
                    break
                if used + ctx * kvt > capacity * 0.99:
                    if batch:
                        break
                    evict(capacity * 0.99 - ctx * kvt, {seed})
                    if used + ctx * kvt > capacity * 0.99:
                        raise ValueError(
                            f"a {seed.prompt}-token prompt of {service} does not fit the KV pool"
                        )
                batch.append(r)
                r.resident = True
                tokens += ctx
                used += ctx * kvt
                r = head(service)
            dt = lat.prefill(tp, tokens) * overhead
            now += dt
            result.iterations += 1
            for r in batch:
                resident[service].append(r)
                if r.first_token is None:
                    r.first_token = now
                if r.generated == 0:
                    r.generated = 1
                    used += kvt
                if r.budget is not None:
                    book.charge(r.service, r.budget, dt, now)
        else:
            batch = sorted(resident[service], key=prio)[:max_batch]
            k = min(chunk, min(r.output - r.generated for r in batch))
            if used + kvt * k * len(batch) > capacity:
                evict(capacity - kvt * k * len(batch), set(batch))
                while len(batch) > 1 and used + kvt * k * len(batch) > capacity:
                    batch.pop()  # still no room: shrink the batch from its low-priority end
            b = len(batch)
            ctx = sum(r.prompt + r.generated for r in batch)
            a = lat.decode_step(tp, b, ctx)
            g = lat.decode_step(tp, b, ctx + b) - a
            dt = (k * a + g * k * (k - 1) / 2) * overhead
            now += dt
            result.iterations += k
            for r in batch:
                r.generated += k
                if r.budget is not None:
                    book.charge(r.service, r.budget, dt, now)
            used += kvt * k * b
        for r in [x for x in batch if x.generated >= x.output]:
            r.finished = now
            r.resident = False
            resident[service].remove(r)
            used -= (r.prompt + r.generated) * kvt
            n_active -= 1
    for r in reqs:
        svc = stats[r.service].mean_exec_s
        slo = by_name[r.service].slo_scale * r.exec_ref
        if r.finished is not None:
            lat_r = r.finished - r.arrival
        else:
            lat_r = max(horizon, now) - r.arrival + r.exec_ref
        result.outcomes.append(
            RequestOutcome(
                service=r.service,
                latency=lat_r,
                norm_latency=lat_r / svc,
                slo_met=r.finished is not None and lat_r <= slo,
                ttft=None if r.first_token is None else r.first_token - r.arrival,
                finished=r.finished is not None,
            )
        )
    return result
