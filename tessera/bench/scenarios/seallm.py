"""`tessera bench seallm`: SeaLLM placement + DB scheduling vs dedicated GPUs and round-robin sharing.

Workload (SeaLLM §6.1, with our choices: docs/papers.md, "SeaLLM: workload"): a pool of requests, half
ShareGPT-like (short prompt, long output) and half LongBench-like (long prompt, short output), with lognormal
lengths at the Tab. 1 means; K-means over standardised (log(1+in), log(1+out)) splits it into 16 clusters, and
each cluster with a randomly chosen model (Llama2-7B, OPT-6.7B-like 7B, Llama2-13B) is one service, whose
requests sample lengths from its cluster. Arrivals come from a synthetic MAF-like trace (64 functions,
lognormal base rates, per-minute jitter and bursts, functions round-robin to services), scaled to ``--rate``
(default 20 req/s). A warm-up window (5 minutes, or ``I_0`` if longer) precedes the evaluation window; its
last ``I_0`` is the initial placement's history, so runs with different ``I_0`` replay the same requests. L̂_s
and Var_s (weights, normalisers, budgets) are fixed per service from all its requests (exec_ref at tp_min),
the same for every row.

Rows (same requests, seed, engines and dispatcher: every instance is a ``tessera.sim`` engine holding its
group's models, fed by the fewest-outstanding-requests dispatcher, as the planner's estimator simulates
them: ``tessera.control.placement_sim``). A group of several models plays as its pods run it
(``--set sharing=``): ``pods`` [default], as vLLM pods on these GPUs do: each model its own KV share, one
awake at a time, a swap paying its weights' load; ``co-resident``: engines that cannot sleep, side by
side; ``temporal``: SeaLLM's own model (one KV pool, switches keep KV), which no pod runs:
- ``seallm``: Alg. 1 placement on the warm-up history, then re-placement at every interval boundary on
  the last interval's history, the interval adapted by Eq. 8 from M_est vs M_real, rolled out with the
  least churn (unchanged groups keep serving; changed groups stall for the weight load; their requests
  migrate and recompute their KV); between boundaries the operator's load-shift watch (its default
  ``loadShiftThreshold``, 0.5: a service whose arrivals over the last I_min depart from its plan's rate
  brings the boundary forward, planned on the last interval as at any boundary); DB scheduling;
- ``seallm:fixed``: the initial placement kept for the whole window (the paper's SeaLLM-A ablation);
- ``dedicated``: SeaLLM's vLLM baseline: GPUs split evenly, one instance per service with TP
  equal to its share (never below tp_min), vLLM continuous batching (prefill first, FCFS: core ``FCFS``);
- ``dedicated:replicas``: the same share as replicas of tp_min GPUs (the operator's dedicated plan);
- ``round-robin``: services paired round-robin, each pair on its even share of GPUs, services take turns
  (core ``RoundRobinSharing``: a prefill or 8 decode iterations each, vLLM order inside a service).

Every row serves until every request has finished (no censoring; ``unfinished`` counts only the
``rejected`` requests). A request whose prompt no instance of its service can hold in KV (the
LongBench-like lognormal tail reaches 75k tokens; a TP-1 group shared by two models holds fewer) is
rejected, as vLLM refuses such a prompt: it counts as an SLO miss with SeaLLM's censored latency
``T_end − a + exec_ref``, and each row reports how many (``rejected``).
Options (``--set``): services=16, gpus=32, minutes=60 (the window), interval_minutes=5 (I_0),
min_interval_minutes=1, max_interval_minutes=30, beta=0.1, load_shift_threshold=0.5 (0: re-place only
at Eq. 8's boundaries, the paper's timeline), sharing=pods, slo_scale=5, rates=R1,R2,... (a sweep; one
row per system and rate), tolerance=0.10 (seallm and seallm:fixed against the better baseline on
throughput and p99 JCT: no worse than this share), part=serve|planner. ``--set part=planner``
instead times the planner on 32 services over 64 GPUs and reports the greedy's gap to the exact MILP on
a small case.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from tessera.api.serving_pool import ReplacementInterval
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios._common import baseline_checks, tolerance
from tessera.control.placement import fits, plan_placement, plan_seallm
from tessera.control.placement_sim import (
    RequestOutcome,
    SwitchCost,
    add_group,
    group_profiles,
    new_cluster,
    outcomes,
    serve,
    stats_of,
    to_requests,
)
from tessera.core.baselines import FCFS
from tessera.core.planners import (
    HistoryRequest,
    IntervalMetrics,
    IntervalSettings,
    PlacementPlan,
    PoolInput,
    ServiceInput,
    next_replacement_interval,
    rollout_diff,
)
from tessera.core.planners.naming import group_name
from tessera.core.planners.replacement import shift_check_due, shifted_loads
from tessera.core.planners.types import GroupPlan, RoleCounts
from tessera.core.policies.seallm import DoublingBudget, RoundRobinSharing, ServiceStats
from tessera.core.policy import Policy
from tessera.core.profile import StepProfile
from tessera.core.request import Request
from tessera.core.slo import latency_metrics
from tessera.sim.cluster import (
    AddInstance,
    Cluster,
    ClusterAction,
    ClusterController,
    ClusterView,
    RemoveInstance,
)
from tessera.sim.engine import SimInstance

DESCRIPTION = "SeaLLM placement + DB scheduling vs dedicated GPUs and round-robin sharing (16 services)"
TRACE_REFUSED = (
    "it builds its own multi-service workload (16 services with their own length clusters and MAF-like "
    "per-minute rates); set its total rate with --rate or --set rates=R1,R2"
)
GIB = 2**30

# A100/A800-class linear step models at TP 1 (docs/papers.md, "Engine: step-time model"): c0, c1, c2 (per
# context token), p0, p1 (per prompt token), with fp16 weights and KV bytes per token (2·layers·kv_heads·128·2
# B). An instance's KV capacity follows from the pool's memory and what shares it
# (tessera.control.placement_sim), not from the profile.
MODELS: dict[str, StepProfile] = {
    name: StepProfile(name, c0, c1, c2, p0, p1, 0, kv_bytes_per_token=kvb, weights_bytes=weights)
    for name, (c0, c1, c2, p0, p1, weights, kvb) in {
        "llama2-7b": (0.0075, 2e-5, 6.6e-8, 0.005, 8e-5, int(13.5e9), 512 * 1024),
        "opt-6.7b": (0.0075, 2e-5, 6.6e-8, 0.005, 8e-5, int(13.4e9), 512 * 1024),
        "llama2-13b": (0.013, 2e-5, 4e-7, 0.008, 1.4e-4, int(26e9), 800 * 1024),
    }.items()
}
# (mean prompt, cv prompt, mean output, cv output) — SeaLLM Tab. 1 means, our CVs.
PROFILES = {"sharegpt": (73.0, 1.0, 427.0, 1.0), "longbench": (13187.0, 0.5, 21.0, 1.0)}
POOL_REQUESTS = 4000  # size of the length pool that K-means splits into services
# The operator's default load-shift watch (ServingPool replacementInterval.loadShiftThreshold), so the
# seallm row measures the re-placement timeline a pool runs unless its spec turns the watch off.
LOAD_SHIFT_THRESHOLD = ReplacementInterval().load_shift_threshold
# How a shared group's pods run it (--set sharing=): as vLLM pods on these GPUs do (their engines sleep:
# one model awake at a time), co-resident engines (engines that cannot sleep), or SeaLLM's own temporal
# sharing of one KV pool, which no pod runs (for comparing with it): tessera.control.placement_sim
SHARING: dict[str, dict[str, bool]] = {
    "pods": {"engines_sleep": True},
    "co-resident": {"engines_sleep": False},
    "temporal": {"temporal_sharing": True},
}
WARMUP_MINUTES = 5  # warm-up generated before the window whatever I_0 is, so an I_0 sweep replays the same
# requests; the initial plan sees only its last I_0 of it (its history is one interval)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    sigma = math.sqrt(math.log(1 + cv * cv))
    return np.maximum(1, rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)).round().astype(int)


def maf_like_counts(
    rng: np.random.Generator, n_services: int, minutes: int, functions: int = 64
) -> np.ndarray:
    """Per-service, per-minute relative rates of a synthetic MAF-like trace (our choice)."""
    base = rng.lognormal(0.0, 2.0, functions)
    rates = np.zeros((n_services, minutes))
    order = np.argsort(-base)  # functions in a fixed order (by size), round-robin to services
    for rank, f in enumerate(order):
        burst_left = 0
        for m in range(minutes):
            r = base[f] * rng.lognormal(0.0, 0.5)
            if burst_left == 0 and rng.random() < 0.05:
                burst_left = int(rng.geometric(1 / 3))
                mult = rng.uniform(3, 10)
            if burst_left > 0:
                r *= mult
                burst_left -= 1
            rates[rank % n_services, m] += r
    return rates


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iterations: int = 50) -> np.ndarray:
    """Cluster labels of the rows of ``x`` (Lloyd's algorithm, k-means++ seeding)."""
    centers = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d = np.min([((x - c) ** 2).sum(1) for c in centers], axis=0)
        centers.append(x[rng.choice(len(x), p=d / d.sum())])
    c = np.array(centers)
    labels = np.zeros(len(x), dtype=int)
    for _ in range(iterations):
        labels = ((x[:, None, :] - c[None]) ** 2).sum(2).argmin(1)
        new = np.array([x[labels == j].mean(0) if (labels == j).any() else c[j] for j in range(k)])
        if np.allclose(new, c):
            break
        c = new
    return labels


def length_clusters(rng: np.random.Generator, n_services: int) -> list[np.ndarray]:
    """SeaLLM §6.1 with our choices: K-means of a 50/50 ShareGPT-like / LongBench-like pool by standardised
    (log(1+in), log(1+out)); one (prompt, output) array per cluster, largest mean execution first is
    not implied (clusters come in label order)."""
    half = POOL_REQUESTS // 2
    parts = []
    for profile in ("sharegpt", "longbench"):
        mp, cvp, mo, cvo = PROFILES[profile]
        parts.append(np.stack([_lognormal(rng, mp, cvp, half), _lognormal(rng, mo, cvo, half)], 1))
    pool = np.concatenate(parts)
    feats = np.log1p(pool.astype(float))
    feats = (feats - feats.mean(0)) / feats.std(0)
    labels = kmeans(feats, n_services, rng)
    clusters = [pool[labels == j] for j in range(n_services)]
    return [c if len(c) else pool[:1] for c in clusters]


def build_workload(
    seed: int, n_services: int, rate: float, minutes: int, warmup: int, slo_scale: float
) -> tuple[list[ServiceInput], dict[str, list[HistoryRequest]]]:
    """Services (with warm-up history, arrivals before 0) and the evaluation window's requests (from 0)."""
    rng = np.random.default_rng(seed)
    clusters = length_clusters(rng, n_services)
    model_names = sorted(MODELS)
    models = [model_names[int(i)] for i in rng.integers(len(model_names), size=n_services)]  # before
    # any rate-dependent draw, so a rate sweep keeps the same services
    total = minutes + warmup
    rates = maf_like_counts(rng, n_services, total)
    rates *= rate / (rates.sum() / total)  # rates are req/s per minute; mean total = rate
    services, window = [], {}
    for i in range(n_services):
        model = models[i]
        profile = MODELS[model]
        arrivals = []
        for m in range(total):
            n = rng.poisson(rates[i, m] * 60.0)
            arrivals.extend(sorted(60.0 * m + rng.uniform(0, 60.0, n)))
        cluster = clusters[i]
        picks = cluster[rng.integers(len(cluster), size=len(arrivals))]
        reqs = [
            HistoryRequest(float(a) - warmup * 60.0, int(p), int(o))
            for a, (p, o) in zip(arrivals, picks, strict=True)
        ]
        hist = tuple(r for r in reqs if r.arrival < 0)
        name = f"s{i:02d}-{model}-in{int(np.mean(cluster[:, 0]))}-out{int(np.mean(cluster[:, 1]))}"
        services.append(
            with_history(
                ServiceInput(
                    name=name,
                    weights_bytes=profile.weights_bytes,
                    kv_bytes_per_token=profile.kv_bytes_per_token,
                    profile=profile,
                    mean_prompt_tokens=float(cluster[:, 0].mean()),
                    mean_output_tokens=float(cluster[:, 1].mean()),
                    p99_context_tokens=int(np.percentile(cluster.sum(1), 99)),
                    slo_scale=slo_scale,
                ),
                hist,
                warmup * 60.0,
            )
        )
        window[name] = [r for r in reqs if r.arrival >= 0]
    return services, window


def with_history(s: ServiceInput, history: Sequence[HistoryRequest], span_s: float) -> ServiceInput:
    """``s`` with a new history window (the monitor's view): rate and mean lengths from it."""
    hist = tuple(history)
    if not hist:
        return replace(s, history=(), request_rate=0.0)
    return replace(
        s,
        history=hist,
        request_rate=len(hist) / span_s,
        mean_prompt_tokens=float(np.mean([h.prompt_tokens for h in hist])),
        mean_output_tokens=float(np.mean([h.output_tokens for h in hist])),
    )


def fixed_stats(
    services: Sequence[ServiceInput], window: dict[str, list[HistoryRequest]]
) -> dict[str, ServiceStats]:
    """L̂_s, Var_s from every request of the service (warm-up and window): its profile (exec_ref)."""
    return {
        s.name: stats_of(s, [(h.prompt_tokens, h.output_tokens) for h in (*s.history, *window[s.name])])
        for s in services
    }


def dedicated_plan(pool: PoolInput, services: Sequence[ServiceInput], *, replicas: bool) -> PlacementPlan:
    """vLLM baseline (SeaLLM §6.1; layout our choice): GPUs split evenly; one instance per service with TP
    equal to its share (a power of two, never below tp_min), or (``replicas``) the share as replicas of tp_min
    GPUs."""
    share = pool.max_gpus // len(services)
    groups = []
    for s in services:
        if replicas:
            tp, n = s.tp_min, max(1, share // s.tp_min)
        else:
            tp = max(s.tp_min, 2 ** int(math.log2(max(1, min(share, pool.gpus_per_node)))))
            n = 1
        groups.append(GroupPlan(group_name((s.name,), tp), (s.name,), tp, RoleCounts(interactive=n)))
    plan = PlacementPlan("dedicated", tuple(groups))
    if plan.gpus > pool.max_gpus:
        raise ValueError(f"dedicated layout needs {plan.gpus} GPUs but the pool has {pool.max_gpus}")
    return plan


def round_robin_plan(pool: PoolInput, services: Sequence[ServiceInput]) -> PlacementPlan:
    """Every GPU hosts two services, paired round-robin (s_i with s_{i+n/2}); pairs share the GPUs evenly."""
    half = (len(services) + 1) // 2
    pairs = [
        tuple(sorted({services[i].name, services[(i + half) % len(services)].name})) for i in range(half)
    ]
    by = {s.name: s for s in services}
    per = pool.max_gpus // len(pairs)
    groups = []
    for p in pairs:
        tp = max(by[n].tp_min for n in p)
        while not fits(pool, [by[n] for n in p], tp):  # two large models need a larger TP to share
            tp *= 2
        groups.append(GroupPlan(group_name(p, tp), p, tp, RoleCounts(interactive=max(1, per // tp))))
    return PlacementPlan("round-robin", tuple(groups))


def interval_metrics(outcomes: Sequence[RequestOutcome]) -> IntervalMetrics | None:
    """M of one interval (SLO attainment, mean L_N); None without requests."""
    if not outcomes:
        return None
    n = len(outcomes)
    return IntervalMetrics(sum(o.slo_met for o in outcomes) / n, sum(o.norm_latency for o in outcomes) / n)


def replan(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    history: Mapping[str, Sequence[HistoryRequest]],
    span_s: float,
    now: float,
    previous: PlacementPlan | None,
    stats: dict[str, ServiceStats] | None,
    backlog: Mapping[str, int] | None = None,
) -> PlacementPlan:
    """The plan of one re-placement boundary: Alg. 1 on each service's ``history`` of the last ``span_s``
    seconds (``with_history``: its rate and mean lengths) and its ``backlog`` (requests outstanding now),
    least churn against ``previous``; ``stats`` are the services' L̂_s / Var_s (None: from the history)."""
    current = [
        replace(with_history(s, history.get(s.name, ()), span_s), backlog=(backlog or {}).get(s.name, 0))
        for s in services
    ]
    return plan_seallm(pool, current, now=now, previous=previous, stats=stats)


class Replanner(ClusterController):
    """SeaLLM's timeline (SeaLLM §4.3) as a simulator controller: at every boundary T_{t+1} = T_t + I_t
    (on the next whole second: the controller ticks every second), M_real of the interval (requests
    that arrived in it, censored at the boundary), I_{t+1} by Eq. 8 from M_est, then P_{t+1} = Alg. 1
    on the interval's history, rolled out with the least churn: instances whose (services, TP) stay
    keep serving (the busiest ones), the others stop and their requests move with their generated
    tokens (their KV is recomputed where they land), new instances start after the weight-load stall.
    No boundary after the last arrival.

    Between boundaries it runs the operator's load-shift watch (``loadShiftThreshold``, our extension
    of §4.3; the operator's ``Controller._load_shift``): every ``min_s / 2``, once the plan is ``min_s``
    old, each service's arrivals over the last ``min_s`` are compared with the rate its plan was made for
    (``shifted_loads``); a shift is a boundary now, planned on the last I_t (M_real and Eq. 8 as at any
    boundary). ``shift_threshold`` 0 turns it off (boundaries only from the interval, the paper's
    timeline)."""

    interval_s = 1.0

    def __init__(
        self,
        pool: PoolInput,
        services: Sequence[ServiceInput],
        stats: dict[str, ServiceStats],
        settings: IntervalSettings,
        plan: PlacementPlan,
        requests: Sequence[Request],
        shift_threshold: float = LOAD_SHIFT_THRESHOLD,
    ) -> None:
        self.pool, self.services, self.stats, self.settings = pool, services, stats, settings
        self.by_name = {s.name: s for s in services}
        self.plan = plan
        self.requests = requests  # in arrival order
        self.arrivals = [r.arrival for r in requests]
        self.last_arrival = max(self.arrivals, default=0.0)
        self.start, self.interval, self.first = 0.0, settings.initial_s, 0
        self.shift_threshold = shift_threshold
        self.planned = {s.name: s.request_rate for s in services}  # the rates the plan was made for
        self.next_check = settings.min_s / 2
        self.switch = SwitchCost()
        self.migrated = 0
        self.log: list[dict[str, Any]] = []

    def _shifted(self, now: float) -> bool:
        """The operator's load-shift watch at ``now`` (see the class docstring)."""
        if self.shift_threshold <= 0:
            return False
        due, self.next_check = shift_check_due(now, self.next_check, self.start, self.settings.min_s)
        if not due:
            return False
        lo = bisect.bisect_left(self.arrivals, now - self.settings.min_s)
        hi = bisect.bisect_left(self.arrivals, now)
        counts = Counter(r.model for r in self.requests[lo:hi])
        measured = {n: (float(counts.get(n, 0)), self.settings.min_s) for n in self.planned}
        return bool(shifted_loads(self.planned, measured, self.shift_threshold))

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Re-place at a boundary or on a load shift; nothing otherwise."""
        now = view.now
        boundary = self.start + self.interval
        if self.last_arrival < min(boundary, now):
            return []
        shift = now < boundary and self._shifted(now)
        if now < boundary and not shift:
            return []
        end = bisect.bisect_left(self.arrivals, now)
        batch = self.requests[self.first : end]
        # A shift plans on the last interval's length (as the operator does: its windows count only the
        # time with samples, so none reaches back before the first arrival), a boundary on its interval.
        since = max(0.0, now - self.interval) if shift else self.start
        window = self.requests[bisect.bisect_left(self.arrivals, since) : end]
        measured = interval_metrics(outcomes(self.services, self.stats, batch, now))
        plan = self.plan
        estimated = (
            IntervalMetrics(plan.estimated_slo_attainment, plan.estimated_norm_latency)
            if plan.estimated_slo_attainment is not None and plan.estimated_norm_latency is not None
            else None
        )
        nxt = next_replacement_interval(self.interval, estimated, measured, self.settings)
        hist: dict[str, list[HistoryRequest]] = {s.name: [] for s in self.services}
        for r in window:
            hist[r.model].append(HistoryRequest(r.arrival, r.prompt_tokens, r.target_output_tokens))
        backlog = Counter(
            r.model for r in self.requests[:end] if r.finished_at is None or r.finished_at > now
        )
        t = time.perf_counter()
        new = replan(self.pool, self.services, hist, now - since, now, plan, self.stats, backlog)
        plan_wall = time.perf_counter() - t
        diff = rollout_diff(plan, new)
        actions, started, stopped, moved = self._rollout(new, view)
        self.migrated += moved
        self.log.append(
            {
                "boundary_s": round(now, 1),
                "trigger": "load-shift" if shift else "interval",
                "interval_s": round(self.interval, 1),
                "next_interval_s": round(nxt, 1),
                "m_est": None
                if estimated is None
                else [round(estimated.slo_attainment, 3), round(estimated.norm_latency, 2)],
                "m_real": None
                if measured is None
                else [round(measured.slo_attainment, 3), round(measured.norm_latency, 2)],
                "groups_kept": len(diff.keep),
                "groups_created": len(diff.create),
                "groups_deleted": len(diff.delete),
                "instances_started": started,
                "instances_stopped": stopped,
                "requests_migrated": moved,
                "plan_wall_s": round(plan_wall, 2),
            }
        )
        self.plan, self.start, self.interval, self.first = new, now, nxt, end
        self.planned = {n: len(h) / (now - since) for n, h in hist.items()}
        self.next_check = now + self.settings.min_s / 2
        return actions

    def _rollout(self, plan: PlacementPlan, view: ClusterView) -> tuple[list[ClusterAction], int, int, int]:
        """Least-churn actions from the running instances to ``plan``: starts first (so moved requests
        see them), then stops; with the counts started, stopped and requests moved."""
        current: dict[tuple[tuple[str, ...], int], list[SimInstance]] = {}
        for inst in view.instances:
            current.setdefault((tuple(sorted(inst.profiles)), inst.gpus), []).append(inst)
        actions: list[ClusterAction] = []
        for g in plan.groups:
            have = len(current.get(g.key, []))
            services = [self.by_name[n] for n in g.services]
            stall = self.switch.stall_s(services, g.tp)
            profiles = group_profiles(self.pool, services, g.tp, stall_s=stall)
            for _ in range(g.replicas.total - have):
                actions.append(AddInstance(models=tuple(profiles), profiles=profiles))
        started = len(actions)
        want = {g.key: g.replicas.total for g in plan.groups}
        moved = 0
        for key, insts in current.items():
            for inst in sorted(insts, key=lambda i: -i.outstanding)[want.get(key, 0) :]:
                actions.append(RemoveInstance(inst.name))
                moved += inst.outstanding
        return actions, started, len(actions) - started, moved


def serve_adaptive(
    pool: PoolInput,
    services: Sequence[ServiceInput],
    window: dict[str, list[HistoryRequest]],
    stats: dict[str, ServiceStats],
    settings: IntervalSettings,
    *,
    adaptive: bool = True,
    shift_threshold: float = LOAD_SHIFT_THRESHOLD,
) -> tuple[list[RequestOutcome], Cluster, PlacementPlan, Replanner | None]:
    """P_0 from the warm-up history, then (``adaptive``) the ``Replanner``'s re-placements (with its
    load-shift watch at ``shift_threshold``, 0 = off); the last plan serves until every request has
    finished. Returns outcomes, the cluster, the initial plan and the replanner (its log has one entry
    per re-placement)."""
    plan = plan_seallm(pool, services, now=0.0, stats=stats)
    reqs = to_requests(((n, h) for n, hs in window.items() for h in hs), services)
    replanner = Replanner(pool, services, stats, settings, plan, reqs, shift_threshold) if adaptive else None
    cluster = new_cluster(pool, services, lambda: DoublingBudget(dict(stats)), replanner)
    by_name = {s.name: s for s in services}
    for g in plan.groups:
        for _ in range(g.replicas.total):
            add_group(cluster, pool, [by_name[n] for n in g.services], g.tp)
    cluster.run(reqs)
    finish = max((r.finished_at or 0.0 for r in reqs), default=0.0)
    return outcomes(services, stats, reqs, finish), cluster, plan, replanner


def preemptions(cluster: Cluster) -> int:
    """KV preemptions (recompute) over every instance the cluster ran, stopped ones included."""
    return sum(i.preemptions for i in (*cluster.instances, *cluster.retired))


def metrics(outcomes: Sequence[RequestOutcome], gpus: int) -> dict[str, Any]:
    """Contract metrics of one row (every request counted; censored ones would count as SLO misses)."""
    lat = np.array([o.latency for o in outcomes])
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    by_service: dict[str, list[bool]] = {}
    for o in outcomes:
        by_service.setdefault(o.service, []).append(o.slo_met)
    makespan = max(o.arrival + o.latency for o in outcomes)
    return {
        **latency_metrics(
            ttft, lat, [o.slo_met for o in outcomes], makespan - min(o.arrival for o in outcomes)
        ),
        "normalized_latency_mean": float(np.mean([o.norm_latency for o in outcomes])),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "slo_attainment": float(np.mean([o.slo_met for o in outcomes])),
        "slo_attainment_by_class": {k: float(np.mean(v)) for k, v in sorted(by_service.items())},
        "min_service_slo_attainment": float(min(np.mean(v) for v in by_service.values())),
        "unfinished": int(sum(not o.finished for o in outcomes)),
        "requests": len(outcomes),
        "gpu_seconds": gpus * makespan,
    }


def _opt(config: BenchConfig, key: str, default: float, *, zero_ok: bool = False) -> float:
    """``--set key=``, a number > 0, or with ``zero_ok`` a finite one >= 0."""
    value = config.options.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--set {key}= must be a number, got {value!r}") from exc
    if zero_ok and not 0 <= out < math.inf:
        raise ValueError(f"--set {key}= must be >= 0, got {value!r}")
    if not zero_ok and out <= 0:
        raise ValueError(f"--set {key}= must be > 0, got {value!r}")
    return out


def _rates(config: BenchConfig) -> list[float]:
    text = config.options.get("rates")
    if text is None:
        return [config.rate if config.rate is not None else 20.0]
    if config.rate is not None:
        raise ValueError("give either --rate or --set rates=..., not both")
    try:
        rates = [float(x) for x in str(text).split(",")]
    except ValueError as exc:
        raise ValueError(f"--set rates= must be numbers separated by commas, got {text!r}") from exc
    if not rates or min(rates) <= 0:
        raise ValueError(f"--set rates= must be > 0, got {text!r}")
    return rates


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Run the scenario (serving comparison, or the planner timing with ``--set part=planner``)."""
    part = str(config.options.get("part", "serve"))
    if part == "planner":
        return run_planner(config, progress)
    if part != "serve":
        raise ValueError(f"--set part= must be 'serve' or 'planner', got {part!r}")
    known = {
        "part",
        "services",
        "gpus",
        "minutes",
        "interval_minutes",
        "min_interval_minutes",
        "max_interval_minutes",
        "beta",
        "slo_scale",
        "rates",
        "tolerance",
        "load_shift_threshold",
        "sharing",
    }
    unknown = sorted(set(config.options) - known)
    if unknown:
        raise ValueError(f"unknown --set options {unknown}; known: {sorted(known)}")
    n = int(_opt(config, "services", 16))
    gpus = int(_opt(config, "gpus", 32))
    minutes = int(_opt(config, "minutes", 60))
    i0 = _opt(config, "interval_minutes", 5.0)
    settings = IntervalSettings(
        initial_s=i0 * 60.0,
        min_s=_opt(config, "min_interval_minutes", 1.0) * 60.0,
        max_s=_opt(config, "max_interval_minutes", 30.0) * 60.0,
        beta=_opt(config, "beta", 0.1),
    )
    slo_scale = _opt(config, "slo_scale", 5.0)
    shift = _opt(config, "load_shift_threshold", LOAD_SHIFT_THRESHOLD, zero_ok=True)  # 0: Eq. 8 only
    tol = tolerance(config.options)
    rates = _rates(config)
    sharing = str(config.options.get("sharing", "pods"))
    if sharing not in SHARING:
        raise ValueError(f"--set sharing= must be one of {', '.join(SHARING)}, got {sharing!r}")
    pool = replace(PoolInput("bench", "A800", 80 * GIB, gpus), **SHARING[sharing])
    rows: list[dict[str, Any]] = []
    checks: list[str] = []
    progress(0, total=5 * len(rates))
    for rate in rates:
        warmup = max(WARMUP_MINUTES, math.ceil(i0))
        services, window = build_workload(config.seed, n, rate, minutes, warmup, slo_scale)
        stats = fixed_stats(services, window)
        initial = [
            with_history(s, [h for h in s.history if h.arrival >= -i0 * 60.0], i0 * 60.0) for s in services
        ]
        reqs = [(name, h) for name, hs in window.items() for h in hs]
        suffix = "" if len(rates) == 1 else f":rate={rate:g}"
        batch: list[dict[str, Any]] = []
        for name in ("seallm", "seallm:fixed"):
            t = time.perf_counter()
            out, sim, first, replanner = serve_adaptive(
                pool, initial, window, stats, settings, adaptive=name == "seallm", shift_threshold=shift
            )
            row = {"policy": name + suffix, **metrics(out, gpus), "wall_s": time.perf_counter() - t}
            row.update(
                preemptions=preemptions(sim),
                requests_migrated=replanner.migrated if replanner is not None else 0,
                rejected=len(sim.rejected),
            )
            row["initial_plan"] = [
                f"{'+'.join(g.services)} x{g.replicas.total} tp{g.tp}" for g in first.groups
            ]
            if replanner is not None:
                row["replacements"] = replanner.log
            batch.append(row)
            progress(1)
        setups: list[tuple[str, PlacementPlan, Callable[[], Policy]]] = [
            ("dedicated", dedicated_plan(pool, services, replicas=False), FCFS),
            ("dedicated:replicas", dedicated_plan(pool, services, replicas=True), FCFS),
            ("round-robin", round_robin_plan(pool, services), RoundRobinSharing),
        ]
        for name, plan, policy in setups:
            t = time.perf_counter()
            out, sim = serve(pool, services, plan, reqs, stats=stats, policy=policy)
            row = {"policy": name + suffix, **metrics(out, plan.gpus), "wall_s": time.perf_counter() - t}
            row.update(preemptions=preemptions(sim), groups=len(plan.groups), rejected=len(sim.rejected))
            batch.append(row)
            progress(1)
        rows.extend(batch)
        s, baselines = batch[0], batch[2:]
        best = min(baselines, key=lambda r: r["normalized_latency_mean"])
        best_slo = max(r["slo_attainment"] for r in baselines)
        ratio = best["normalized_latency_mean"] / s["normalized_latency_mean"]
        at = f" at {rate:g} req/s"
        checks += [
            f"seallm mean normalized latency {ratio:.2f}x lower than the better baseline "
            f"({best['policy']}){at} (target >= 3x): {'PASS' if ratio >= 3 else 'FAIL'}",
            f"seallm SLO attainment {s['slo_attainment']:.3f} vs best baseline {best_slo:.3f}{at} "
            f"(target higher): {'PASS' if s['slo_attainment'] > best_slo else 'FAIL'}",
            f"(ablation) seallm:fixed mean normalized latency "
            f"{best['normalized_latency_mean'] / batch[1]['normalized_latency_mean']:.2f}x lower than the "
            f"better baseline, SLO attainment {batch[1]['slo_attainment']:.3f}{at}",
            *baseline_checks(batch[:2], best, tol),
        ]
    cfg = {
        **config.as_dict(),
        "services": n,
        "gpus": gpus,
        "minutes": minutes,
        "rates": rates,
        "interval_minutes": i0,
        "slo_scale": slo_scale,
        "load_shift_threshold": shift,
        "sharing": sharing,
        "tolerance": tol,
    }
    return BenchReport("seallm", cfg, rows, checks)


def run_planner(config: BenchConfig, progress: Progress) -> BenchReport:
    """Planner timing (32 services over 64 GPUs) and the greedy's gap to the MILP on a small partition."""
    from tessera.control.placement import generate_groups, greedy_allocate
    from tessera.control.placement_ilp import max_utilization, solve_partition

    n = int(_opt(config, "services", 32))
    gpus = int(_opt(config, "gpus", 64))
    rate = config.rate if config.rate is not None else 16.0
    services, _ = build_workload(config.seed, n, rate, 1, 2, 5.0)
    pool = PoolInput("bench", "A800", 80 * GIB, gpus)
    progress(0, total=2)
    t = time.perf_counter()
    plan = plan_placement(pool, services, strategy="seallm", now=0.0)
    wall = time.perf_counter() - t
    progress(1)
    rows: list[dict[str, Any]] = [
        {
            "policy": f"seallm:services={n},gpus={gpus}",
            "wall_s": wall,
            "groups": len(plan.groups),
            "gpus_used": plan.gpus,
            "estimated_slo_attainment": plan.estimated_slo_attainment,
            "estimated_norm_latency": plan.estimated_norm_latency,
        }
    ]
    small = services[:5]
    small_pool = PoolInput("small", "A800", 80 * GIB, 4, gpus_per_node=4)
    groups = generate_groups(small_pool, small, 1)
    greedy_allocate(small_pool, small, groups, 2)
    t = time.perf_counter()
    ilp = solve_partition(small_pool, small, generate_groups(small_pool, small, 1), 2)
    ilp_wall = time.perf_counter() - t
    u_greedy = max_utilization(small_pool, small, groups)
    gap = u_greedy / ilp.max_utilization - 1 if ilp.max_utilization > 0 else 0.0
    rows.append(
        {
            "policy": "seallm-ilp:services=5,gpus=4",
            "wall_s": ilp_wall,
            "max_utilization_ilp": ilp.max_utilization,
            "max_utilization_greedy": u_greedy,
            "greedy_gap": gap,
        }
    )
    progress(1)
    checks = [
        f"plan of {n} services over {gpus} GPUs in {wall:.2f} s (target <= 10 s): "
        f"{'PASS' if wall <= 10 else 'FAIL'}",
        f"greedy max utilization {gap:.1%} above the MILP optimum on 5 services / 4 GPUs (reported gap)",
    ]
    return BenchReport("seallm", {**config.as_dict(), "part": "planner"}, rows, checks)
