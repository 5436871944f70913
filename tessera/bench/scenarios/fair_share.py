"""Scenario ``fair-share``: one tenant floods, the other keeps its share (VTC, ``tessera.core.fair_share``).

Workload: two tenants of one interactive class (TTFT SLO ``ttft_slo``, default 2 s), lengths from the
Azure 2023 conversation trace (or ``--trace``: any trace of requests, see
``tessera.bench.runner.bench_trace``; its arrivals are not used). Tenant ``a`` sends ``requests``
(default 300) Poisson arrivals at its fair share, half the instance's measured capacity (``--load X``:
X × capacity instead, ``--rate R``: R requests/s); tenant ``b`` sends ``flood`` (default 10) times a's
rate over the same time, ``flood`` × as many requests, from the next rows of the trace. The instance
thus serves about twice a's load, while b alone asks five times what it can serve.

The instance's capacity (CHOICE ``capacity``): ``slo`` (default) is the load the instance serves
within the SLO, what a user means by "can serve": the largest rate at which FCFS, with a's requests
alone and a's arrival pattern, meets the TTFT SLO for at least ``capacity_attainment`` (0.99) of them
(``slo_capacity``: bisection, at most the saturated throughput); ``saturation`` is the throughput
with every request at once (FCFS, n / makespan), the harsher reading, under which a at half of it is
at the critical load of its half. The report's config carries both (``slo_capacity_rps``,
``saturation_rps``) and the one used (``capacity_rps``).

Rows (the inner policy ``policy``, default fcfs): ``<policy>:tenants=a`` (a alone),
``<policy>:tenants=a:half-batch`` (a alone with half the batch slots: a reference for a strict split of
the slots between the tenants, optimistic since b's prefills and fuller batches do not slow a's steps
here), ``<policy>:tenants=a+b`` (both, no fair share), ``<policy>:tenants=a+b:vtc`` (both, the policy
inside VTC with weights ``input_weight`` 1 and ``output_weight`` 2), ``<policy>:tenants=a+b:vtc+preempt``
(VTC with its ``preempt`` ablation), ``<policy>:tenants=a+b:vtc+credit`` (VTC whose lift leaves a
tenant with requests running up to ``lift_credit``, default 65536, below the least backlogged
counter: ``tessera.core.fair_share``; its bound is then 2U + the credit) and two references for what
any order of admissions can give a, FCFS within each tenant: ``tenants=a+b:a-first`` (a's requests
always admitted before b's, b filling every slot left: strict priority, no preemption) and
``tenants=a+b:a-first:b-half`` (the same, b never holding more than its half of the batch slots).
The contract's metrics are tenant a's; ``b_p99_ttft_s``,
``b_slo_attainment`` and ``b_output_tokens_per_s`` are b's. The VTC rows also report
``max_service_gap`` (the largest difference in weighted service between a and b over an interval both
were backlogged, at the wrapper's decision points) and ``vtc_bound`` (the paper's 2U: twice the largest
weighted tokens of one request), and where a's TTFT goes (means over a's requests, seconds):
``a_wait_order_s`` waiting while b was the least served tenant (behind b in VTC's order),
``a_wait_slot_s`` while a was the least served but the decision left no batch slot for it (b's running
requests, or a's own earlier ones, held them), ``a_wait_other_s`` the rest before it started (KV, VTC's
one admission at a time, the engine's next iteration boundary after its arrival) and ``a_prefill_s``
from its start to its first token; ``a_ahead_at_arrival``: the share of a's arrivals at which a's
counter (lifted) was above b's.

Checks: with VTC, a's TTFT p99 within ``ttft_factor`` (1.2) × alone and its SLO attainment within
``slo_points`` (3) points of alone; the same for every other row (the one without VTC is expected to
fail: the flood takes the queue); the service gap within the bound.

Options (``--set``): requests, flood, ttft_slo, policy, input_weight, output_weight, ttft_factor,
slo_points, capacity (slo, saturation), capacity_attainment, lift_credit, and the cluster options of
``tessera.bench.runner.CLUSTER_OPTIONS`` (max_batch default 32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tessera.bench.runner import AZURE_CONV, cluster_config_from, option, run_one, trace_requests
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import saturation_rate, slo_capacity
from tessera.core.baselines import FCFS
from tessera.core.fair_share import FairShare
from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import summarize
from tessera.sim.workloads import poisson_arrivals

DESCRIPTION = (
    "Two tenants of one class, a at its fair share and b at ten times it: a's TTFT and SLO alone, "
    "beside b, and beside b under VTC fair share; VTC's service gap against its bound"
)


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run tenant a alone, both tenants, and both under VTC, on the same requests."""
    opts = config.options
    n_a = option(opts, "requests", 300, int)
    flood = option(opts, "flood", 10.0, float)
    slo = option(opts, "ttft_slo", 2.0, float)
    inner = option(opts, "policy", "fcfs", str)
    w_in, w_out = option(opts, "input_weight", 1.0, float), option(opts, "output_weight", 2.0, float)
    factor, points = option(opts, "ttft_factor", 1.2, float), option(opts, "slo_points", 3.0, float)
    reading = option(opts, "capacity", "slo", str)
    attainment = option(opts, "capacity_attainment", 0.99, float)
    credit = option(opts, "lift_credit", 65536.0, float)
    if n_a < 2 or not flood > 0 or not slo > 0:
        raise ValueError(f"requests must be >= 2, flood and ttft_slo > 0; got {n_a}, {flood}, {slo}")
    if reading not in CAPACITY_READINGS or not 0 < attainment <= 1:
        raise ValueError(f"--set capacity must be one of {', '.join(CAPACITY_READINGS)} and "
                         f"capacity_attainment in (0, 1]; got {reading!r}, {attainment}")  # fmt: skip
    make_policy(inner)  # an unknown policy fails before anything runs
    cluster = cluster_config_from(opts, max_batch=32)
    n_b = math.ceil(n_a * flood)
    base = trace_requests(config, AZURE_CONV, n_a + n_b)
    if len(base) < n_a + n_b:
        raise ValueError(
            f"the trace has {len(base)} requests; requests={n_a} and flood={flood:g} need {n_a + n_b}"
        )
    chat = ServiceClass("chat", kind="interactive", ttft_slo_s=slo)

    def a_at(rate: float) -> list[Request]:  # a's requests at ``rate``: one arrival pattern per seed
        arrivals = poisson_arrivals(n_a, rate, np.random.default_rng(config.seed + 43))
        return _tenant(base[:n_a], "a", arrivals, chat)

    saturation = saturation_rate(base[:n_a], cluster)
    within_slo = slo_capacity(a_at, cluster, attainment, saturation)
    capacity = within_slo if reading == "slo" else saturation
    rate_a = config.rate if config.rate is not None else capacity * (config.load or 0.5)
    rng = np.random.default_rng(config.seed + 43)
    tenant_a = _tenant(base[:n_a], "a", poisson_arrivals(n_a, rate_a, rng), chat)
    tenant_b = _tenant(base[n_a:], "b", poisson_arrivals(n_b, rate_a * flood, rng), chat)
    both = sorted(tenant_a + tenant_b, key=lambda r: r.arrival)
    built: list[_Traced] = []

    def vtc(preempt: bool = False, lift_credit: float = 0.0) -> Callable[[], Policy]:
        def factory() -> Policy:
            fair = FairShare(make_policy(inner), input_weight=w_in, output_weight=w_out, preempt=preempt,
                             lift_credit=lift_credit)  # fmt: skip
            built.append(_Traced(fair, "a", "b"))
            return built[-1]

        return factory

    half = replace(cluster, engine=replace(cluster.engine, max_batch=max(1, cluster.engine.max_batch // 2)))
    progress(0, total=n_a * 8 + n_b * 6)
    rows = [
        _row(f"{inner}:tenants=a", tenant_a, lambda: make_policy(inner), cluster, progress),
        _row(f"{inner}:tenants=a:half-batch", tenant_a, lambda: make_policy(inner), half, progress),
        _row(f"{inner}:tenants=a+b", both, lambda: make_policy(inner), cluster, progress),
        _row(f"{inner}:tenants=a+b:vtc", both, vtc(), cluster, progress),
        _row(f"{inner}:tenants=a+b:vtc+preempt", both, vtc(preempt=True), cluster, progress),
        _row(f"{inner}:tenants=a+b:vtc+credit", both, vtc(lift_credit=credit), cluster, progress),
        _row("fcfs:tenants=a+b:a-first", both, lambda: _TenantFirst("a"), cluster, progress),
        _row("fcfs:tenants=a+b:a-first:b-half", both, lambda: _TenantFirst("a", 0.5), cluster, progress),
    ]
    bound = 2 * max(w_in * r.prompt_tokens + w_out * r.target_output_tokens for r in both)
    alone = rows[0]
    checks = [_check(row, alone, factor, points) for row in rows[1:]]
    for row, traced in zip(rows[3:6], built, strict=True):
        fair = traced.fair
        gap, limit = fair.max_service_gap, bound + fair.lift_credit
        row.update(max_service_gap=gap, vtc_bound=limit, vtc_preempted=fair.preempted)
        row.update(traced.breakdown(n_a))
        checks.append(f"{row['policy']} largest service gap of a and b both backlogged {gap:.0f} vs VTC's "
                      f"bound 2U{' + credit' if fair.lift_credit else ''} {limit:.0f}: "
                      f"{'PASS' if gap <= limit else 'FAIL'}")  # fmt: skip
    cfg = {**config.as_dict(), "requests": n_a, "flood": flood, "ttft_slo": slo, "policy": inner,
           "input_weight": w_in, "output_weight": w_out, "lift_credit": credit, "capacity": reading,
           "capacity_attainment": attainment, "capacity_rps": capacity, "slo_capacity_rps": within_slo,
           "saturation_rps": saturation, "rate_a_rps": rate_a,
           "cluster": {"instances": cluster.instances, "max_batch": cluster.engine.max_batch,
                       "profile": next(iter(cluster.profiles.values())).name}}  # fmt: skip
    return BenchReport("fair-share", cfg, rows, checks)


CAPACITY_READINGS = ("slo", "saturation")


class _TenantFirst(FCFS):
    """The reference rows ``a-first``: ``first``'s requests before every other tenant's, FCFS within
    each; with ``others_share`` the other tenants together never hold more than that share of the
    batch slots. Those it holds back stay queued (the base policy queues again, at the next decision,
    whatever the engine did not admit)."""

    def __init__(self, first: str, others_share: float = 1.0) -> None:
        super().__init__()
        self.first, self.others_share = first, others_share

    def key(self, req: Request, now: float) -> tuple:
        """The first tenant's requests first, then arrival."""
        return (req.tenant != self.first, req.arrival)

    def schedule(self, view: InstanceView) -> Decision:
        """FCFS's decision in the key's order, the others' admissions cut at their share of the slots."""
        decision = super().schedule(view)
        running = set(map(id, view.running))
        room = math.floor(view.max_batch * self.others_share)
        room -= sum(r.tenant != self.first for r in view.running)
        run = []
        for req in decision.run:
            if req.tenant != self.first and id(req) not in running:
                if room <= 0:
                    continue
                room -= 1
            run.append(req)
        decision.run = run
        return decision


class _Traced(Policy):
    """The VTC row's policy: ``fair`` itself, timing where ``tenant``'s requests wait before they start
    (module docstring: a's breakdown), ``other`` the tenant it shares its class with. Each interval
    between two decisions goes to the reason the earlier decision left the request waiting for."""

    def __init__(self, fair: FairShare, tenant: str, other: str) -> None:
        self.fair, self.tenant, self.other = fair, tenant, other
        self.name, self.oracle = fair.name, fair.oracle
        self.waits = {"order": 0.0, "slot": 0.0, "other": 0.0}
        self._waiting: dict[int, tuple[Request, str, float]] = {}  # id -> (request, reason, since)
        self.arrivals = self.ahead = 0

    def add(self, req: Request, now: float) -> None:
        self.fair.add(req, now)
        if req.tenant == self.tenant:
            self._waiting[id(req)] = (req, "other", now)
            name = req.service_class.name
            self.arrivals += 1
            self.ahead += self.fair.counter(name, self.tenant) > self.fair.counter(name, self.other)

    def remove(self, req: Request, now: float) -> None:
        self.fair.remove(req, now)
        self._waiting.pop(id(req), None)  # cancelled before it started

    def observe(self, view: InstanceView) -> None:
        self.fair.observe(view)

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        return self.fair.prepare(view)

    def schedule(self, view: InstanceView) -> Decision:
        for rid, (req, reason, since) in list(self._waiting.items()):
            started = req.first_scheduled_at
            self.waits[reason] += (view.now if started is None else started) - since
            if started is None:
                self._waiting[rid] = (req, reason, view.now)
            else:
                del self._waiting[rid]
        decision = self.fair.schedule(view)
        proposed = set(map(id, decision.run))
        full = len(decision.run) >= view.max_batch
        for rid, (req, _, since) in self._waiting.items():
            if rid in proposed:
                reason = "other"  # admitted unless the engine finds no room for it
            elif self.fair.least_served(req.service_class.name) != req.tenant:
                reason = "order"
            else:
                reason = "slot" if full else "other"
            self._waiting[rid] = (req, reason, since)
        return decision

    def __len__(self) -> int:
        return len(self.fair)

    def breakdown(self, requests: int) -> dict[str, float]:
        """The row's columns of where the tenant's TTFT went, means over its ``requests``."""
        out = {f"a_wait_{k}_s": v / requests for k, v in self.waits.items()}
        out["a_ahead_at_arrival"] = self.ahead / max(1, self.arrivals)
        return out


def _tenant(rows: list[Request], tenant: str, arrivals: np.ndarray, cls: ServiceClass) -> list[Request]:
    """The trace's lengths as ``tenant``'s requests at ``arrivals``, all of class ``cls``."""
    return [
        Request(
            f"{tenant}{i}",
            float(t),
            r.prompt_tokens,
            r.max_tokens,
            r.model,
            cls,
            r.true_output_tokens,
            tenant=tenant,
        )
        for i, (r, t) in enumerate(zip(rows, arrivals, strict=True))
    ]


def _row(
    name: str, requests: list[Request], factory: Any, cluster: Any, progress: Progress
) -> dict[str, Any]:
    """Tenant a's metrics (the contract's keys) and b's TTFT, SLO and output rate, under one policy."""
    done, metrics = run_one(requests, factory, cluster, progress=progress)
    mine = [r for r in done if r.tenant == "a"]
    span = max(r.finished_at or 0.0 for r in done) - min(r.arrival for r in done)
    row: dict[str, Any] = {"policy": name, **summarize(mine, makespan_s=span)}
    row["a_prefill_s"] = float(np.mean([(r.first_token_at or 0.0) - (r.first_scheduled_at or 0.0)
                                        for r in mine]))  # fmt: skip
    row["wall_s"] = metrics["wall_s"]
    others = [r for r in done if r.tenant == "b"]
    if others:
        b = summarize(others, makespan_s=span, qoe=False)
        row.update(b_p99_ttft_s=b["p99_ttft_s"], b_slo_attainment=b.get("slo_attainment"),
                   b_output_tokens_per_s=b["output_tokens_per_s"], b_requests=len(others))  # fmt: skip
    return row


def _check(row: dict[str, Any], alone: dict[str, Any], factor: float, points: float) -> str:
    """a's TTFT p99 and SLO attainment in ``row`` against a alone."""
    ttft, base = row["p99_ttft_s"], alone["p99_ttft_s"]
    slo, base_slo = row["slo_attainment"], alone["slo_attainment"]
    ok = ttft <= factor * base and slo >= base_slo - points / 100
    return (f"{row['policy']}: a's TTFT p99 {ttft:.3f}s vs alone {base:.3f}s ({ttft / base:.2f}x, target <= "
            f"{factor:g}x); SLO attainment {slo:.1%} vs alone {base_slo:.1%} (target within {points:g} "
            f"points): {'PASS' if ok else 'FAIL'}")  # fmt: skip


__all__ = ["DESCRIPTION", "run"]
