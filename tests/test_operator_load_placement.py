"""Placement from measured load and the adaptive re-placement interval, pure parts and the controller's
timeline over an in-memory cluster: the workers' counters sampled by Prometheus become each model's
load, the load becomes the planner's inputs (with declared or default figures where none is measured),
the plan's estimate is kept in status and compared at the next boundary with what was measured, and
Eq. 8 sets the next interval. Passes that change nothing write nothing."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tessera.api import parse_document
from tessera.api.llm_service import LLMServiceStatus
from tessera.api.serving_pool import ServingPoolStatus
from tessera.api.worker_config import parse_config
from tessera.control.inputs import (
    DEFAULT_SLO_SCALE,
    MAX_HISTORY_REQUESTS,
    interval_metrics,
    service_input,
    service_load,
    slo_scale,
    spread_history,
)
from tessera.control.metrics_queries import (
    ModelLoad,
    batch_size_query,
    batch_sizes_from_result,
    load_queries,
    load_step_s,
    loads_from_results,
)
from tessera.control.pool_plan import desired_pool, parse_classes
from tessera.core.planners import GroupPlan, IntervalMetrics, MetricsSnapshot, PlacementPlan, RoleCounts
from tessera.core.planners.replacement import IntervalSettings, next_replacement_interval, prediction_error
from tessera.operator import prometheus as prometheus_adapter
from tessera.operator import status as st
from tessera.operator.controller import Controller
from tessera.operator.prometheus import RESCRAPE_S, PrometheusMetrics
from tessera.operator.reconcile import Action
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

NS, POOL = "ns", "p"
MODELS = {"a": "org/a-8B", "b": "org/b-8B"}


def pool_body(**placement: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ServingPool",
        "metadata": {"name": POOL, "namespace": NS, "uid": "pool-uid", "generation": 1},
        "spec": {
            "gpu": {"type": "H100", "memory": "80Gi"},
            "instances": {"min": 1, "max": 4},
            "autoscaling": {"enabled": False},
            "placement": {
                "strategy": "seallm",
                "replacementInterval": {"initialSeconds": 100, "minSeconds": 50, "maxSeconds": 200},
                **placement,
            },
        },
    }


def class_body(name: str = "chat", **slo: float) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "RequestClass",
        "metadata": {"name": name, "namespace": NS, "uid": f"class-{name}"},
        "spec": {"kind": "interactive", "slo": slo or {"ttftSeconds": 1, "itlSeconds": 0.05}},
    }


def service_body(name: str, expected: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": MODELS[name]},
        "poolRef": {"name": POOL},
        "requestClasses": [{"name": "chat"}],
        "replicas": {"min": 1, "max": 4},
    }
    if expected is not None:
        spec["expectedLoad"] = expected
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NS, "uid": f"svc-{name}", "creationTimestamp": name},
        "spec": spec,
    }


def model_load(
    model: str,
    rate: float,
    *,
    out: float = 200,
    prompt: float = 128,
    window: float = 300,
    step: float = 60,
    met: float = 0.9,
) -> ModelLoad:
    n = round(window / step)
    per = rate * step
    total = per * n
    return ModelLoad(
        model,
        step,
        window,
        (per,) * n,
        (per,) * n,
        (per * out,) * n,
        (per * prompt,) * n,
        total * 3.0,
        total * met,
        total * (1 - met),
    )


# -- the queries and their parsing ----------------------------------------------------------------------


def test_load_queries_sample_every_counter_one_step_before_the_window() -> None:
    assert load_step_s(300) == 60 and load_step_s(20) == 4 and load_step_s(3) == 1 and load_step_s(7200) == 60
    queries = load_queries(NS, POOL, 300)
    assert queries["finished"] == 'tessera_e2e_seconds_count{namespace="ns",pool="p"}[360s:60s]'
    assert queries["up"] == 'tessera_batch_size{namespace="ns",pool="p"}[360s:60s]'
    assert set(queries) == {
        "finished", "rejected", "failed", "later_tokens", "e2e_seconds", "prompt_tokens", "slo_met",
        "slo_missed", "up", "queued", "running",
    }  # fmt: skip
    assert queries["queued"] == 'tessera_queue_length{namespace="ns",pool="p"}[360s:60s]'
    assert queries["running"] == 'tessera_inflight{namespace="ns",pool="p"}[360s:60s]'
    assert queries["prompt_tokens"] == 'tessera_prompt_tokens_total{namespace="ns",pool="p"}[360s:60s]'
    pinned = load_queries(NS, POOL, 300, at=1_700_000_000.25)
    assert pinned["up"] == 'tessera_batch_size{namespace="ns",pool="p"}[360s:60s] @ 1700000000.250'


def series(model: str, points: list[tuple[float, float]], **labels: str) -> dict[str, Any]:
    return {"metric": {"model": model, **labels}, "values": [[t, str(v)] for t, v in points]}


def test_loads_count_increases_per_step_across_resets_and_new_series() -> None:
    grid = [0.0, 10.0, 20.0, 30.0]
    a, b = MODELS["a"], MODELS["b"]
    results = {
        "up": [
            series(a, [(t, 8) for t in grid], pod="p-0"),
            series(b, [(30.0, 4)], pod="p-1"),  # seen once: not measured yet
        ],
        # pod 0's counter resets between 10 and 20 (a restart): 5 -> 2 counts 2.
        "finished": [
            series(a, [(0, 100), (10, 105), (20, 2), (30, 12)], pod="p-0", **{"class": "chat"}),
            # a class first used at 20: its first value counts from zero.
            series(a, [(20, 3), (30, 3)], pod="p-0", **{"class": "batch"}),
        ],
        "rejected": [series(a, [(0, 1), (10, 1), (20, 1), (30, 4)], pod="p-0")],
        "later_tokens": [series(a, [(0, 1000), (10, 1100), (20, 40), (30, 240)], pod="p-0")],
        "e2e_seconds": [series(a, [(0, 50), (10, 60), (20, 4), (30, 24)], pod="p-0")],
        "prompt_tokens": [series(a, [(0, 900), (10, 1400), (20, 300), (30, 1300)], pod="p-0")],
        "slo_met": [series(a, [(0, 90), (10, 94), (20, 2), (30, 10)], pod="p-0")],
        "slo_missed": [series(a, [(0, 10), (10, 11), (20, 0), (30, 2)], pod="p-0")],
    }
    loads = loads_from_results(results)
    assert set(loads) == {a}
    load = loads[a]
    assert load.step_s == 10 and load.span_s == 30
    assert load.finished == (5, 5, 10)
    assert load.arrivals == (5, 5, 13)  # finished + rejected
    assert load.output_tokens == (105, 45, 210)  # a first token per finished request + later tokens
    assert load.rate == pytest.approx(23 / 30)
    assert load.mean_output_tokens == pytest.approx(360 / 20)
    assert load.prompt_tokens == (500, 300, 1000) and load.mean_prompt_tokens == pytest.approx(1800 / 20)
    assert load.e2e_seconds == 10 + 4 + 20 and load.slo_met == 4 + 2 + 8 and load.slo_missed == 1 + 0 + 2
    assert loads_from_results({"up": [series(a, [(0, 1)])]}) == {}


def test_arrivals_are_demand_the_requests_that_ended_plus_those_still_held() -> None:
    """An overloaded model finishes fewer requests than arrive: its queue and in-flight gauges grow, and
    the growth counts as arrivals, so its rate is what was asked of it, not what it served."""
    grid = [0.0, 10.0, 20.0, 30.0]
    a, b = MODELS["a"], MODELS["b"]
    results = {
        "up": [series(a, [(t, 8) for t in grid], pod="p-0"), series(b, [(20.0, 4), (30.0, 4)], pod="p-1")],
        "finished": [
            series(a, [(0, 0), (10, 2), (20, 4), (30, 10)], pod="p-0"),
            series(b, [(20, 2), (30, 4)], pod="p-1"),
        ],
        # Held: 3, 9, 7, 0 (running absent at 0 and 30: no series there).
        "queued": [series(a, [(0, 3), (10, 8), (20, 6), (30, 0)], pod="p-0", **{"class": "chat"})],
        "running": [series(a, [(10, 1), (20, 1)], pod="p-0", **{"class": "chat"})],
    }
    loads = loads_from_results(results)
    load = loads[a]
    # Ended 2, 2, 6 plus held growth +6, -2, -7: 8, 0, -1; the last step's deficit comes off the latest
    # non-zero step, so the total is exact: 10 ended + (0 - 3) held = 7.
    assert load.arrivals == (7, 0, 0) and sum(load.arrivals) == 7
    assert load.finished == (2, 2, 6) and load.outstanding == 0
    # A model first seen at 20: the step ending there holds its first count, so its span is two steps.
    assert loads[b].span_s == 20 and loads[b].arrivals == (0, 2, 2) and loads[b].rate == pytest.approx(0.2)


def test_one_read_of_the_loads_evaluates_every_query_at_one_instant() -> None:
    """A Prometheus whose clock moves on while the queries of one read arrive (1.3 s each: a slow server
    or a loaded operator). Counters grow steadily from long before the window: 2 requests per second
    finish, with 1000 prompt tokens and one later token each. Evaluated at their arrival, the queries
    sample grids a step apart; pinned to one instant they measure the load exactly."""
    subquery = re.compile(r"^(\w+)\{[^}]*\}\[(\d+)s:(\d+)s\](?: @ ([\d.]+))?$")
    per_second = {
        "tessera_e2e_seconds_count": 2.0,
        "tessera_itl_seconds_count": 2.0,
        "tessera_e2e_seconds_sum": 1.0,
        "tessera_prompt_tokens_total": 2000.0,
        "tessera_slo_met_total": 2.0,
    }
    clock = [1_700_000_000.9]

    def prometheus(query: str) -> list[dict[str, Any]]:
        found = subquery.match(query)
        assert found, query
        name, span, step, at = found[1], int(found[2]), int(found[3]), found[4]
        end = float(at) if at else clock[0]
        clock[0] += 1.3
        if name not in (*per_second, "tessera_batch_size"):
            return []  # no request was rejected or failed: those counters were never created
        times = [k * step for k in range(math.floor((end - span) / step) + 1, math.floor(end / step) + 1)]
        value = per_second.get(name, 0.0)
        return [series(MODELS["a"], [(t, value * t if name in per_second else 8) for t in times])]

    loads = PrometheusMetrics("http://prometheus", query=prometheus).loads(NS, POOL, 10)
    assert loads is not None
    load = loads[MODELS["a"]]
    assert load.finished == (4, 4, 4, 4, 4)
    assert load.rate == pytest.approx(2.0)
    assert load.mean_prompt_tokens == pytest.approx(1000)
    assert load.mean_output_tokens == pytest.approx(2)


def test_batch_sizes_are_each_groups_mean_rounded() -> None:
    assert batch_size_query(NS, POOL) == 'avg by (group) (tessera_batch_size{namespace="ns",pool="p"})'
    result = [
        {"metric": {"group": "g1"}, "value": [0, "12.5"]},
        {"metric": {"group": "g2"}, "value": [0, "0.2"]},
        {"metric": {"group": "g3"}, "value": [0, "NaN"]},
    ]
    assert batch_sizes_from_result(result) == {"g1": 12, "g2": 1}


async def test_the_worker_counts_the_prompt_tokens_of_finished_requests() -> None:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 256, "defaultClass": "chat"}],
            "classes": {"chat": {"slo": {"ttftSeconds": 5}}},
        }
    )
    worker = Worker(config)
    await worker.start()
    try:
        transport = httpx.ASGITransport(app=create_app(worker, manage_worker=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            for prompt in ([5], [5, 6, 7, 8]):
                resp = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
            metrics = (await c.get("/metrics")).text
    finally:
        await worker.stop()
    assert 'tessera_prompt_tokens_total{class="chat",model="m"} 5.0' in metrics
    assert 'tessera_e2e_seconds_count{class="chat",model="m"} 2.0' in metrics


# -- loads into planner inputs ---------------------------------------------------------------------------


def parsed(body: dict[str, Any]) -> Any:
    return parse_document(body, where="test")


def test_a_service_without_metrics_is_planned_for_its_declared_load_else_the_defaults() -> None:
    declared = service_load(
        parsed(service_body("a", {"requestsPerSecond": 2, "promptTokens": 500})), None, 100
    )
    assert (declared.rate, declared.prompt_tokens, declared.output_tokens) == (2, 500, 256)
    assert (declared.rate_source, declared.prompt_source, declared.output_source) == (
        "declared",
        "declared",
        "default",
    )
    assert len(declared.history) == 200 and declared.window_s is None
    assert {h.prompt_tokens for h in declared.history} == {500}
    default = service_load(parsed(service_body("b")), None, 100)
    assert (default.rate, default.rate_source, default.history) == (0, "default", ())
    assert default.to_status()["sources"] == {
        "requestsPerSecond": "default",
        "promptTokens": "default",
        "outputTokens": "default",
    }


def test_a_measured_load_replaces_the_declared_rate_and_lengths() -> None:
    service = parsed(service_body("a", {"requestsPerSecond": 50, "promptTokens": 500, "outputTokens": 9}))
    load = service_load(service, model_load(MODELS["a"], 2.0, out=40, prompt=700), 300)
    assert (load.rate, load.output_tokens, load.prompt_tokens) == (2.0, 40, 700)
    assert (load.rate_source, load.prompt_source, load.output_source) == ("measured", "measured", "measured")
    assert len(load.history) == 600 and load.window_s == 300
    assert {h.output_tokens for h in load.history} == {40} and load.history[-1].arrival < 300
    assert {h.prompt_tokens for h in load.history} == {700}
    status = load.to_status()
    assert status["requestsPerSecond"] == 2.0 and status["windowSeconds"] == 300
    assert status["meanPromptTokens"] == 700 and status["sources"]["promptTokens"] == "measured"


def test_what_the_workers_hold_reaches_the_status_and_the_planner_as_a_backlog() -> None:
    service = parsed(service_body("a"))
    held = replace(model_load(MODELS["a"], 2.0), outstanding=37.0)
    load = service_load(service, held, 300)
    assert load.outstanding == 37 and load.to_status()["outstandingRequests"] == 37
    planned = service_input(parsed(pool_body()), service, load)
    assert planned.backlog == 37
    assert service_load(service, None, 300).to_status().get("outstandingRequests") is None


def test_a_measured_load_without_prompt_tokens_keeps_the_declared_prompt() -> None:
    # Workers of an image older than the tessera_prompt_tokens counter count none.
    service = parsed(service_body("a", {"promptTokens": 500}))
    load = service_load(service, model_load(MODELS["a"], 2.0, prompt=0), 300)
    assert (load.prompt_tokens, load.prompt_source, load.rate_source) == (500, "declared", "measured")
    assert {h.prompt_tokens for h in load.history} == {500}


def test_spread_history_carries_fractions_and_keeps_the_most_recent_requests() -> None:
    history = spread_history([0.5, 0.5, 2], 10.0, [7, 8, 9], [1, 2, 3])
    assert [(h.arrival, h.prompt_tokens, h.output_tokens) for h in history] == [
        (15.0, 8, 2),
        (22.5, 9, 3),
        (27.5, 9, 3),
    ]
    long = spread_history([MAX_HISTORY_REQUESTS, 10], 1.0, [7, 7], [1, 2])
    assert len(long) == MAX_HISTORY_REQUESTS and long[-1].output_tokens == 2


def test_slo_scale_is_the_strictest_class_budget_over_the_isolated_execution() -> None:
    pool = parsed(pool_body())
    service = parsed(service_body("a"))
    profile = service_input(pool, service).profile
    classes, _ = parse_classes([class_body(ttftSeconds=1, itlSeconds=0.05)])
    exec_s = profile.exec_time(128, 100)
    assert slo_scale(service, classes, profile, 128, 100) == pytest.approx((1 + 0.05 * 99) / exec_s)
    ttft_only, _ = parse_classes([class_body(ttftSeconds=2)])
    rest = exec_s - profile.prefill(128)
    assert slo_scale(service, ttft_only, profile, 128, 100) == pytest.approx((2 + rest) / exec_s)
    none, _ = parse_classes([class_body(ttftSeconds=1)])
    none["chat"] = none["chat"].model_copy(
        update={"slo": none["chat"].slo.model_copy(update={"ttft_seconds": None})}
    )
    assert slo_scale(service, none, profile, 128, 100) == DEFAULT_SLO_SCALE


def test_interval_metrics_weigh_services_by_finished_requests() -> None:
    pool = parsed(pool_body())
    inputs = {n: service_input(pool, parsed(service_body(n))) for n in ("a", "b")}
    a = model_load(MODELS["a"], 1.0, met=1.0)
    b = model_load(MODELS["b"], 3.0, met=0.5)
    real = interval_metrics(inputs, {"a": a, "b": b})
    assert real is not None
    assert real.slo_attainment == pytest.approx((300 + 450) / 1200)
    expected = (a.e2e_seconds / inputs["a"].mean_exec_s() + b.e2e_seconds / inputs["b"].mean_exec_s()) / 1200
    assert real.norm_latency == pytest.approx(expected)
    assert interval_metrics(inputs, {"a": model_load(MODELS["a"], 0.0)}) is None


def test_measured_rates_move_the_placement() -> None:
    pool, classes = pool_body(), [class_body()]
    services = [service_body("a"), service_body("b")]

    def replicas(rate_a: float, rate_b: float) -> dict[str, int]:
        measured = {
            MODELS["a"]: model_load(MODELS["a"], rate_a),
            MODELS["b"]: model_load(MODELS["b"], rate_b),
        }
        decided = desired_pool(pool, services, classes, None, 0.0, measured=measured, window_s=300)
        assert decided.inputs["a"].request_rate == rate_a and decided.loads["b"].rate_source == "measured"
        return {g.services[0]: g.replicas.total for g in decided.plan.groups}

    assert replicas(8, 0.5) == {"a": 3, "b": 1}
    assert replicas(0.5, 8) == {"a": 1, "b": 3}


# -- status ------------------------------------------------------------------------------------------------


def test_plan_status_keeps_the_estimate_and_shows_measured_batch_sizes_it_does_not_read_back() -> None:
    plan = PlacementPlan(
        "seallm",
        (GroupPlan("g1", ("a",), 1, RoleCounts(interactive=2)),),
        estimated_slo_attainment=0.9,
        estimated_norm_latency=1.7,
    )
    status = st.plan_to_status(plan, {"g1": 1}, {"g1": 48})
    assert status["groups"][0]["batchSize"] == 48
    assert status["estimatedNormLatency"] == 1.7
    back = st.plan_from_status(status)
    assert back == plan  # the batch size is a measurement, not part of the plan (pods do not change)


# -- the controller's timeline -------------------------------------------------------------------------------


def merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for k, v in patch.items():
        if isinstance(v, Mapping) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


class FakeKube:
    """Tessera objects and children in memory; counts status patches and child writes."""

    def __init__(self, bodies: list[dict[str, Any]]) -> None:
        plural = {
            "ServingPool": "servingpools",
            "LLMService": "llmservices",
            "RequestClass": "requestclasses",
        }
        self.objects = {(plural[b["kind"]], b["metadata"]["name"]): copy.deepcopy(b) for b in bodies}
        self.children: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[tuple[str, str]] = []
        self.child_writes: list[str] = []

    def get_custom(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        body = self.objects.get((plural, name))
        return copy.deepcopy(body) if body else None

    def patch_status(self, plural: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.status_patches.append((plural, name))
        merge(self.objects[(plural, name)].setdefault("status", {}), status)

    def list_children(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [copy.deepcopy(c) for c in self.children.values()]

    def apply(self, namespace: str, action: Action) -> None:
        self.child_writes.append(action.describe())
        if action.verb == "delete":
            del self.children[(action.kind, action.name)]
        else:
            assert action.body is not None
            self.children[(action.kind, action.name)] = copy.deepcopy(dict(action.body))

    def bodies(self, plural: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(b) for (p, _), b in self.objects.items() if p == plural]


class FakeMetrics:
    """Loads set by the test; every query recorded."""

    def __init__(self) -> None:
        self.rates: dict[str, float] = {}
        self.met = 1.0
        self.windows: list[float] = []
        self.batch: dict[str, int] = {}
        self.down = False

    def snapshot(self, *args: Any) -> None:
        return None

    def attainment(self, namespace: str, pool: str, model: str) -> None:
        return None

    def loads(self, namespace: str, pool: str, window_s: float) -> dict[str, ModelLoad] | None:
        self.windows.append(window_s)
        if self.down:
            return None
        return {
            m: model_load(m, r, window=window_s, step=load_step_s(window_s), met=self.met)
            for m, r in self.rates.items()
        }

    def batch_sizes(self, namespace: str, pool: str) -> dict[str, int]:
        return dict(self.batch)

    def idle(self, namespace: str, pool: str, group: str, window_s: float) -> None:
        return None


def run_pass(controller: Controller, kube: FakeKube, now: float) -> None:
    # As the pool's daemon runs a timed pass (its pool has autoscaling off: nothing to evaluate).
    controller.reconcile_pool(
        NS, POOL, kube.bodies("llmservices"), kube.bodies("requestclasses"), now, autoscale=True
    )


def test_the_interval_adapts_at_each_boundary_from_the_kept_estimate_and_quiet_passes_write_nothing() -> None:
    kube = FakeKube(
        [pool_body(), class_body(), service_body("a", {"requestsPerSecond": 1}), service_body("b")]
    )
    metrics = FakeMetrics()
    controller = Controller(kube, lambda *event: None, metrics)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    pool = kube.objects[("servingpools", POOL)]["status"]
    assert pool["replacementIntervalSeconds"] == 100  # I_0
    assert pool["nextPlacementTime"] == st.rfc3339(t0 + 100)
    load_a = kube.objects[("llmservices", "a")]["status"]["load"]
    assert load_a["requestsPerSecond"] == 1 and load_a["sources"]["requestsPerSecond"] == "declared"
    assert kube.objects[("llmservices", "b")]["status"]["load"]["sources"]["requestsPerSecond"] == "default"
    estimate = IntervalMetrics(
        pool["placement"]["estimatedSloAttainment"], pool["placement"]["estimatedNormLatency"]
    )

    # Quiet passes before the boundary, and a pass of a fresh operator (restart): nothing written.
    patches, writes = len(kube.status_patches), len(kube.child_writes)
    metrics.batch = {}
    run_pass(controller, kube, t0 + 10)
    run_pass(Controller(kube, lambda *event: None, metrics), kube, t0 + 20)
    assert (len(kube.status_patches), len(kube.child_writes)) == (patches, writes)

    # The boundary: traffic measured, Eq. 8 from the kept estimate, the new plan on the measured rates.
    metrics.rates = {MODELS["a"]: 6.0, MODELS["b"]: 0.5}
    metrics.met = 0.5
    run_pass(controller, kube, t0 + 101)
    pool = kube.objects[("servingpools", POOL)]["status"]
    assert metrics.windows[-1] == 100
    real = IntervalMetrics(pool["measured"]["sloAttainment"], pool["measured"]["normLatency"])
    assert real.slo_attainment == pytest.approx(0.5)
    settings = IntervalSettings(100, 50, 200, 0.1)
    assert pool["estimateError"] == pytest.approx(prediction_error(estimate, real))
    assert pool["replacementIntervalSeconds"] == pytest.approx(
        next_replacement_interval(100, estimate, real, settings)
    )
    assert pool["replacementIntervalSeconds"] == pytest.approx(90)  # the estimate missed by more than beta
    assert pool["lastPlacementTime"] == st.rfc3339(t0 + 101)
    assert pool["nextPlacementTime"] == st.rfc3339(t0 + 101 + 90)
    assert pool["measured"]["requests"] == round(6.5 * 100) and pool["measured"]["windowSeconds"] == 100
    # What the operator writes is what the CRD's status schema holds.
    ServingPoolStatus.model_validate(pool)
    LLMServiceStatus.model_validate(kube.objects[("llmservices", "a")]["status"])
    load_a = kube.objects[("llmservices", "a")]["status"]["load"]
    assert load_a["requestsPerSecond"] == 6.0 and load_a["sources"]["requestsPerSecond"] == "measured"
    assert {g["services"][0]: g["replicas"]["interactive"] for g in pool["placement"]["groups"]} == {
        "a": 3,
        "b": 1,
    }

    # Before the next boundary nothing is written, although the load keeps changing.
    patches, writes = len(kube.status_patches), len(kube.child_writes)
    metrics.rates = {MODELS["a"]: 0.5, MODELS["b"]: 6.0}
    run_pass(controller, kube, t0 + 150)
    assert (len(kube.status_patches), len(kube.child_writes)) == (patches, writes)
    # The next one uses the new interval as its window, and the estimate the last boundary stored.
    stored = copy.deepcopy(kube.objects[("servingpools", POOL)]["status"]["placement"])
    run_pass(controller, kube, t0 + 192)
    pool = kube.objects[("servingpools", POOL)]["status"]
    assert metrics.windows[-1] == pytest.approx(90)
    real = IntervalMetrics(pool["measured"]["sloAttainment"], pool["measured"]["normLatency"])
    kept = IntervalMetrics(stored["estimatedSloAttainment"], stored["estimatedNormLatency"])
    assert pool["estimateError"] == pytest.approx(prediction_error(kept, real))
    assert {g["services"][0]: g["replicas"]["interactive"] for g in pool["placement"]["groups"]} == {
        "a": 1,
        "b": 3,
    }


def test_a_load_shift_brings_the_boundary_forward_once_the_plan_is_min_seconds_old() -> None:
    events: list[tuple[str, str]] = []
    kube = FakeKube(
        [
            pool_body(),
            class_body(),
            service_body("a", {"requestsPerSecond": 2}),
            service_body("b", {"requestsPerSecond": 2}),
        ]
    )
    metrics = FakeMetrics()
    controller = Controller(kube, lambda body, kind, reason, msg: events.append((reason, msg)), metrics)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    first = kube.objects[("servingpools", POOL)]["status"]
    assert first["nextPlacementTime"] == st.rfc3339(t0 + 100)
    # Within noise and within the threshold: no query moves anything, nothing is written.
    metrics.rates = {MODELS["a"]: 2.2, MODELS["b"]: 1.9}
    patches = len(kube.status_patches)
    for t in (20, 45, 60, 75, 90):
        if controller.due(NS, POOL, t0 + t):
            run_pass(controller, kube, t0 + t)
    assert len(kube.status_patches) == patches
    assert metrics.windows and set(metrics.windows[1:]) == {50}  # the watch reads minSeconds
    # A shift before the plan is minSeconds old waits; once it is, the next watch re-places.
    run_pass(Controller(kube, lambda *e: None, metrics), kube, t0 + 100)  # a boundary: last placement now
    metrics.rates = {MODELS["a"]: 8.0, MODELS["b"]: 0.5}
    calls = len(metrics.windows)
    for t in range(101, 150, 5):
        if controller.due(NS, POOL, t0 + t):
            run_pass(controller, kube, t0 + t)
    assert kube.objects[("servingpools", POOL)]["status"]["lastPlacementTime"] == st.rfc3339(t0 + 100)
    assert len(metrics.windows) == calls  # no watch query while the plan is younger than minSeconds
    moved_at = next(t for t in range(150, 200) if controller.due(NS, POOL, t0 + t))
    run_pass(controller, kube, t0 + moved_at)
    pool = kube.objects[("servingpools", POOL)]["status"]
    assert moved_at < 100 + 100  # before the interval's own boundary
    assert pool["lastPlacementTime"] == st.rfc3339(t0 + moved_at)
    # Planned as at a boundary, on the interval in effect (90 s from the boundary at +100), not on the
    # watch's 50 s; the loads are that window's (the fake's rates hold for every window).
    assert pool["measured"]["windowSeconds"] == 90 and metrics.windows[calls:][-2:] == [50, 90]
    load_a = kube.objects[("llmservices", "a")]["status"]["load"]
    assert load_a["requestsPerSecond"] == 8.0 and load_a["sources"]["requestsPerSecond"] == "measured"
    assert kube.objects[("llmservices", "b")]["status"]["load"]["requestsPerSecond"] == 0.5
    shift = [m for r, m in events if r == "LoadShift"]
    assert len(shift) == 1 and "org/a-8B 2.2 -> 8 req/s" in shift[0] and "org/b-8B 1.9 -> 0.5" in shift[0]


def test_a_zero_threshold_turns_the_load_shift_watch_off() -> None:
    kube = FakeKube(
        [
            pool_body(replacementInterval={"initialSeconds": 100, "minSeconds": 50, "loadShiftThreshold": 0}),
            class_body(),
            service_body("a", {"requestsPerSecond": 2}),
            service_body("b", {"requestsPerSecond": 2}),
        ]
    )
    metrics = FakeMetrics()
    controller = Controller(kube, lambda *event: None, metrics)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    metrics.rates = {MODELS["a"]: 8.0, MODELS["b"]: 0.5}
    assert not any(controller.due(NS, POOL, t0 + t) for t in range(1, 60))
    run_pass(controller, kube, t0 + 80)
    assert kube.objects[("servingpools", POOL)]["status"]["lastPlacementTime"] == st.rfc3339(t0)


def test_a_boundary_without_traffic_keeps_the_interval_and_batch_sizes_reach_the_groups() -> None:
    kube = FakeKube([pool_body(), class_body(), service_body("a"), service_body("b")])
    metrics = FakeMetrics()
    controller = Controller(kube, lambda *event: None, metrics)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    groups = kube.objects[("servingpools", POOL)]["status"]["placement"]["groups"]
    metrics.batch = {g["name"]: 32 + i for i, g in enumerate(groups)}
    patches, writes = len(kube.status_patches), len(kube.child_writes)
    run_pass(controller, kube, t0 + 5)
    status = kube.objects[("servingpools", POOL)]["status"]
    assert [g["batchSize"] for g in status["placement"]["groups"]] == [32, 33]
    assert len(kube.status_patches) == patches + 1 and len(kube.child_writes) == writes  # pods unchanged
    metrics.rates = {MODELS["a"]: 0.0, MODELS["b"]: 0.0}
    run_pass(controller, kube, t0 + 101)  # measured, but nothing finished: Eq. 8 has nothing to compare
    status = kube.objects[("servingpools", POOL)]["status"]
    assert status["replacementIntervalSeconds"] == 100 and "estimateError" not in status
    assert status["lastPlacementTime"] == st.rfc3339(t0 + 101)
    assert kube.objects[("llmservices", "a")]["status"]["load"]["sources"]["requestsPerSecond"] == "measured"


def test_an_unreachable_prometheus_defers_the_boundary_instead_of_placing_on_defaults() -> None:
    kube = FakeKube([pool_body(), class_body(), service_body("a"), service_body("b")])
    metrics = FakeMetrics()
    metrics.rates = {MODELS["a"]: 8.0, MODELS["b"]: 0.5}
    events: list[tuple[Any, ...]] = []
    controller = Controller(kube, lambda *event: events.append(event), metrics)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    before = copy.deepcopy(kube.objects[("servingpools", POOL)]["status"])
    events.clear()
    metrics.down = True
    assert controller.due(NS, POOL, t0 + 101)
    run_pass(controller, kube, t0 + 101)
    status = copy.deepcopy(kube.objects[("servingpools", POOL)]["status"])
    # Nothing placed or rescheduled; only the Placed condition's message says why the boundary waits.
    placed = next(c for c in status.pop("conditions") if c["type"] == "Placed")
    was = next(c for c in before.pop("conditions") if c["type"] == "Placed")
    assert status == before
    assert placed["status"] == "True" and placed["reason"] == was["reason"]
    assert placed["message"] == (
        f"{was['message']}; the re-placement boundary due at {st.rfc3339(t0 + 100)} waits for measurements: "
        "Prometheus did not answer, or not yet for a whole window since it failed (the plan in effect "
        "stays; each pass asks again)"
    )
    assert [e[1:3] for e in events] == [("Warning", "ReplacementDeferred")]
    assert controller.due(NS, POOL, t0 + 102)  # still due: the next tick tries again
    patches = len(kube.status_patches)
    run_pass(controller, kube, t0 + 102)  # still down: the same message, nothing written, no new event
    assert len(kube.status_patches) == patches and len(events) == 1
    metrics.down = False
    run_pass(controller, kube, t0 + 103)
    status = kube.objects[("servingpools", POOL)]["status"]
    assert status["lastPlacementTime"] == st.rfc3339(t0 + 103) and "estimateError" in status
    assert next(c for c in status["conditions"] if c["type"] == "Placed")["message"] == was["message"]
    assert not controller.due(NS, POOL, t0 + 104)


class MeasuredMetrics(FakeMetrics):
    """FakeMetrics whose groups are measured (every planned instance ready and idle) unless ``down``."""

    def snapshot(self, namespace: str, pool: str, group: GroupPlan, *args: Any) -> MetricsSnapshot | None:
        return None if self.down else MetricsSnapshot(ready=group.replicas)


def test_the_scaled_condition_says_when_the_autoscaler_has_no_measurements() -> None:
    body = pool_body()
    body["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 10}
    kube = FakeKube([body, class_body(), service_body("a", {"requestsPerSecond": 1})])
    metrics = MeasuredMetrics()
    controller = Controller(kube, lambda *event: None, metrics)
    t0 = 1_700_000_000.0

    def scaled() -> dict[str, Any]:
        status = kube.objects[("servingpools", POOL)]["status"]
        return next(c for c in status["conditions"] if c["type"] == "Scaled")

    run_pass(controller, kube, t0)
    assert (scaled()["status"], scaled()["reason"]) == ("True", "Autoscaled")
    replicas = {n: c["spec"]["replicas"] for (k, n), c in kube.children.items() if k == "StatefulSet"}
    # Prometheus gone at the next evaluation: the counts stay, and the condition no longer claims the
    # autoscaler sets them from Prometheus.
    metrics.down = True
    run_pass(controller, kube, t0 + 11)
    (group,) = kube.objects[("servingpools", POOL)]["status"]["placement"]["groups"]
    assert (scaled()["status"], scaled()["reason"]) == ("False", "NoMeasurements")
    assert scaled()["message"] == (
        f"the autoscaler has no measurements of group(s) {group['name']}: Prometheus did not answer, or has "
        "not scraped their pods yet; their instance counts stay as they are until it measures again"
    )
    assert {n: c["spec"]["replicas"] for (k, n), c in kube.children.items() if k == "StatefulSet"} == replicas
    metrics.down = False
    run_pass(controller, kube, t0 + 12)  # still due (nothing was measured): evaluates again
    assert (scaled()["status"], scaled()["reason"]) == ("True", "Autoscaled")


def test_a_restarted_operator_replans_only_when_the_specs_changed_meanwhile() -> None:
    kube = FakeKube([pool_body(), class_body(), service_body("a"), service_body("b")])
    metrics = FakeMetrics()
    t0 = 1_700_000_000.0
    run_pass(Controller(kube, lambda *event: None, metrics), kube, t0)
    assert kube.objects[("servingpools", POOL)]["status"]["inputsDigest"]
    windows = len(metrics.windows)
    run_pass(Controller(kube, lambda *event: None, metrics), kube, t0 + 5)
    assert len(metrics.windows) == windows  # no re-plan: not even the load was read
    placement = copy.deepcopy(kube.objects[("servingpools", POOL)]["status"]["placement"])
    kube.objects[("llmservices", "b")]["spec"]["expectedLoad"] = {"outputTokens": 300}
    run_pass(Controller(kube, lambda *event: None, metrics), kube, t0 + 10)
    load = kube.objects[("llmservices", "b")]["status"]["load"]
    assert load["meanOutputTokens"] == 300 and load["sources"]["outputTokens"] == "declared"
    # The same groups: the plan in effect and its estimate stay.
    assert kube.objects[("servingpools", POOL)]["status"]["placement"] == placement


def test_without_prometheus_no_boundary_replans() -> None:
    kube = FakeKube([pool_body(), class_body(), service_body("a"), service_body("b")])
    controller = Controller(kube, lambda *event: None, None)
    t0 = 1_700_000_000.0
    run_pass(controller, kube, t0)
    patches = len(kube.status_patches)
    run_pass(controller, kube, t0 + 500)
    assert len(kube.status_patches) == patches
    assert math.isclose(kube.objects[("servingpools", POOL)]["status"]["replacementIntervalSeconds"], 100)


def test_prometheus_adapter_sends_the_queries_and_gives_up_at_once_after_a_failure() -> None:
    sent: list[str] = []

    def answer(query: str) -> list[dict[str, Any]]:
        sent.append(query)
        return [{"metric": {"group": "g1"}, "value": [0, "7"]}]

    assert PrometheusMetrics("http://prometheus", query=answer).batch_sizes(NS, POOL) == {"g1": 7}
    assert sent == [batch_size_query(NS, POOL)]

    def down(query: str) -> list[dict[str, Any]]:
        sent.append(query)
        raise ConnectionError("refused")

    sent.clear()
    metrics = PrometheusMetrics("http://prometheus", query=down)
    assert metrics.loads(NS, POOL, 60) is None and metrics.batch_sizes(NS, POOL) is None
    assert len(sent) == 1  # the second query gave up without waiting for another failure


def test_after_a_failed_query_the_loads_wait_for_a_whole_window_that_prometheus_saw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prometheus has no samples for the time it was down and fills the gap with the last one before it:
    # a window over the gap would read as no traffic.
    clock = {"now": 1_700_000_000.0}
    monkeypatch.setattr(
        prometheus_adapter, "time", SimpleNamespace(time=lambda: clock["now"], monotonic=lambda: clock["now"])
    )
    up, sent = [True], []

    def answer(query: str) -> list[dict[str, Any]]:
        sent.append(query)
        if not up[0]:
            raise ConnectionError("refused")
        return []

    metrics = PrometheusMetrics("http://prometheus", query=answer)
    assert metrics.loads(NS, POOL, 60) == {}  # answered (no model served yet)
    up[0] = False
    assert metrics.loads(NS, POOL, 60) is None
    clock["now"] += 3
    up[0] = True
    asked = len(sent)
    assert metrics.loads(NS, POOL, 60) is None and len(sent) == asked  # not asked while failing
    assert metrics.batch_sizes(NS, POOL) == {}  # another query finds Prometheus back: it answers
    # A whole window since then, with its baseline step and time for the first scrapes.
    clock["now"] += 60 + load_step_s(60) + max(load_step_s(60), RESCRAPE_S) - 1
    assert metrics.loads(NS, POOL, 60) is None
    clock["now"] += 1
    assert metrics.loads(NS, POOL, 60) == {}
    assert metrics.loads(NS, POOL, 120) is None  # a longer window still reaches back into the gap
