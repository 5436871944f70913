"""`tessera bench load-shift`: the operator's reconcile loop on the simulated cluster through a load shift.

What runs is the operator's code, not a model of it: ``tessera.operator.controller.Controller`` (what the
kopf pool daemon calls every tick: ``due``, then ``reconcile_pool``, which validates the specs, builds the
planner's inputs from the measured load (``tessera.control.inputs``), plans (``pool_plan`` /
``placement``), adapts the re-placement interval (SeaLLM's Eq. 8) and writes the children and status)
against an in-memory API (``MemoryKube``). The cluster is ``tessera.sim``: each StatefulSet replica the
operator asks for is a simulated engine instance of its group (the placement estimator's instance:
``placement_sim.group_profiles``, its models sharing it as the pool's pods do: the sim engine's cannot
sleep, so a group of several models is co-resident, each with its own KV share; ready after the
weight-load stall), a removed replica drains, and the group's StatefulSet reports its ready replicas
back. What the workers measured reaches the operator as Prometheus answers it: each model's
``tessera_*`` counters (finished, refused, prompt and output tokens, latency, SLO met and missed, judged by
``tessera.core.slo.slo_met`` as the worker judges them) sampled at the subqueries' steps and parsed by
``metrics_queries.loads_from_results``. Counters move when a request finishes (CHOICE: the worker's ITL
samples come per token; per request here).

Workload (``--set`` options, defaults in brackets): one interactive class (SLO ``ttft`` [1] and ``itl``
[0.1] seconds), one service per rate on an 8B model (the H100 profile), Poisson arrivals at ``rates``
[4,4] req/s per service, lognormal lengths (means ``prompt`` [1024] and ``output`` [2048] tokens, CV
0.5). At ``shift_minute`` [5] each service's rate is multiplied by its factor (``factors`` [2,0.5]: the
first doubles, the second halves); the run lasts ``minutes`` [10]. The pool has ``gpus`` [4] single-GPU
instances, strategy seallm, replacement interval ``interval_s`` [60] within ``min_interval_s`` [30] and
``max_interval_s`` [300], ``beta`` [0.1]; every service declares its pre-shift load (``expectedLoad``),
so the first plan is made for it. The services run FCFS: each simulated pod runs the policy its
group's ConfigMap names (``WorkerConfig.make_policy``, as the worker does).

Rows, one per system and phase (requests by arrival): ``before`` the shift (from the first placement's
instances being ready), ``during`` (from the shift until the first re-placement after it is rolled out:
its groups ready; one interval when there is none), ``after`` (to the end):
- ``operator-loop``: the controller with the simulated workers' metrics (re-placement at its adaptive
  boundaries);
- ``static``: the same controller without metrics (the operator without Prometheus): the first
  placement stays.

Checks: the first re-placement after the shift (a placement that changes the groups) comes within the
interval in effect at the shift and gives the service that grew more instances, the other no more;
attainment after the shift recovers to within ``recovery`` [0.05] of before; the loop beats the static
placement after the shift; and at every placement the live loop made from measurements, ``tessera bench
seallm``'s planner step (``seallm.replan``) on the same load history gives the same groups. Information
lines list the interval's trajectory and the placements. Groups of several services get their estimate
error, group by group (Eq. 8's ``|measured − estimated| / estimated`` of the group's attainment, target
0.15 median): at each placement, the estimate the planner made of the group against what its instances
met while the plan was in effect (``shared_group_errors``), and for the static loop's kept plan, each
interval's own arrivals replayed through the estimator (``replayed_group_errors``: the model alone, not
the load forecast).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tessera.api import GROUP, VERSION, LLMService, ServingPool
from tessera.bench.scenarios import BenchConfig, BenchReport, Progress
from tessera.bench.scenarios.seallm import replan, with_history
from tessera.control.children import GROUP_LABEL, read_group_config_map
from tessera.control.inputs import pool_input, service_inputs, service_load
from tessera.control.metrics_queries import LOAD_GAUGES, ModelLoad, load_step_s, loads_from_results
from tessera.control.placement import estimate, groups_of_plan, simulate_performance
from tessera.control.placement_sim import ENGINES, Dispatcher, SwitchCost, group_profiles, pool_sharing
from tessera.control.pool_plan import parse, parse_classes
from tessera.core.baselines import FCFS
from tessera.core.planners import (
    GroupPlan,
    HistoryRequest,
    MetricsSnapshot,
    PlacementPlan,
    PoolInput,
    ServiceInput,
)
from tessera.core.policy import Policy
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import latency_metrics, slo_met
from tessera.operator import status as st
from tessera.operator.controller import Controller
from tessera.operator.reconcile import Action
from tessera.sim.cluster import (
    AddInstance,
    Cluster,
    ClusterAction,
    ClusterConfig,
    ClusterController,
    ClusterView,
    DrainInstance,
)
from tessera.sim.coresident import CoResidentInstance
from tessera.sim.engine import SimInstance

DESCRIPTION = (
    "the operator's reconcile loop on the simulated cluster through a load shift (re-plan vs static)"
)
TRACE_REFUSED = (
    "it builds its own load shift (Poisson arrivals per service); set the rates with --set rates=R1,R2 and "
    "the shift with --set factors=F1,F2 and shift_minute=M"
)
NS, POOL, CLASS = "bench", "pool", "chat"
# The simulation's t=0 as wall-clock time: a whole minute, so the subqueries' steps fall on it.
EPOCH = 1_800_000_000.0
TICK_S = 1.0  # the operator's pool daemon tick
LENGTH_CV = 0.5
PHASES = ("before", "during", "after")
PLURALS = {"ServingPool": "servingpools", "LLMService": "llmservices", "RequestClass": "requestclasses"}
KNOWN = {
    "rates", "factors", "minutes", "shift_minute", "gpus", "prompt", "output", "ttft", "itl", "interval_s",
    "min_interval_s", "max_interval_s", "beta", "recovery",
}  # fmt: skip


# -- the API server and the workers' metrics ------------------------------------------------------------


def merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """JSON merge patch (RFC 7386) of ``patch`` into ``target``, as the API server applies a status patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class MemoryKube:
    """The operator's ``Kube`` adapter over objects in memory (one namespace)."""

    def __init__(self, bodies: Sequence[Mapping[str, Any]]) -> None:
        self.objects = {(PLURALS[b["kind"]], b["metadata"]["name"]): copy.deepcopy(dict(b)) for b in bodies}
        self.children: dict[tuple[str, str], dict[str, Any]] = {}

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A Tessera object's body, None when absent."""
        body = self.objects.get((plural, name))
        return copy.deepcopy(body) if body is not None else None

    def patch_status(self, plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch a Tessera object's status."""
        merge_patch(self.objects[(plural, name)].setdefault("status", {}), status)

    def list_children(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """The children carrying every label of ``labels``."""
        return [
            copy.deepcopy(c)
            for c in self.children.values()
            if all((c["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def apply(self, namespace: str, action: Action) -> None:
        """Create, patch (replace what the operator sets, keep the status) or delete a child."""
        key = (action.kind, action.name)
        if action.verb == "delete":
            self.children.pop(key, None)
            return
        assert action.body is not None
        body = copy.deepcopy(dict(action.body))
        if key in self.children and "status" in self.children[key]:
            body["status"] = self.children[key]["status"]
        self.children[key] = body

    def bodies(self, plural: str) -> list[dict[str, Any]]:
        """Every Tessera object of a kind."""
        return [copy.deepcopy(b) for (p, _), b in self.objects.items() if p == plural]


class SimulatedWorkers:
    """The operator's ``MetricsSource`` over the simulated cluster: each model's counters as the workers
    export them, sampled as Prometheus's subqueries sample them, parsed by the operator's own parser."""

    def __init__(self, models: Mapping[str, str], requests: Sequence[Request]) -> None:
        self.models = dict(models)  # service (the simulator's model) -> served model name
        self.requests = requests
        self.cluster: Cluster | None = None
        self.now = 0.0  # simulated seconds
        self.calls: list[tuple[float, float, dict[str, ModelLoad]]] = []  # (now, window, loads)

    def snapshot(self, *args: Any) -> MetricsSnapshot | None:
        """No autoscaling in this scenario."""
        return None

    def attainment(self, namespace: str, pool: str, model: str) -> list[dict[str, Any]] | None:
        """Not read by this scenario's checks."""
        return None

    def batch_sizes(self, namespace: str, pool: str) -> dict[str, int] | None:
        """Not read by this scenario's checks."""
        return None

    def idle(self, namespace: str, pool: str, group: str, window_s: float) -> bool | None:
        """No service of this scenario scales to zero."""
        return None

    def loads(self, namespace: str, pool: str, window_s: float) -> dict[str, ModelLoad] | None:
        """Every model's load over the last ``window_s`` seconds, through ``loads_from_results``."""
        assert self.cluster is not None
        step = load_step_s(window_s)
        span = math.ceil(window_s / step) * step + step
        now = EPOCH + self.now
        grid = np.arange(math.floor((now - span) / step) + 1, math.floor(now / step) + 1) * step
        sim_grid = grid - EPOCH
        done = [r for r in self.requests if r.finished_at is not None and r.finished_at <= self.now]
        rejected = self.cluster.rejected
        results: dict[str, list[dict[str, Any]]] = {
            k: [] for k in ("up", *_COUNTERS, "rejected", *LOAD_GAUGES)
        }
        instances = [*self.cluster.instances, *self.cluster.retired]
        for service, model in self.models.items():
            ends = [r for r in done if r.model == service]
            at = np.array([r.finished_at for r in ends], dtype=float)
            for key, value in _COUNTERS.items():
                results[key].append(_series(model, sim_grid, grid, at, [value(r) for r in ends]))
            refused = [r for r in rejected if r.model == service]
            at_refused = np.array([r.arrival for r in refused], dtype=float)
            results["rejected"].append(_series(model, sim_grid, grid, at_refused, [1.0] * len(refused)))
            # The requests its workers hold at each point (the worker's queue and in-flight gauges; all
            # counted as queued here): arrived by then, not refused, not finished yet.
            refused_ids = {id(r) for r in refused}
            mine = [r for r in self.requests if r.model == service and id(r) not in refused_ids]
            come = [r.arrival for r in mine]
            gone = [r.finished_at for r in mine if r.finished_at is not None]
            at_moves = np.array([*come, *gone], dtype=float)
            results["queued"].append(
                _series(model, sim_grid, grid, at_moves, [1.0] * len(come) + [-1.0] * len(gone))
            )
            seen = [
                [t, "256"]
                for t, s in zip(grid.tolist(), sim_grid.tolist(), strict=True)
                if any(
                    service in i.profiles and i.created_at <= s and (i.retired_at is None or i.retired_at > s)
                    for i in instances
                )
            ]
            results["up"].append({"metric": {"model": model, "pod": "sim"}, "values": seen})
        loads = loads_from_results(results)
        self.calls.append((self.now, window_s, loads))
        return loads


def _met(value: bool) -> Any:
    return lambda r: float(slo_met(r) is value)


# The workers' counters (keys of metrics_queries.LOAD_COUNTERS) by what each finished request adds.
_COUNTERS = {
    "finished": lambda r: 1.0,
    "later_tokens": lambda r: float(max(0, r.generated - 1)),
    "e2e_seconds": lambda r: r.finished_at - r.arrival,
    "prompt_tokens": lambda r: float(r.prompt_tokens),
    "slo_met": _met(True),
    "slo_missed": _met(False),
}


def _series(model: str, sim_grid: np.ndarray, grid: np.ndarray, at: np.ndarray, add: list[float]) -> dict:
    """One counter (or gauge) series: its value at each grid point is the sum of ``add`` of the events up
    to it."""
    order = np.argsort(at, kind="stable")
    at, cum = at[order], np.concatenate([[0.0], np.cumsum(np.asarray(add, dtype=float)[order])])
    values = cum[np.searchsorted(at, sim_grid, side="right")]
    return {
        "metric": {"model": model, "pod": "sim", "class": CLASS},
        "values": [[t, repr(float(v))] for t, v in zip(grid.tolist(), values.tolist(), strict=True)],
    }


# -- the operator loop on the simulated cluster --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """One placement the operator made: when (simulated seconds), the interval set there, what the
    interval that ended measured against its estimate, and the groups."""

    at_s: float
    interval_s: float
    estimate_error: float | None
    measured_attainment: float | None
    estimated_attainment: float | None
    groups: tuple[GroupPlan, ...]
    seallm_agrees: bool | None  # tessera bench seallm's planner on the same history (None: not measured)
    # the estimator's attainment of each group's requests, on the inputs the operator planned from
    group_estimates: Mapping[tuple[tuple[str, ...], int], float]

    def instances(self, service: str) -> int:
        """Instances hosting ``service``."""
        return sum(g.replicas.total for g in self.groups if service in g.services)


class OperatorLoop(ClusterController):
    """The pool daemon's ticks on simulated time: a due pass runs ``Controller.reconcile_pool``; the
    StatefulSets' replicas become simulated instances (added cold, removed by draining) and their ready
    instances the StatefulSets' ``readyReplicas``."""

    interval_s = TICK_S

    def __init__(
        self,
        controller: Controller,
        kube: MemoryKube,
        workers: SimulatedWorkers | None,
        pool: PoolInput,
        services: Mapping[str, ServiceInput],
    ) -> None:
        self.controller, self.kube, self.workers = controller, kube, workers
        self.pool, self.services = pool, dict(services)
        self.switch = SwitchCost()
        self.groups: dict[tuple[tuple[str, ...], int], str] = {}  # (services, tp) -> group name
        self.placements: list[Placement] = []
        self.rolled_out: list[tuple[float, float]] = []  # (placement at, all its groups ready at)
        self._pending: float | None = None

    def tick(self, view: ClusterView) -> list[ClusterAction]:
        """One daemon tick: readiness reported, a pass when due, the instances brought in line."""
        now = EPOCH + view.now
        if self.workers is not None:
            self.workers.now = view.now
        self._report_ready(view)
        first = not self.placements
        if first or self.controller.due(NS, POOL, now):
            before = self.kube.objects[("servingpools", POOL)].get("status", {}).get("lastPlacementTime")
            calls = len(self.workers.calls) if self.workers is not None else 0
            self.controller.reconcile_pool(
                NS, POOL, self.kube.bodies("llmservices"), self.kube.bodies("requestclasses"), now, True
            )
            status = self.kube.objects[("servingpools", POOL)]["status"]
            if status.get("lastPlacementTime") != before:
                self._record(view.now, status, calls)
        return self._converge(view)

    def _record(self, at: float, status: Mapping[str, Any], calls: int) -> None:
        plan = st.plan_from_status(status.get("placement"))
        assert plan is not None
        for g in plan.groups:
            self.groups[g.key] = g.name
        measured = status.get("measured") or {}
        agrees = None
        inputs = list(self.services.values())  # the declared loads, until the workers measure
        if self.workers is not None and len(self.workers.calls) > calls:
            previous = self.placements[-1] if self.placements else None
            now, window, measured_loads = self.workers.calls[-1]
            inputs, spans = self._measured_inputs(window, measured_loads)
            agrees = self._seallm_agrees(plan, previous, now, inputs, spans)
        self.placements.append(
            Placement(
                at,
                float(status["replacementIntervalSeconds"]),
                status.get("estimateError"),
                measured.get("sloAttainment"),
                plan.estimated_slo_attainment,
                plan.groups,
                agrees,
                self._group_estimates(plan, inputs),
            )
        )
        self._pending = at

    def _group_estimates(
        self, plan: PlacementPlan, inputs: Sequence[ServiceInput]
    ) -> dict[tuple[tuple[str, ...], int], float]:
        """Each group's estimated attainment as the operator's planner scores the plan on ``inputs``
        (simulated on the history, analytic without one)."""
        groups = groups_of_plan(plan)
        if any(s.history for s in inputs):
            return simulate_performance(self.pool, inputs, groups).by_group
        return estimate(self.pool, inputs, groups).by_group

    def _measured_inputs(
        self, window: float, measured: Mapping[str, ModelLoad]
    ) -> tuple[list[ServiceInput], dict[str, float]]:
        """The planner's inputs from the loads one pass planned from (the operator's builder), and each
        service's window."""
        pool = parse(self.kube.objects[("servingpools", POOL)])
        assert isinstance(pool, ServingPool)
        classes, _ = parse_classes(self.kube.bodies("requestclasses"))
        services = [s for s in map(parse, self.kube.bodies("llmservices")) if isinstance(s, LLMService)]
        loads = {s.name: service_load(s, measured.get(s.spec.model.name), window) for s in services}
        spans = {n: load.window_s or window for n, load in loads.items()}
        return service_inputs(pool, services, loads, classes), spans

    def _seallm_agrees(
        self,
        plan: PlacementPlan,
        previous: Placement | None,
        now: float,
        inputs: Sequence[ServiceInput],
        spans: Mapping[str, float],
    ) -> bool:
        """Whether ``tessera bench seallm``'s re-placement step, given the load history this pass planned
        from (``inputs`` and their windows ``spans``: the operator's input builder over the same
        measurements), gives the plan's groups."""
        history = {s.name: s.history for s in inputs}
        if len(set(spans.values())) != 1:
            return False  # one span per boundary in the seallm bench; the services' differ here
        earlier = PlacementPlan("seallm", previous.groups) if previous is not None else None
        backlog = {s.name: s.backlog for s in inputs}
        theirs = replan(
            self.pool, inputs, history, next(iter(spans.values())), EPOCH + now, earlier, None, backlog
        )
        return {(g.key, g.replicas.total) for g in theirs.groups} == {
            (g.key, g.replicas.total) for g in plan.groups
        }

    def _report_ready(self, view: ClusterView) -> None:
        ready: dict[str, int] = {}
        for inst in view.instances:
            name = self._group_of(inst)
            if name is not None and not inst.draining and inst.ready_at <= view.now:
                ready[name] = ready.get(name, 0) + 1
        for (kind, _), body in self.kube.children.items():
            if kind == "StatefulSet":
                group = body["metadata"]["labels"][GROUP_LABEL]
                body["status"] = {"replicas": body["spec"]["replicas"], "readyReplicas": ready.get(group, 0)}
        if self._pending is not None and self.placements:
            want = {g.name: g.replicas.total for g in self.placements[-1].groups}
            if all(ready.get(n, 0) >= r for n, r in want.items()):
                self.rolled_out.append((self._pending, view.now))
                self._pending = None

    def _group_of(self, inst: SimInstance) -> str | None:
        return self.groups.get((tuple(sorted(inst.profiles)), inst.gpus))

    def _policy_of(self, group: str) -> Callable[[], Policy]:
        """The policy the group's pods run: the one their ConfigMap's worker configuration names (read
        only when the group adds instances, not on every tick)."""
        for (kind, _), body in self.kube.children.items():
            if kind == "ConfigMap" and (body["metadata"].get("labels") or {}).get(GROUP_LABEL) == group:
                read = read_group_config_map(body)
                if read is not None:
                    return read.config.make_policy
        raise LookupError(f"group {group!r} has a StatefulSet but no worker ConfigMap")

    def _converge(self, view: ClusterView) -> list[ClusterAction]:
        want = {
            body["metadata"]["labels"][GROUP_LABEL]: int(body["spec"]["replicas"])
            for (kind, _), body in self.kube.children.items()
            if kind == "StatefulSet"
        }
        have: dict[str, list[SimInstance]] = {}
        for inst in view.instances:
            name = self._group_of(inst)
            if not inst.draining and name is not None:
                have.setdefault(name, []).append(inst)
        actions: list[ClusterAction] = []
        for (services, tp), name in self.groups.items():
            running = sorted(have.get(name, []), key=lambda i: i.outstanding)
            missing = want.get(name, 0) - len(running)
            if missing > 0:
                members = [self.services[s] for s in services]
                stall = self.switch.stall_s(members, tp)
                profiles = group_profiles(self.pool, members, tp, stall_s=stall)
                policy = self._policy_of(name)
                actions += [AddInstance(models=tuple(profiles), profiles=profiles, policy=policy)] * missing
            actions += [DrainInstance(i.name) for i in running[: max(0, -missing)]]
        return actions


# -- the workload, the documents, the rows -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """The scenario's settings (``--set``)."""

    rates: tuple[float, ...]
    factors: tuple[float, ...]
    minutes: float
    shift_minute: float
    gpus: int
    prompt: int
    output: int
    ttft: float
    itl: float
    interval: dict[str, float]
    recovery: float

    @property
    def names(self) -> list[str]:
        """The services' names."""
        return [f"s{i}" for i in range(len(self.rates))]


def _numbers(options: Mapping[str, Any], key: str, default: Sequence[float]) -> tuple[float, ...]:
    text = options.get(key)
    if text is None:
        return tuple(default)
    try:
        values = tuple(float(x) for x in str(text).split(","))
    except ValueError as exc:
        raise ValueError(f"--set {key}= must be numbers separated by commas, got {text!r}") from exc
    if any(v <= 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"--set {key}= must be > 0, got {text!r}")
    return values


def _number(options: Mapping[str, Any], key: str, default: float) -> float:
    values = _numbers(options, key, [default])
    if len(values) != 1:
        raise ValueError(f"--set {key}= takes one number, got {options[key]!r}")
    return values[0]


def setup(config: BenchConfig) -> Setup:
    """The settings from ``--set``, validated."""
    options = config.options
    unknown = sorted(set(options) - KNOWN)
    if unknown:
        raise ValueError(f"unknown --set options {unknown}; known: {sorted(KNOWN)}")
    rates = _numbers(options, "rates", (4.0, 4.0))
    factors = _numbers(options, "factors", (2.0, 0.5))
    if len(rates) < 2 or len(rates) != len(factors):
        raise ValueError(f"--set rates= and factors= need one value per service (two or more), got "
                         f"{len(rates)} rates and {len(factors)} factors")  # fmt: skip
    minutes, shift = _number(options, "minutes", 10), _number(options, "shift_minute", 5)
    if shift >= minutes:
        raise ValueError(f"--set shift_minute= must be before the end (minutes={minutes:g}), got {shift:g}")
    gpus = _number(options, "gpus", 4)
    if gpus != int(gpus) or gpus < len(rates):
        raise ValueError(f"--set gpus= must be a whole number >= the services ({len(rates)}), got {gpus:g}")
    recovery = _number(options, "recovery", 0.05)
    if recovery >= 1:
        raise ValueError(f"--set recovery= is an attainment difference in (0, 1), got {recovery:g}")
    interval = {
        "initialSeconds": _number(options, "interval_s", 60),
        "minSeconds": _number(options, "min_interval_s", 30),
        "maxSeconds": _number(options, "max_interval_s", 300),
        "beta": _number(options, "beta", 0.1),
    }
    return Setup(
        rates, factors, minutes, shift, int(gpus), round(_number(options, "prompt", 1024)),
        round(_number(options, "output", 2048)), _number(options, "ttft", 1.0), _number(options, "itl", 0.1),
        interval, recovery,
    )  # fmt: skip


def documents(s: Setup) -> list[dict[str, Any]]:
    """The pool, the class and the services (each declaring its pre-shift load)."""

    def meta(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": name,
        }

    api = f"{GROUP}/{VERSION}"
    pool = {
        "apiVersion": api,
        "kind": "ServingPool",
        "metadata": {**meta(POOL), "annotations": {"tessera.dev/engine": "sim"}},
        "spec": {
            "gpu": {"type": "H100", "memory": "80Gi"},
            "instances": {"min": 1, "max": s.gpus},
            "autoscaling": {"enabled": False},
            "placement": {"strategy": "seallm", "replacementInterval": s.interval},
        },
    }
    chat = {
        "apiVersion": api,
        "kind": "RequestClass",
        "metadata": meta(CLASS),
        "spec": {"kind": "interactive", "slo": {"ttftSeconds": s.ttft, "itlSeconds": s.itl}},
    }
    services = [
        {
            "apiVersion": api,
            "kind": "LLMService",
            "metadata": meta(name),
            "spec": {
                "model": {"name": f"org/{name}-8B"},
                "poolRef": {"name": POOL},
                "requestClasses": [{"name": CLASS}],
                "scheduling": {"policy": "fcfs"},
                "replicas": {"min": 1, "max": s.gpus},
                "expectedLoad": {
                    "requestsPerSecond": rate,
                    "promptTokens": s.prompt,
                    "outputTokens": s.output,
                },
            },
        }
        for name, rate in zip(s.names, s.rates, strict=True)
    ]
    return [pool, chat, *services]


def workload(s: Setup, seed: int, service_class: ServiceClass) -> list[Request]:
    """Poisson arrivals per service (the rate times its factor after the shift), lognormal lengths."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log(1 + LENGTH_CV**2))
    out: list[tuple[float, str, int, int]] = []
    shift, end = s.shift_minute * 60.0, s.minutes * 60.0
    for name, rate, factor in zip(s.names, s.rates, s.factors, strict=True):
        t = 0.0
        while True:
            t += rng.exponential(1.0 / (rate if t < shift else rate * factor))
            if t >= end:
                break
            prompt = max(1, round(rng.lognormal(math.log(s.prompt) - sigma**2 / 2, sigma)))
            output = max(1, round(rng.lognormal(math.log(s.output) - sigma**2 / 2, sigma)))
            out.append((t, name, prompt, output))
    out.sort()
    return [
        Request(f"r{i}", t, p, o, model=name, true_output_tokens=o, service_class=service_class)
        for i, (t, name, p, o) in enumerate(out)
    ]


def run_loop(s: Setup, seed: int, measured: bool) -> tuple[list[Request], Cluster, OperatorLoop]:
    """One run of the operator loop on the simulated cluster (``measured``: with the workers' metrics)."""
    docs = documents(s)
    kube = MemoryKube(docs)
    pool = parse(docs[0])
    assert isinstance(pool, ServingPool)
    classes, _ = parse_classes([docs[1]])
    services = [parse(d) for d in docs[2:]]
    inputs = {i.name: i for i in service_inputs(pool, services, None, classes)}
    requests = workload(s, seed, classes[CLASS].to_service_class(CLASS))
    workers = SimulatedWorkers({v.name: v.spec.model.name for v in services}, requests) if measured else None
    controller = Controller(kube, lambda *event: None, workers)
    planned = pool_input(pool)
    loop = OperatorLoop(controller, kube, workers, planned, inputs)
    profiles = {n: i.profile for n, i in inputs.items()}
    cluster = Cluster(
        # FCFS is only the cluster's default: each instance is added with its group's own policy.
        ClusterConfig(profiles, instances=0, engine=ENGINES[pool_sharing(planned)]),
        FCFS,
        router=Dispatcher(),
        controller=loop,
    )
    if workers is not None:
        workers.cluster = cluster
    cluster.run(requests)
    return requests, cluster, loop


def phase_row(
    name: str, requests: Sequence[Request], rejected: Sequence[Request], span: tuple[float, float]
) -> dict:
    """A row of the requests that arrived in ``span``: attainment (a refused request misses), latencies."""
    start, end = span
    chosen = [r for r in requests if start <= r.arrival < end]
    refused = {id(r) for r in rejected}
    served = [r for r in chosen if id(r) not in refused]
    met = [bool(slo_met(r)) for r in served] + [False] * (len(chosen) - len(served))
    ttft = [r.first_token_at - r.arrival for r in served if r.first_token_at is not None]
    jct = [r.finished_at - r.arrival for r in served if r.finished_at is not None]
    by_service: dict[str, list[bool]] = {}
    for r, ok in zip([*served, *(r for r in chosen if id(r) in refused)], met, strict=True):
        by_service.setdefault(r.model, []).append(ok)
    return {
        "policy": name,
        "requests": len(chosen),
        **latency_metrics(ttft, jct, met, end - start),
        "slo_attainment": float(np.mean(met)) if met else None,
        "slo_attainment_by_class": {k: float(np.mean(v)) for k, v in sorted(by_service.items())},
        "window_s": [round(start, 1), round(end, 1)],
        "rejected": len(chosen) - len(served),
    }


def shared_group_errors(
    loop: OperatorLoop, requests: Sequence[Request], cluster: Cluster, end: float
) -> list[dict]:
    """For each placement and each of its groups of several services: the estimator's attainment of the
    group's requests (on the inputs the operator planned from) against what the group's instances met
    for the requests that arrived while the plan was in effect (from its groups being ready to the next
    placement, else one interval), and Eq. 8's error of it (``|measured − estimated| / estimated``)."""
    instances = (*cluster.instances, *cluster.retired)
    key_of = {i.name: (tuple(sorted(i.profiles)), i.gpus) for i in instances}
    ready = dict(loop.rolled_out)
    out = []
    for k, p in enumerate(loop.placements):
        start = ready.get(p.at_s, p.at_s)
        stop = (
            loop.placements[k + 1].at_s if k + 1 < len(loop.placements) else min(end, p.at_s + p.interval_s)
        )
        for g in p.groups:
            estimated = p.group_estimates.get(g.key)
            if len(g.services) < 2 or estimated is None:
                continue
            mine = [r for r in requests if start <= r.arrival < stop and key_of.get(r.instance) == g.key]
            if not mine:
                continue
            measured = float(np.mean([bool(slo_met(r)) for r in mine]))
            error = abs(measured - estimated) / estimated if estimated > 0 else math.inf
            out.append({
                "at_s": p.at_s, "group": describe([g]), "key": "+".join(g.services) + f" tp{g.tp}",
                "requests": len(mine), "estimated": estimated, "measured": measured, "error": error,
            })  # fmt: skip
    return out


def replayed_group_errors(
    loop: OperatorLoop, requests: Sequence[Request], cluster: Cluster, end: float
) -> list[dict]:
    """The estimator's model error on a plan kept for the whole run (the static loop's): in every window
    of the initial interval from its groups being ready, the simulated estimate of that window's own
    arrivals (and the requests outstanding at its start, as the operator passes them), group by group,
    against what the groups' instances met for those arrivals. Only the model is judged here, not the
    forecast of the load."""
    (placement,) = loop.placements
    shared = [g for g in placement.groups if len(g.services) > 1]
    if not shared:
        return []
    key_of = {i.name: (tuple(sorted(i.profiles)), i.gpus) for i in (*cluster.instances, *cluster.retired)}
    step = placement.interval_s
    start = loop.rolled_out[0][1] if loop.rolled_out else 0.0
    groups = groups_of_plan(PlacementPlan("seallm", placement.groups))
    out = []
    while start + step <= end + 1e-9:
        stop = start + step
        inputs = []
        for name, s in loop.services.items():
            mine = [r for r in requests if r.model == name]
            window = [HistoryRequest(r.arrival - start, r.prompt_tokens, r.target_output_tokens)
                      for r in mine if start <= r.arrival < stop]  # fmt: skip
            backlog = sum(1 for r in mine if r.arrival < start and (r.finished_at or math.inf) > start)
            inputs.append(replace(with_history(s, window, step), backlog=backlog))
        by_group = simulate_performance(loop.pool, inputs, groups).by_group
        for g in shared:
            mine = [r for r in requests if start <= r.arrival < stop and key_of.get(r.instance) == g.key]
            estimated = by_group.get(g.key)
            if not mine or estimated is None:
                continue
            measured = float(np.mean([bool(slo_met(r)) for r in mine]))
            out.append({
                "at_s": start, "group": describe([g]), "key": "+".join(g.services) + f" tp{g.tp}",
                "requests": len(mine), "estimated": estimated, "measured": measured,
                "error": abs(measured - estimated) / estimated if estimated > 0 else math.inf,
            })  # fmt: skip
        start = stop
    return out


def engine_shares(name: str, cluster: Cluster) -> list[str]:
    """Information lines: how co-resident instances shared their accelerator, per model (engine
    seconds of its steps and their share), by group."""
    seconds: dict[tuple[str, ...], dict[str, float]] = {}
    for inst in (*cluster.instances, *cluster.retired):
        if isinstance(inst, CoResidentInstance):
            mine = seconds.setdefault(tuple(sorted(inst.profiles)), {})
            for model, t in inst.engine_seconds.items():
                mine[model] = mine.get(model, 0.0) + t
    lines = []
    for group, by_model in sorted(seconds.items()):
        total = sum(by_model.values()) or 1.0
        shares = ", ".join(f"{m} {t:.0f} s ({t / total:.0%})" for m, t in sorted(by_model.items()))
        lines.append(f"({name}) co-resident {'+'.join(group)}: engine time {shares}")
    return lines


def describe(groups: Sequence[GroupPlan]) -> str:
    """Groups as "services xREPLICAS tpTP", comma-separated."""
    return ", ".join(f"{'+'.join(g.services)} x{g.replicas.total} tp{g.tp}" for g in groups)


def run(config: BenchConfig, progress: Progress) -> BenchReport:
    """Both systems on the same requests; rows per phase, checks and the loop's trajectory."""
    s = setup(config)
    progress(0, total=2)
    shift, end = s.shift_minute * 60.0, s.minutes * 60.0
    live, live_cluster, loop = run_loop(s, config.seed, measured=True)
    progress(1)
    fixed, fixed_cluster, static = run_loop(s, config.seed, measured=False)
    progress(1)
    before_plan = next((p for p in reversed(loop.placements) if p.at_s < shift), loop.placements[0])
    in_effect = before_plan.interval_s
    # The re-placement: the first placement after the shift that changes the groups.
    first = next((p for p in loop.placements if p.at_s >= shift and p.groups != before_plan.groups), None)
    ready_at = next((r for p, r in loop.rolled_out if first is not None and p == first.at_s), None)
    recovered = ready_at if ready_at is not None else min(end, shift + in_effect)
    # Before: from the first placement's instances being ready (cold starts are not the shift's doing).
    warm = loop.rolled_out[0][1] if loop.rolled_out else 0.0
    spans = {"before": (warm, shift), "during": (shift, recovered), "after": (recovered, end)}
    rows = []
    for name, reqs, cluster in (("operator-loop", live, live_cluster), ("static", fixed, fixed_cluster)):
        for phase in PHASES:
            rows.append(phase_row(f"{name}:{phase}", reqs, cluster.rejected, spans[phase]))
    by = {r["policy"]: r for r in rows}
    grows, shrinks = s.names[int(np.argmax(s.factors))], s.names[int(np.argmin(s.factors))]
    checks = []
    if first is None:
        checks.append(
            f"re-plan within one interval after the shift: no re-placement after t={shift:g} s: FAIL"
        )
    else:
        delay = first.at_s - shift
        grew = first.instances(grows) > before_plan.instances(grows)
        moved = grew and first.instances(shrinks) <= before_plan.instances(shrinks)
        checks.append(
            f"re-plan within one interval after the shift: at +{delay:.0f} s (interval in effect "
            f"{in_effect:.0f} s); instances {grows} {before_plan.instances(grows)} -> "
            f"{first.instances(grows)}, "
            f"{shrinks} {before_plan.instances(shrinks)} -> {first.instances(shrinks)}; new groups ready at "
            f"+{(recovered - shift):.0f} s: {'PASS' if delay <= in_effect + TICK_S and moved else 'FAIL'}"
        )
    before, after = by["operator-loop:before"]["slo_attainment"], by["operator-loop:after"]["slo_attainment"]
    checks.append(
        f"operator-loop SLO attainment after the shift {after:.3f} within {s.recovery:g} of before "
        f"{before:.3f} (--set recovery={s.recovery:g}): {'PASS' if after >= before - s.recovery else 'FAIL'}"
    )
    static_after = by["static:after"]["slo_attainment"]
    checks.append(
        f"operator-loop SLO attainment after the shift {after:.3f} vs static placement {static_after:.3f} "
        f"(target higher): {'PASS' if after > static_after else 'FAIL'}"
    )
    compared = [p for p in loop.placements if p.seallm_agrees is not None]
    agree = sum(bool(p.seallm_agrees) for p in compared)
    checks.append(
        f"live loop placement == tessera bench seallm's planner (seallm.replan) on the same load history: "
        f"{agree}/{len(compared)} placements agree: "
        f"{'PASS' if compared and agree == len(compared) else 'FAIL'}"
    )
    for p in loop.placements:
        error = "-" if p.estimate_error is None else f"{p.estimate_error:.3f}"
        real = "-" if p.measured_attainment is None else f"{p.measured_attainment:.3f}"
        est = "-" if p.estimated_attainment is None else f"{p.estimated_attainment:.3f}"
        groups = describe(p.groups)
        checks.append(
            f"(trajectory) t={p.at_s:.0f} s: measured attainment {real} vs estimate of the plan in effect, "
            f"error {error} -> interval {p.interval_s:.1f} s; placed {groups} (estimate {est})"
        )
    checks.append(f"(static) placed once at t=0: {describe(static.placements[0].groups)}")
    for name, cluster in (("operator-loop", live_cluster), ("static", fixed_cluster)):
        checks.extend(engine_shares(name, cluster))
    errors = {
        "operator-loop": shared_group_errors(loop, live, live_cluster, end),
        "static": shared_group_errors(static, fixed, fixed_cluster, end),
        "static, replayed": replayed_group_errors(static, fixed, fixed_cluster, end),
    }
    for name, found in errors.items():
        for e in found:
            checks.append(
                f"({name}, shared group) t={e['at_s']:.0f} s {e['group']}: estimated {e['estimated']:.3f}, "
                f"measured {e['measured']:.3f} over {e['requests']} requests, error {e['error']:.3f}"
            )
    for label, found in (
        ("at the placements' boundaries", errors["operator-loop"] + errors["static"]),
        ("of the kept plan, each interval's arrivals replayed", errors["static, replayed"]),
    ):
        per_group: dict[str, list[float]] = {}
        for e in found:
            per_group.setdefault(e["key"], []).append(e["error"])
        for key, values in sorted(per_group.items()):
            median = float(np.median(values))
            checks.append(
                f"median estimate error {label}, shared group {key}: {median:.3f} over {len(values)} "
                f"(target <= 0.15): {'PASS' if median <= 0.15 else 'FAIL'}"
            )
    if not any(errors.values()):
        checks.append("(shared groups) no placement co-located services")
    cfg = {
        **config.as_dict(),
        "rates": list(s.rates),
        "factors": list(s.factors),
        "minutes": s.minutes,
        "shift_minute": s.shift_minute,
        "gpus": s.gpus,
        "interval": s.interval,
        "recovery": s.recovery,
    }
    rows[0]["placements"] = [
        {
            "at_s": p.at_s,
            "interval_s": p.interval_s,
            "estimate_error": p.estimate_error,
            "measured_attainment": p.measured_attainment,
            "groups": describe(p.groups),
            "seallm_agrees": p.seallm_agrees,
        }
        for p in loop.placements
    ]
    rows[0]["shared_group_errors"] = errors["operator-loop"]
    rows[3]["shared_group_errors"] = errors["static"] + errors["static, replayed"]
    return BenchReport("load-shift", cfg, rows, checks)
