"""Scenario ``scale-to-zero``: idle services cost nothing, and the activator brings them back.

Workload: ``services`` (8) models of one profile (``profile``, a100-llama3-8b; ``--set cold_start_s=``,
``wake_l1_s=``, ``wake_l2_s=`` replace its wake-up costs), one instance per model at most (the GPU budget
is ``services`` GPUs). Each service's traffic is
on/off: bursts of ``burst_s`` (120 s) of Poisson arrivals at ``burst_rate`` (0.5 req/s; ``--rate`` sets
it) separated by idle gaps drawn exponentially with mean ``idle_gap_s`` (900 s), over ``minutes`` (60)
of simulated time; lengths from the lognormal ShareGPT fit; one interactive class (TTFT SLO
``ttft_slo_s``, 10 s; ITL SLO ``itl_slo_s``, 0.2 s); FCFS on every instance. Every row gets the same
requests; all but ``tessera`` start with every service awake on a GPU of its own.

Rows:

- ``always-on``: one instance per model for the whole run.
- ``zero:no-activator``: an instance drains and retires after ``after_s`` (60 s) without a request
  (``tessera.core.activation.should_sleep``); nothing holds requests: a request for a model without a
  ready instance fails and its client retries every ``retry_s`` (2 s) until one is ready; a
  metrics-driven autoscaler that looks every ``poll_s`` (15 s, Kubernetes' HPA period) starts an
  instance for a model whose requests failed since its last look. Every wake-up is a cold start
  (``cold_start_s``, the profile's 30 s) on a GPU of its own.
- ``tessera:cold``: the same idle policy and cold starts; the activator holds such requests, starts the
  instance at once and releases them the moment it is ready, by class priority then arrival (the
  core's ``HoldQueue``, as the live router does).
- ``tessera``: the activator, and idle models sleep instead of stopping. The placement packs the
  services round robin onto ``shared_gpus`` (2) GPUs kept up (SeaLLM's packing of idle services; the
  services are alike here). Each model's server lives on its GPU: at most ``awake_per_gpu`` (2) of a
  GPU's models are awake at once, each with its weights and its share of the rest of the memory for KV
  and, as a worst case, its share of the compute (every step ``awake_per_gpu`` times slower); the others
  sleep. An idle model (``should_sleep``) sleeps at the depth ``tessera.core.activation.sleep_depth``
  gives: vLLM level 1 while its weights fit the host memory left for sleeping weights (``host_sleep_gb``,
  128 GB per GPU: a DGX A100's 1 TB over its 8 GPUs), else level 2; asleep ``stop_after_s`` (3600 s) it
  is stopped, and a GPU none of whose models has a server left is released. A held request wakes its
  model in place (``wake_cost_s``: level 1 ``wake_l1_s``, 0.64 s for 16 GB over the 25 GB/s host link;
  level 2 ``wake_l2_s``, 8 s; stopped: a cold start, the GPU brought up again if it was released);
  when its GPU already has ``awake_per_gpu`` models awake, a new server cold-starts on an extra GPU for
  as long as the model stays busy. Every model starts asleep at level 1 (the placement cannot hold them
  all awake). GPU-seconds count the GPUs kept up (a sleeping model holds no KV and no GPU of its own)
  and the extra GPUs while used. Stopping pays only when it empties a GPU: with the defaults nothing is
  stopped within the hour; ``--set stop_after_s=600`` stops 7 models, whose wake-ups become cold starts
  (attainment 94.7% instead of 98.7%), and saves 15 of 7788 GPU-seconds, so the default waits an hour.

Held requests wait for the whole wake-up (no ``holdSeconds`` deadline is modelled, so none gets 503) and
every request is served.

Metrics: the contract's keys, plus ``mean_gpus`` (GPU-seconds over the makespan), ``models_per_gpu``
(services over ``mean_gpus``), ``wakes`` (instances started after the start), ``woken_requests``
(requests that found their model asleep), ``first_after_idle`` (requests arriving ``after_s`` or more
after their model's previous one: the same set in every row), ``slo_attainment_first_after_idle``,
``ttft_first_after_idle_p50_s`` / ``_p99_s``, ``woken_ttft_p50_s`` / ``_p99_s``, and for ``tessera`` the
wake-ups by what they cost (``wakes_level1``, ``wakes_level2``, ``wakes_cold`` in place,
``wakes_extra_gpu``).

Checks (printed PASS/FAIL): ``tessera`` uses at most a third of ``always-on``'s GPU-seconds; its SLO
attainment is within 5 points of ``always-on``'s; no request is lost.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from tessera.bench.runner import option
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.core.activation import HoldQueue, SleepDepth, UnitState, should_sleep, sleep_depth, wake_cost_s
from tessera.core.profile import StepProfile
from tessera.core.profiles import load_profile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import slo_met, summarize, ttft
from tessera.sim.cluster import (
    AddInstance,
    Cluster,
    ClusterAction,
    ClusterConfig,
    ClusterController,
    ClusterRouter,
    ClusterView,
    Dispatch,
    DrainInstance,
    RouteRouter,
)
from tessera.sim.engine import SimInstance
from tessera.sim.workloads import build_requests, copy_requests, sharegpt_lengths

DESCRIPTION = "scale to zero: always-on vs scale to zero with and without the activator (on/off traffic)"
TRACE_REFUSED = (
    "scale-to-zero draws its own on/off traffic per service; shape it with --set burst_rate=, burst_s=, "
    "idle_gap_s=, services=, minutes="
)
ROWS = ("always-on", "zero:no-activator", "tessera:cold", "tessera")


@dataclass(frozen=True, slots=True)
class Settings:
    """The scenario's knobs (module docstring)."""

    services: int = 8
    minutes: float = 60.0
    burst_rate: float = 0.5
    burst_s: float = 120.0
    idle_gap_s: float = 900.0
    after_s: float = 60.0
    retry_s: float = 2.0
    poll_s: float = 15.0
    tick_s: float = 0.1
    ttft_slo_s: float = 10.0
    itl_slo_s: float = 0.2
    shared_gpus: int = 2
    awake_per_gpu: int = 2
    host_sleep_gb: float = 128.0
    stop_after_s: float = 3600.0


def on_off_arrivals(s: Settings, rng: np.random.Generator) -> list[float]:
    """One service's arrival times: bursts at ``burst_rate`` separated by exponential idle gaps."""
    end = s.minutes * 60.0
    out: list[float] = []
    t = float(rng.exponential(s.idle_gap_s / 2))  # services start at different points of their cycle
    while t < end:
        stop = min(end, t + s.burst_s)
        t += float(rng.exponential(1.0 / s.burst_rate))
        while t < stop:
            out.append(t)
            t += float(rng.exponential(1.0 / s.burst_rate))
        t = stop + float(rng.exponential(s.idle_gap_s))
    return out


def build_workload(s: Settings, seed: int) -> list[Request]:
    """Every service's requests, in arrival order."""
    rng = np.random.default_rng(seed)
    cls = ServiceClass(name="chat", kind="interactive", ttft_slo_s=s.ttft_slo_s, itl_slo_s=s.itl_slo_s)
    reqs: list[Request] = []
    for k in range(s.services):
        times = on_off_arrivals(s, rng)
        if not times:
            continue
        inp, out = sharegpt_lengths(len(times), rng)
        for r in build_requests(times, inp, out, rng, prefix=f"m{k}-"):
            r.model, r.service_class = f"m{k}", cls
            reqs.append(r)
    if not reqs:
        raise ValueError("the settings give no request; raise burst_rate, burst_s or minutes")
    return sorted(reqs, key=lambda r: r.arrival)


def first_after_idle(requests: Sequence[Request], after_s: float) -> set[str]:
    """Requests arriving ``after_s`` or more after their model's previous request (or as its first)."""
    last: dict[str, float] = {}
    out = set()
    for r in sorted(requests, key=lambda r: r.arrival):
        if r.arrival - last.get(r.model, -math.inf) >= after_s:
            out.add(r.id)
        last[r.model] = r.arrival
    return out


@dataclass
class _Demand:
    """What the router saw: each model's last arrival, and the requests that found it asleep."""

    last_arrival: dict[str, float] = field(default_factory=dict)
    woken: set[str] = field(default_factory=set)


class _SleepAwareRouter(ClusterRouter):
    """Routes to a ready instance of the model; holds the request (None) when there is none."""

    name = "scale-to-zero"

    def __init__(self, demand: _Demand) -> None:
        self.demand = demand
        self.inner = RouteRouter("least-loaded")

    def route(self, req: Request, view: ClusterView) -> SimInstance | None:
        """A ready instance of ``req``'s model, else None (held: by the activator, or a client retrying)."""
        self.demand.last_arrival[req.model] = view.now
        if not any(i.ready_at <= view.now for i in view.serving(req.model)):
            self.demand.woken.add(req.id)
            return None
        return self.inner.route(req, view)


class _ScaleToZero(ClusterController):
    """Idle instances drain and retire; held requests start an instance (at once with the activator,
    at the next poll without) and go to it once it is ready (at once with the activator, at the
    client's next retry without)."""

    def __init__(self, models: Sequence[str], demand: _Demand, s: Settings, activator: bool) -> None:
        self.models = list(models)
        self.demand = demand
        self.s = s
        self.activator = activator
        self.interval_s = s.tick_s
        self.next_poll = 0.0
        self.wakes = 0

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Sleep, wake and dispatch decisions at ``view.now``."""
        now = view.now
        held: dict[str, list[Request]] = defaultdict(list)
        for r in view.held:
            held[r.model].append(r)
        poll = now >= self.next_poll
        if poll:
            self.next_poll = now + self.s.poll_s
        actions: list[ClusterAction] = []
        for m in self.models:
            alive = view.serving(m)
            waiting = held.get(m, [])
            if not alive:
                if waiting and (self.activator or poll):
                    actions.append(AddInstance(models=(m,)))
                    self.wakes += 1
                continue
            inst = alive[0]
            if inst.ready_at > now:
                continue
            if waiting:
                actions += [Dispatch(r, inst.name) for r in self._due(waiting, inst.ready_at, now)]
            last = self.demand.last_arrival.get(m, 0.0)
            if should_sleep(UnitState.READY, last, inst.outstanding, len(waiting), self.s.after_s, now):
                actions.append(DrainInstance(inst.name))
        return actions

    def _due(self, waiting: list[Request], ready_at: float, now: float) -> list[Request]:
        if self.activator:  # released at once, in the live activator's order
            return _release_order(waiting)
        retry = self.s.retry_s  # a client's first retry at or after the instance became ready
        return [r for r in waiting if now >= r.arrival + math.ceil((ready_at - r.arrival) / retry) * retry]


def co_resident(profile: StepProfile, awake: int) -> StepProfile:
    """``profile`` as one of ``awake`` models awake at once on its GPUs: the others' weights leave it
    ``1/awake`` of the rest of the memory for KV, and (worst case: every one of them busy) ``1/awake``
    of the compute, so each step takes ``awake`` times longer. ValueError when no KV is left."""
    if awake == 1:
        return profile
    free = profile.kv_capacity_tokens * profile.kv_bytes_per_token - (awake - 1) * profile.weights_bytes
    tokens = int(free / awake) // profile.kv_bytes_per_token
    if tokens < 4096:
        raise ValueError(f"--set awake_per_gpu={awake}: {awake} copies of {profile.name}'s weights leave "
                         f"{max(tokens, 0)} KV tokens each (< 4096); lower awake_per_gpu")  # fmt: skip
    return replace(profile.slowed(awake), kv_capacity_tokens=tokens)


@dataclass(slots=True)
class _Sleeper:
    """One model under the ``tessera`` row: its home GPU, how deep it sleeps, whether it is awake."""

    home: int
    depth: SleepDepth = SleepDepth.LEVEL1
    asleep_since: float = 0.0
    awake: bool = False
    extra_gpu_since: float | None = None  # awake on an extra GPU (its home GPU was full) since then


class _SleepOnShared(ClusterController):
    """The ``tessera`` row (module docstring): idle models sleep on the shared GPUs, held requests wake
    them in place, at the cost and depth the core's activation decisions give."""

    def __init__(self, models: Sequence[str], profile: StepProfile, demand: _Demand, s: Settings) -> None:
        self.models = list(models)
        self.profile = profile
        self.shared = co_resident(profile, s.awake_per_gpu)
        self.demand = demand
        self.s = s
        self.interval_s = s.tick_s
        self.host_bytes = s.host_sleep_gb * 1e9
        self.host_used = [0.0] * s.shared_gpus  # sleeping (level 1) weights in each GPU's host memory
        self.up_since: list[float | None] = [0.0] * s.shared_gpus
        self.gpu_seconds = 0.0
        self.wakes: dict[str, int] = defaultdict(int)  # by cost: level1, level2, cold, extra_gpu
        self.state: dict[str, _Sleeper] = {}
        for k, m in enumerate(models):
            st = _Sleeper(home=k % s.shared_gpus)
            self.state[m] = st
            self._fall_asleep(st, 0.0)

    def _fall_asleep(self, st: _Sleeper, now: float) -> None:
        free = self.host_bytes - self.host_used[st.home]
        st.depth = sleep_depth(True, self.profile.weights_bytes, free, 0.0, self.s.stop_after_s)
        if st.depth is SleepDepth.LEVEL1:
            self.host_used[st.home] += self.profile.weights_bytes
        st.asleep_since, st.awake = now, False

    def _leave_depth(self, st: _Sleeper) -> None:
        if st.depth is SleepDepth.LEVEL1:
            self.host_used[st.home] -= self.profile.weights_bytes

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """Sleep, wake, stop and dispatch decisions at ``view.now``."""
        now = view.now
        held: dict[str, list[Request]] = defaultdict(list)
        for r in view.held:
            held[r.model].append(r)
        actions: list[ClusterAction] = []
        for m in self.models:
            st, waiting = self.state[m], held.get(m, [])
            if st.awake:
                inst = view.serving(m)[0]
                if inst.ready_at > now:
                    continue
                if waiting:
                    actions += [Dispatch(r, inst.name) for r in _release_order(waiting)]
                last = self.demand.last_arrival.get(m, 0.0)
                if should_sleep(UnitState.READY, last, inst.outstanding, len(waiting), self.s.after_s, now):
                    actions.append(DrainInstance(inst.name))  # nothing in flight: it retires at once
                    if st.extra_gpu_since is not None:  # that server stops; the one at home still sleeps
                        self.gpu_seconds += now - st.extra_gpu_since
                        st.extra_gpu_since, st.awake = None, False
                    else:
                        self._fall_asleep(st, now)
            elif waiting:
                actions.append(self._wake(m, st, now))
            elif st.depth is not SleepDepth.STOPPED:
                free = self.host_bytes - self.host_used[st.home]
                deeper = sleep_depth(True, self.profile.weights_bytes, free, now - st.asleep_since,
                                     self.s.stop_after_s)  # fmt: skip
                if deeper is SleepDepth.STOPPED:
                    self._leave_depth(st)
                    st.depth = deeper
        self._release_idle_gpus(now)
        return actions

    def _wake(self, m: str, st: _Sleeper, now: float) -> AddInstance:
        st.awake = True
        if (
            self._awake_at(st.home) > self.s.awake_per_gpu
        ):  # this one included  # its GPU is full: a new server on an extra GPU
            st.extra_gpu_since = now
            self.wakes["extra_gpu"] += 1
            return AddInstance(models=(m,), profiles={m: self.profile})
        cost = wake_cost_s(st.depth, self.shared)
        self.wakes["cold" if st.depth is SleepDepth.STOPPED else st.depth.value] += 1
        self._leave_depth(st)
        if self.up_since[st.home] is None:
            self.up_since[st.home] = now
        return AddInstance(models=(m,), profiles={m: replace(self.shared, cold_start_s=cost)})

    def _awake_at(self, gpu: int) -> int:
        """Models awake (or waking) on shared GPU ``gpu`` itself."""
        return sum(1 for o in self.state.values() if o.home == gpu and o.awake and o.extra_gpu_since is None)

    def _release_idle_gpus(self, now: float) -> None:
        for g, since in enumerate(self.up_since):
            if since is None or self._awake_at(g):
                continue
            if all(o.depth is SleepDepth.STOPPED for o in self.state.values() if o.home == g):
                self.gpu_seconds += now - since
                self.up_since[g] = None

    def finish(self, end: float) -> float:
        """GPU-seconds of a run that ended at ``end``: the shared GPUs while up, the extra ones while used."""
        total = self.gpu_seconds
        total += sum(end - t for t in self.up_since if t is not None)
        total += sum(end - st.extra_gpu_since for st in self.state.values() if st.extra_gpu_since is not None)
        return total


def _release_order(waiting: list[Request]) -> list[Request]:
    """Held requests in the live activator's release order (the core's ``HoldQueue``)."""
    queue: HoldQueue[Request] = HoldQueue(len(waiting))
    for r in waiting:
        queue.admit(r, r.service_class.priority, r.arrival)
    return queue.release()


def _run_row(
    name: str, reqs: list[Request], profile: StepProfile, s: Settings
) -> tuple[dict[str, Any], set[str]]:
    models = [f"m{k}" for k in range(s.services)]
    config = ClusterConfig(profiles={m: profile for m in models}, instances=0)
    demand = _Demand()
    controller: _ScaleToZero | _SleepOnShared | None = None
    if name == "tessera":
        controller = _SleepOnShared(models, profile, demand, s)
    elif name != "always-on":
        controller = _ScaleToZero(models, demand, s, activator=name == "tessera:cold")
    router = RouteRouter("least-loaded") if controller is None else _SleepAwareRouter(demand)
    cluster = Cluster(config, lambda: make_policy("fcfs"), router=router, controller=controller)
    if not isinstance(controller, _SleepOnShared):  # tessera's models start asleep on the shared GPUs
        for m in models:
            cluster.add_instance(models=[m], cold=False)
    result = cluster.run(reqs)
    gpu_seconds = (
        controller.finish(cluster.now) if isinstance(controller, _SleepOnShared) else result.gpu_seconds
    )
    metrics = summarize(reqs, gpu_seconds=gpu_seconds, makespan_s=result.makespan_s,
                        wall_s=result.wall_s)  # fmt: skip
    mean_gpus = gpu_seconds / max(cluster.now, 1e-9)
    wakes = controller.wakes if isinstance(controller, _ScaleToZero) else 0
    by_cost: dict[str, int] = {}
    if isinstance(controller, _SleepOnShared):
        by_cost = {
            f"wakes_{k}": controller.wakes.get(k, 0) for k in ("level1", "level2", "cold", "extra_gpu")
        }
        wakes = sum(by_cost.values())
    metrics.update(
        lost=len(cluster.rejected),  # requests the cluster dropped (every other one finished)
        mean_gpus=mean_gpus,
        models_per_gpu=len(models) / mean_gpus if mean_gpus > 0 else None,
        wakes=wakes,
        woken_requests=len(demand.woken),
        **by_cost,
    )
    return metrics, demand.woken


def _percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p50_s": None, f"{prefix}_p99_s": None}
    return {
        f"{prefix}_p50_s": float(np.percentile(values, 50)),
        f"{prefix}_p99_s": float(np.percentile(values, 99)),
    }


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """The rows on the same requests, then the checks."""
    opts = config.options
    defaults = Settings()
    s = Settings(**{f.name: option(opts, f.name, getattr(defaults, f.name), type(getattr(defaults, f.name)))
                    for f in fields(Settings)})  # fmt: skip
    if config.load is not None:
        raise ValueError("--load: scale-to-zero has no capacity to scale to; --rate sets the burst rate")
    if config.rate is not None:
        s = replace(s, burst_rate=config.rate)
    _validate(s)
    profile = load_profile(str(option(opts, "profile", "a100-llama3-8b", str)))
    profile = replace(
        profile,
        cold_start_s=option(opts, "cold_start_s", profile.cold_start_s, float),
        wake_l1_s=option(opts, "wake_l1_s", profile.wake_time(1), float),
        wake_l2_s=option(opts, "wake_l2_s", profile.wake_time(2), float),
    )
    for name in ("cold_start_s", "wake_l1_s", "wake_l2_s"):
        if not getattr(profile, name) >= 0:
            raise ValueError(f"--set {name} must be >= 0 seconds, got {getattr(profile, name)}")
    base = build_workload(s, config.seed)
    idle_set = first_after_idle(base, s.after_s)
    progress(0, total=len(ROWS))
    rows = []
    for name in ROWS:
        reqs = copy_requests(base)
        metrics, woken = _run_row(name, reqs, profile, s)
        firsts = [r for r in reqs if r.id in idle_set]
        met = [m for m in (slo_met(r) for r in firsts) if m is not None]
        metrics["first_after_idle"] = len(firsts)
        metrics["slo_attainment_first_after_idle"] = sum(met) / len(met) if met else None
        metrics.update(_percentiles([ttft(r) for r in firsts], "ttft_first_after_idle"))
        metrics.update(_percentiles([ttft(r) for r in reqs if r.id in woken], "woken_ttft"))
        rows.append({"policy": name, **metrics})
        progress(1)
    cfg = {**config.as_dict(), **asdict(s), "profile": profile.name, "cold_start_s": profile.cold_start_s,
           "wake_l1_s": profile.wake_l1_s, "wake_l2_s": profile.wake_l2_s}  # fmt: skip
    return BenchReport("scale-to-zero", cfg, rows, _checks(rows))


def _validate(s: Settings) -> None:
    """Refuse settings that cannot run, naming the option."""
    positive = ("minutes", "burst_rate", "burst_s", "idle_gap_s", "after_s", "retry_s", "poll_s", "tick_s",
                "ttft_slo_s", "itl_slo_s")  # fmt: skip
    for name in positive:
        if not getattr(s, name) > 0:
            raise ValueError(f"--set {name} must be > 0, got {getattr(s, name)}")
    for name in ("services", "shared_gpus", "awake_per_gpu"):
        if getattr(s, name) < 1:
            raise ValueError(f"--set {name} must be >= 1, got {getattr(s, name)}")
    if not s.host_sleep_gb >= 0:
        raise ValueError(f"--set host_sleep_gb must be >= 0, got {s.host_sleep_gb}")
    if not s.stop_after_s > 0:
        raise ValueError(f"--set stop_after_s must be > 0 (inf: never stop), got {s.stop_after_s}")


def _checks(rows: list[dict[str, Any]]) -> list[str]:
    """Tessera against always-on: GPU-seconds at most a third, SLO attainment within 5 points, none lost."""
    by = {r["policy"]: r for r in rows}
    on, zero = by["always-on"], by["tessera"]
    ratio = on["gpu_seconds"] / zero["gpu_seconds"] if zero["gpu_seconds"] > 0 else math.inf
    gap = (on["slo_attainment"] - zero["slo_attainment"]) * 100
    lines = [_row_line(r) for r in rows]
    return [
        *lines,
        f"tessera GPU-seconds {zero['gpu_seconds']:.0f} vs always-on {on['gpu_seconds']:.0f}: "
        f"{ratio:.2f}x fewer (target >= 3x): {'PASS' if ratio >= 3 else 'FAIL'}",
        f"tessera SLO attainment {zero['slo_attainment']:.1%} vs always-on {on['slo_attainment']:.1%}: "
        f"{gap:.1f} points below (target <= 5): {'PASS' if gap <= 5 else 'FAIL'}",
        f"tessera requests lost: {zero['lost']} (target 0): {'PASS' if zero['lost'] == 0 else 'FAIL'}",
    ]


def _row_line(r: dict[str, Any]) -> str:
    """A row's scale-to-zero figures (the table shows the contract's keys only)."""
    first = f"{_num(r['ttft_first_after_idle_p50_s'])}/{_num(r['ttft_first_after_idle_p99_s'])}"
    woken = f"{_num(r['woken_ttft_p50_s'])}/{_num(r['woken_ttft_p99_s'])}"
    return (
        f"{r['policy']}: models per GPU {_num(r['models_per_gpu'])}, wakes {r['wakes']}; the "
        f"{r['first_after_idle']} first requests after idle: SLO attainment "
        f"{_num(r['slo_attainment_first_after_idle'])}, TTFT p50/p99 {first} s; {r['woken_requests']} woken "
        f"requests: TTFT p50/p99 {woken} s{_wakes_by_cost(r)}"
    )


def _wakes_by_cost(r: dict[str, Any]) -> str:
    if "wakes_level1" not in r:
        return ""
    return (
        f"; wake-ups from level 1 {r['wakes_level1']}, level 2 {r['wakes_level2']}, "
        f"stopped {r['wakes_cold']}, on an extra GPU {r['wakes_extra_gpu']}"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
