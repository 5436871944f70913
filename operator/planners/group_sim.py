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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tessera.operator.planners.types import HistoryRequest, PoolInput, ServiceInput
from tessera.worker.policies.seallm import Budget, DBBook, ServiceStats

Scheduler = Literal["db", "fcfs", "rr"]
SHARING_OVERHEAD = 0.04  # ε_share: iteration time x (1 + ε) when several models share the group (§9.1)


@dataclass(slots=True)
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
    active: list[_Req] = []
    used = 0.0
    nxt = 0
    now = 0.0
    rr_turn = 0
    names = [s.name for s in services]

    def prio(r: _Req) -> tuple:
        if scheduler == "db":
            return (book.priority(r.service, r.budget), r.arrival, r.seq)
        return (r.arrival, r.seq)

    while nxt < len(reqs) or active:
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            if scheduler == "db":
                r.budget = book.start(r.service, r.arrival)
            active.append(r)
            nxt += 1
        if not active:
            now = reqs[nxt].arrival
            continue
        if now >= horizon:
            break
        # --- pick the service and phase ---
        if scheduler == "rr":
            live = {r.service for r in active}
            while names[rr_turn % len(names)] not in live:
                rr_turn += 1
            service = names[rr_turn % len(names)]
            rr_turn += 1
            mine = sorted((r for r in active if r.service == service), key=prio)
            seed = next((r for r in mine if not r.resident), mine[0])  # vLLM: prefill first
        else:
            seed = None
            if scheduler == "db":
                starved = [r for r in active if book.starved(r.service, r.budget, now)]
                if starved:
                    seed = min(starved, key=lambda r: (r.budget.last_run, r.seq))
            if seed is None:
                seed = min(active, key=prio)
            service = seed.service
            mine = sorted((r for r in active if r.service == service), key=prio)
        kvt = kv_per_token[service]
        lat = by_name[service].latency
        if not seed.resident:
            # prefill batch: the seed first, then the service's other non-resident requests in order
            batch, tokens = [], 0
            for r in [seed, *(x for x in mine if not x.resident and x is not seed)]:
                ctx = r.prompt + r.generated
                if batch and (tokens + ctx > token_budget or len(batch) >= max_batch):
                    break
                if used + ctx * kvt > capacity * 0.99:
                    if batch:
                        break
                    used = _evict(
                        active,
                        used,
                        kv_per_token,
                        capacity * 0.99 - ctx * kvt,
                        prio,
                        keep=seed,
                        result=result,
                    )
                    if used + ctx * kvt > capacity * 0.99:
                        break
                batch.append(r)
                tokens += ctx
                used += ctx * kvt
            if not batch:
                raise ValueError(f"a {seed.prompt}-token prompt of {service} does not fit the KV pool")
            dt = lat.prefill(tp, tokens) * overhead
            now += dt
            result.iterations += 1
            for r in batch:
                r.resident = True
                if r.first_token is None:
                    r.first_token = now
                if r.generated == 0:
                    r.generated = 1
                if r.budget is not None:
                    book.charge(r.service, r.budget, dt, now)
            _finish_done(batch, active, now, kv_per_token)
            used = sum((r.prompt + r.generated) * kv_per_token[r.service] for r in active if r.resident)
            continue
        batch = [r for r in mine if r.resident][:max_batch]
        k = min(chunk, min(r.output - r.generated for r in batch))
        need = sum(kvt * k for _ in batch)
        if used + need > capacity:
            used = _evict(
                active, used, kv_per_token, capacity - need, prio, keep_set=set(batch), result=result
            )
            if used + need > capacity:  # still no room: shrink the batch from its low-priority end
                while len(batch) > 1 and used + kvt * k * len(batch) > capacity:
                    batch.pop()
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
        used -= _finish_done(batch, active, now, kv_per_token)
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


def _finish_done(batch: list[_Req], active: list[_Req], now: float, kv_per_token: dict[str, float]) -> float:
    """Finish requests that produced all their tokens; return the KV bytes they free."""
    freed = 0.0
    done = [r for r in batch if r.generated >= r.output]
    for r in done:
        r.finished = now
        r.resident = False
        freed += (r.prompt + r.generated) * kv_per_token[r.service]
        active.remove(r)
    return freed


def _evict(
    active: list[_Req],
    used: float,
    kv_per_token: dict[str, float],
    target: float,
    prio,
    *,
    result: GroupResult,
    keep: _Req | None = None,
    keep_set: set | None = None,
) -> float:
    """Recompute-preempt the lowest-priority resident requests (largest O first, spec §8 item 8) until
    ``used <= target``; those outside ``keep_set`` go first."""
    keep_set = keep_set or set()
    victims = sorted(
        (r for r in active if r.resident and r is not keep),
        key=lambda r: (r not in keep_set, prio(r)),
        reverse=True,
    )
    for r in victims:
        if used <= target:
            break
        if r in keep_set:
            continue
        r.resident = False
        used -= (r.prompt + r.generated) * kv_per_token[r.service]
        result.preemptions += 1
    return used
