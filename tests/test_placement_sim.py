"""A placement plan on the simulator (tessera.control.placement_sim): shared-KV groups, the dispatcher,
rejection, censoring, round-robin turns; the analytic estimator; bench seallm's small runs."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.control.placement_sim import (
    add_group,
    group_profiles,
    kv_capacity_bytes,
    new_cluster,
    serve,
    stats_of,
    to_requests,
)
from tessera.core.baselines import FCFS
from tessera.core.planners import (
    GroupPlan,
    HistoryRequest,
    PlacementPlan,
    PoolInput,
    RoleCounts,
    ServiceInput,
)
from tessera.core.policies.seallm import DoublingBudget, RoundRobinSharing
from tessera.core.profile import StepProfile

GIB = 2**30
LM = StepProfile("lm", 0.01, 1e-4, 1e-7, 0.005, 1e-4, 65536)
# SeaLLM's temporal sharing (one KV pool, DB switches keep KV): most tests here are about it
POOL = PoolInput("p", "A800", 80 * GIB, 8, temporal_sharing=True)


def svc(name: str, weights: int = 14 * GIB, kv: int = 512 * 1024) -> ServiceInput:
    return ServiceInput(name, weights, kv, LM, mean_prompt_tokens=100, mean_output_tokens=50)


A, B = svc("a"), svc("b")
STATS = {s.name: stats_of(s, []) for s in (A, B)}


def group(services: tuple[str, ...], n: int, tp: int = 1) -> GroupPlan:
    return GroupPlan("-".join(services) + f"-{tp}", services, tp, RoleCounts(interactive=n))


def test_isolated_request_takes_exactly_its_execution_time():
    plan = PlacementPlan("x", (group(("a",), 1),))
    (out,), _ = serve(POOL, [A], plan, [("a", HistoryRequest(2.0, 300, 97))], stats=STATS)
    assert out.latency == pytest.approx(LM.exec_time(300, 97), rel=1e-9)
    assert out.finished and out.slo_met


def test_shared_group_profiles_pool_kv_in_bytes_and_pay_the_sharing_overhead():
    big = svc("big", weights=26 * GIB, kv=800 * 1024)
    profiles = group_profiles(POOL, [A, big], 2)
    capacity = kv_capacity_bytes(POOL, [A, big], 2)
    # a block holds the same bytes for both models: 16 tokens of the larger KV per token
    block_bytes = {
        n: p.block_size * s.kv_bytes_per_token / 2
        for (n, p), s in zip(profiles.items(), (A, big), strict=True)
    }
    assert block_bytes["big"] == 16 * 800 * 1024 / 2
    assert block_bytes["a"] == pytest.approx(block_bytes["big"], rel=0.02)
    blocks = {n: p.kv_capacity_tokens // p.block_size for n, p in profiles.items()}
    assert blocks["a"] == blocks["big"] == int(capacity // block_bytes["big"])
    alone = group_profiles(POOL, [A], 2)["a"]
    assert profiles["a"].decode_c0 == pytest.approx(alone.decode_c0 * 1.04)
    assert alone.prefill(1000) == pytest.approx(LM.at_tp(2).prefill(1000))


def test_model_switches_keep_kv_and_db_serves_the_short_service_first():
    """A long request of b, then short ones of a on the shared group: DB switches to a and back
    without dropping b's KV (no preemption), and the short requests finish first."""
    reqs = [("b", HistoryRequest(0.0, 100, 2000))] + [
        ("a", HistoryRequest(0.5 + i, 100, 20)) for i in range(3)
    ]
    stats = {"a": stats_of(A, [(100, 20)]), "b": stats_of(B, [(100, 2000)])}
    out, cluster = serve(POOL, [A, B], PlacementPlan("x", (group(("a", "b"), 1),)), reqs, stats=stats)
    (inst,) = cluster.instances
    assert inst.preemptions == 0
    long_b = next(o for o in out if o.service == "b")
    assert all(o.finished and o.latency < 1.0 for o in out if o.service == "a")
    assert long_b.finished and long_b.latency > LM.exec_time(100, 2000)


def test_dispatcher_picks_fewest_outstanding_then_the_first_instance():
    cluster = new_cluster(POOL, [A], lambda: DoublingBudget(dict(STATS)))
    first, second = add_group(cluster, POOL, [A], 1), add_group(cluster, POOL, [A], 1)
    reqs = to_requests([("a", HistoryRequest(0.0, 100, 50)), ("a", HistoryRequest(0.0, 100, 50))])
    cluster.run(reqs)
    assert [r.instance for r in reqs] == [first.name, second.name]


def test_a_request_no_pool_can_hold_is_rejected_and_the_dispatcher_avoids_small_pools():
    plan = PlacementPlan("x", (group(("a", "b"), 1), group(("a",), 1)))
    tokens = 100_000  # more than the shared TP-1 pool holds (two models' weights), less than a lone one
    assert kv_capacity_bytes(POOL, [A], 1) > tokens * 512 * 1024 > kv_capacity_bytes(POOL, [A, B], 1)
    reqs = [
        ("a", HistoryRequest(0.0, tokens, 5)),  # both idle: the shared group would win the tie
        ("b", HistoryRequest(0.0, tokens, 5)),  # only the shared pool hosts b: rejected
        ("b", HistoryRequest(0.0, 100, 5)),
    ]
    out, cluster = serve(POOL, [A, B], plan, reqs, stats=STATS, horizon=100.0)
    assert len(cluster.rejected) == 1 and cluster.rejected[0].model == "b"
    big_a, big_b, small_b = sorted(out, key=lambda o: (o.service, -o.latency))
    assert big_a.finished and small_b.finished
    ref = B.profile.exec_time(tokens, 5)
    assert not big_b.finished and not big_b.slo_met and big_b.latency == pytest.approx(100.0 + ref)


def test_outcomes_are_censored_at_the_horizon():
    plan = PlacementPlan("x", (group(("a",), 1),))
    (out,), _ = serve(POOL, [A], plan, [("a", HistoryRequest(0.0, 10, 10_000))], stats=STATS, horizon=5.0)
    assert not out.finished and not out.slo_met and out.latency > 5.0


def test_round_robin_turns_do_not_evict_each_other_without_end():
    """Two prompts that fit the shared pool only one at a time: each finishes, no ping-pong."""
    tokens = 60_000
    capacity = kv_capacity_bytes(POOL, [A, B], 1)
    assert tokens * 512 * 1024 < capacity < 2 * tokens * 512 * 1024
    reqs = [("a", HistoryRequest(0.0, tokens, 20)), ("b", HistoryRequest(0.0, tokens, 20))]
    plan = PlacementPlan("x", (group(("a", "b"), 1),))
    out, cluster = serve(POOL, [A, B], plan, reqs, stats=STATS, policy=RoundRobinSharing)
    assert all(o.finished for o in out)
    assert sum(i.preemptions for i in cluster.instances) <= 1


def test_db_keeps_running_requests_whose_budget_runs_out_for_fresh_ones_that_do_not_fit():
    """A burst of long prompts on one instance: each prompt's prefill outlasts its DB budget (shared
    token budget), so fresh requests overtake the running ones in O order. Dropping a running request
    from the batch preempts it and recomputes its prompt: DB served the burst in about 3x arrival
    order's makespan with hundreds of preemptions. Fresh requests now join only into free KV."""
    prompts = [min(60_000, int(p)) for p in np.random.default_rng(0).lognormal(np.log(18_000), 0.6, 300)]
    stats = {"a": stats_of(A, [(p, 5) for p in prompts])}
    reqs = [("a", HistoryRequest(0.0, p, 5)) for p in prompts]
    plan = PlacementPlan("x", (group(("a",), 1),))
    db_out, db = serve(POOL, [A], plan, reqs, stats=stats)
    fcfs_out, _ = serve(POOL, [A], plan, reqs, stats=stats, policy=FCFS)
    assert all(o.finished for o in db_out)
    assert sum(i.preemptions for i in db.instances) == 0
    assert max(o.latency for o in db_out) <= 1.05 * max(o.latency for o in fcfs_out)


def test_db_serves_a_burst_of_more_short_requests_than_one_batch():
    """1000 requests of 100 + 50 tokens at once on one instance: a chunked prefill iteration of 81
    prompts outlasts each one's budget, so every decision ranked the fresh requests ahead of the ones
    just prefilled. DB dropped those from the batch with their KV (the engine's default, recompute)
    and none of the 1000 finished within 180 s (arrival order: 17.5 s). A request left out of DB's
    batch now keeps its KV, as SeaLLM's DB has it: delay is the cost of its preemption."""
    reqs = [("a", HistoryRequest(0.0, 100, 50))] * 1000
    plan = PlacementPlan("x", (group(("a",), 1),))
    db_out, _ = serve(POOL, [A], plan, reqs, stats=STATS, horizon=180.0)
    fcfs_out, _ = serve(POOL, [A], plan, reqs, stats=STATS, policy=FCFS)
    assert all(o.finished for o in db_out)
    assert max(o.latency for o in db_out) <= 1.25 * max(o.latency for o in fcfs_out)


def test_fig2_toy_db_beats_round_robin():
    """A long job of s1 followed by a burst of short s0 jobs, one request per batch (SeaLLM Fig. 2)."""
    from tessera.sim.engine import EngineConfig

    short = StepProfile("short", 0.01, 0.0, 0.0, 0.01, 0.0, 65536)
    s0, s1 = (
        ServiceInput(n, 0, 1024, short, mean_prompt_tokens=10, mean_output_tokens=50) for n in ("s0", "s1")
    )
    reqs = [("s1", HistoryRequest(0.0, 10, 400))] + [
        ("s0", HistoryRequest(0.05 + 0.01 * i, 10, 20)) for i in range(4)
    ]
    stats = {"s0": stats_of(s0, [(10, 20)]), "s1": stats_of(s1, [(10, 400)])}
    engine = EngineConfig(max_batch=1, token_budget=8192, shared_kv=True)
    plan = PlacementPlan("x", (group(("s0", "s1"), 1),))
    ln = {}
    for name, policy in (("db", None), ("rr", RoundRobinSharing)):
        out, _ = serve(POOL, [s0, s1], plan, reqs, stats=stats, policy=policy, engine=engine)
        assert all(o.finished for o in out)
        ln[name] = sum(o.norm_latency for o in out) / len(out)
    assert ln["db"] < ln["rr"], ln


def _hist_service(name: str, arrivals: list[float]) -> ServiceInput:
    hist = tuple(HistoryRequest(a, 100, 50) for a in arrivals)
    return ServiceInput(
        name, 14 * GIB, 512 * 1024, LM, mean_prompt_tokens=100, mean_output_tokens=50, history=hist
    )


def test_estimator_counts_bursts_and_has_no_violation_floor_at_no_load():
    from tessera.control.placement import Group, estimate

    flat = _hist_service("a", [i * 0.5 for i in range(600)])  # 2 req/s for 5 min
    burst = _hist_service("a", [240 + i * 0.1 for i in range(600)])  # the same count within the last minute
    one = [Group(0, 1, services=["a"])]
    assert estimate(POOL, [burst], one).unserved["a"] > 10 * estimate(POOL, [flat], one).unserved["a"]
    idle = _hist_service("a", [0.0, 299.0])
    assert estimate(POOL, [idle], one).unserved["a"] < 0.01
    unplaced = estimate(POOL, [flat], [Group(0, 1)])
    assert unplaced.unserved["a"] >= 600 and unplaced.slo_attainment == 0.0


def test_estimator_short_service_is_not_held_up_by_an_overloaded_long_neighbour():
    from tessera.control.placement import Group, estimate

    short = _hist_service("short", [i * 1.0 for i in range(300)])  # 1 req/s of 100+50 tokens
    long_hist = tuple(HistoryRequest(i * 0.5, 8000, 20) for i in range(600))  # 2 req/s of 8k prompts
    long = ServiceInput(
        "long", 14 * GIB, 512 * 1024, LM, mean_prompt_tokens=8000, mean_output_tokens=20, history=long_hist
    )
    shared = [Group(0, 1, services=["short", "long"])]
    est = estimate(POOL, [short, long], shared)
    # DB serves the short service first: it sees only its own light load, the long one sees both.
    assert est.unserved["long"] >= 500
    assert est.unserved["short"] < 30
    alone = estimate(POOL, [short], [Group(0, 1, services=["short"])])
    assert est.unserved["short"] < 2 * alone.unserved["short"] + 5


def test_simulated_estimate_scores_a_plan_from_its_history():
    from tessera.control.placement import Group, simulate_performance

    light = _hist_service("a", [i * 2.0 for i in range(100)])
    est = simulate_performance(POOL, [light], [Group(0, 1, services=["a"])])
    assert est.slo_attainment == 1.0 and 1.0 <= est.norm_latency < 1.1


def test_estimators_judge_a_class_with_a_ttft_bound_as_the_workers_do():
    """A burst of 20 requests at once, then 20 one by one: all finish within SeaLLM's latency bound
    (slo_scale x execution time), but the burst's shared prefill takes past a 50 ms TTFT. Judged by the
    class, as the workers judge it (tessera.core.slo.slo_met), the burst misses; the analytic
    estimator's queueing slack shrinks to the TTFT bound less the prefill."""
    from dataclasses import replace

    from tessera.control.placement import Group, simulate_performance
    from tessera.core.request import ServiceClass

    burst = replace(_hist_service("a", [0.0] * 20 + [10.0 + 5 * i for i in range(20)]), slo_scale=20.0)
    one = [Group(0, 1, services=["a"])]
    assert simulate_performance(POOL, [burst], one).slo_attainment == 1.0
    strict = replace(burst, slo_class=ServiceClass("chat", ttft_slo_s=0.05, itl_slo_s=1.0))
    assert simulate_performance(POOL, [strict], one).slo_attainment == pytest.approx(0.5)
    assert strict.wait_slack_s(1) == pytest.approx(0.05 - LM.prefill(100))
    assert burst.wait_slack_s(1) == pytest.approx(20.0 * burst.mean_exec_s() - burst.mean_exec_s(1))
    batch = replace(burst, slo_class=ServiceClass("b", kind="batch", deadline_s=60.0))
    assert batch.wait_slack_s(1) == pytest.approx(60.0 - burst.mean_exec_s(1))


def test_the_simulated_estimate_serves_the_backlog_before_the_history():
    """A plan judged on its history alone looks healthy; the requests outstanding at the boundary come
    first and delay the history's, so the same plan estimates worse with a large backlog."""
    from dataclasses import replace

    from tessera.control.placement import Group, simulate_performance

    light = replace(_hist_service("a", [i * 2.0 for i in range(100)]), slo_scale=3.0)
    one = [Group(0, 1, services=["a"])]
    assert simulate_performance(POOL, [light], one).slo_attainment == 1.0
    behind = simulate_performance(POOL, [replace(light, backlog=5000)], one)
    assert behind.slo_attainment < 0.5 and behind.norm_latency > 10
    # Only the arrivals are scored (as M_real counts them): 100 outstanding requests, all at time 0,
    # delay them little; scored too, they halved the estimate (0.495) on their own waits.
    assert simulate_performance(POOL, [replace(light, backlog=100)], one).slo_attainment >= 0.95


def test_the_estimate_of_an_overloaded_service_keeps_its_queue_at_the_horizon():
    """Under a backlog no candidate works off within the replay, every request of the service is
    censored at the horizon: one group and four groups estimated the same L_N (248.6), and a plan
    that gave the service a quarter of the GPUs looked as good. A request still queued there is
    censored at its place in the queue, at the rate the plan finished the service's requests."""
    from dataclasses import replace

    from tessera.control.placement import Group, simulate_performance

    hist = tuple(HistoryRequest(i / 5, 4000, 20) for i in range(300))
    heavy = replace(svc("a"), mean_prompt_tokens=4000, mean_output_tokens=20, history=hist, backlog=2000)
    one = simulate_performance(POOL, [heavy], [Group(0, 1, services=["a"])])
    four = simulate_performance(POOL, [heavy], [Group(i, 1, services=["a"]) for i in range(4)])
    assert one.slo_attainment == four.slo_attainment == 0.0
    assert one.norm_latency > 3 * four.norm_latency


def test_bench_scenario_small_run_counts_every_request_and_replans():
    from tessera.bench.scenarios import BenchConfig
    from tessera.bench.scenarios.seallm import run

    opts = {"services": 4, "gpus": 8, "minutes": 4, "interval_minutes": 1}
    report = run(BenchConfig("seallm", rate=2.0, seed=1, options=opts), lambda *a, **k: None)
    rows = {r["policy"]: r for r in report.results}
    assert set(rows) == {"seallm", "seallm:fixed", "dedicated", "dedicated:replicas", "round-robin"}
    counts = {r["requests"] for r in rows.values()}
    assert len(counts) == 1 and all(r["unfinished"] == r["rejected"] for r in rows.values())
    log = rows["seallm"]["replacements"]
    assert len(log) >= 2
    for entry in log:  # Eq. 8: the next interval is x0.9 or x1.1 (or clamped to [1, 30] min)
        ratio = entry["next_interval_s"] / entry["interval_s"]
        assert (
            ratio == pytest.approx(0.9, abs=0.01)
            or ratio == pytest.approx(1.1, abs=0.01)
            or (entry["next_interval_s"] in (60.0, 1800.0))
        )
    assert len(report.checks) == 5  # the targets, then seallm and seallm:fixed vs the better baseline
    assert report.checks[-1].startswith("seallm:fixed vs ") and "p99_jct" in report.checks[-1]
    with pytest.raises(ValueError, match="unknown --set options"):
        run(BenchConfig("seallm", options={"minute": 3}), lambda *a, **k: None)
    with pytest.raises(ValueError, match="sharing= must be one of pods, co-resident, temporal"):
        run(BenchConfig("seallm", options={"sharing": "shared-kv"}), lambda *a, **k: None)


def test_bench_runs_with_different_initial_intervals_replay_the_same_requests():
    from tessera.bench.scenarios import BenchConfig
    from tessera.bench.scenarios.seallm import run

    def dedicated(i0: int) -> dict:
        opts = {"services": 4, "gpus": 8, "minutes": 3, "interval_minutes": i0}
        report = run(BenchConfig("seallm", rate=1.0, seed=3, options=opts), lambda *a, **k: None)
        return next(r for r in report.results if r["policy"] == "dedicated")

    # The baselines ignore I_0, so their rows match only if both runs drew the same requests.
    one, two = dedicated(1), dedicated(2)
    assert one["requests"] == two["requests"]
    assert one["normalized_latency_mean"] == two["normalized_latency_mean"]


def test_bench_replanner_runs_the_operators_load_shift_watch():
    """bench seallm's timeline re-places between boundaries as the operator does by default
    (``loadShiftThreshold`` 0.5): service a jumps from 1 to 8 req/s at 120 s, and the watch (every
    I_min / 2, once the plan is I_min old) re-places at 150 s, long before the 300 s boundary. Each
    re-placement plans on the last interval, as a boundary does (not on the minute that showed the
    shift, which at a burst's peak over-reacts): at 150 s a's 2.4 req/s over [0, 150] keeps 2 + 2, the
    shift holds, and at 210 s (4 req/s over [0, 210]) a gets the spare GPU. A steady load, or the
    watch off (0: the paper's timeline), re-places nothing."""
    from dataclasses import replace

    from tessera.bench.scenarios.seallm import serve_adaptive
    from tessera.core.planners import IntervalSettings

    pool = PoolInput("p", "A800", 80 * GIB, 4)
    a, b = (replace(_hist_service(n, [-60.0 + i for i in range(60)]), request_rate=1.0) for n in "ab")
    steady = [HistoryRequest(float(t), 100, 50) for t in range(280)]
    burst = steady[:120] + [HistoryRequest(120 + i / 8, 100, 50) for i in range(8 * 160)]
    stats = {s.name: stats_of(s, []) for s in (a, b)}
    settings = IntervalSettings(initial_s=300.0, min_s=60.0, max_s=1800.0)

    def replan(window_a: list[HistoryRequest], threshold: float) -> tuple[list[tuple[float, str]], dict]:
        window = {"a": window_a, "b": steady}
        *_, first, rp = serve_adaptive(pool, [a, b], window, stats, settings, shift_threshold=threshold)
        assert {g.services: g.replicas.total for g in first.groups} == {("a",): 2, ("b",): 2}
        return [(e["boundary_s"], e["trigger"], e["instances_started"]) for e in rp.log], {
            g.services: g.replicas.total for g in rp.plan.groups
        }

    shifts = [(150.0, "load-shift", 0), (210.0, "load-shift", 1), (270.0, "load-shift", 0)]
    assert replan(burst, 0.5) == (shifts, {("a",): 3, ("b",): 1})
    assert replan(steady, 0.5)[0] == []
    assert replan(burst, 0.0)[0] == []


def test_a_shared_group_plays_as_its_pods_run_it():
    """Engines that cannot sleep: one engine per model with its own KV share (memory_plan's split), no
    temporal-sharing overhead, under the first service's policy. Engines that sleep: the same shares,
    one model awake at a time (a swap per turn)."""
    from tessera.control.placement_sim import pool_sharing, separate_kv_bytes
    from tessera.sim.coresident import CoResidentInstance

    cpu = PoolInput("p", "A800", 80 * GIB, 8, engines_sleep=False)
    gpu = PoolInput("p", "A800", 80 * GIB, 8)
    assert (pool_sharing(cpu), pool_sharing(gpu), pool_sharing(POOL)) == (
        "co-resident",
        "swapping",
        "temporal",
    )
    big = svc("big", weights=26 * GIB, kv=800 * 1024)
    profiles = group_profiles(cpu, [A, big], 2)
    each = separate_kv_bytes(cpu, [A, big], 2)
    assert each == (0.9 * 80 * GIB - 40 * GIB / 2 - 2 * 4 * GIB) / 2
    assert profiles["big"].kv_capacity_tokens == int(each // (800 * 1024 / 2)) // 16 * 16
    assert profiles["a"].decode_c0 == pytest.approx(LM.at_tp(2).decode_c0)  # no 1.04 overhead
    a, b = ServiceInput("a", 14 * GIB, 512 * 1024, LM, policy="fcfs"), B
    reqs = [(n, HistoryRequest(0.1 * i, 100, 40)) for i in range(6) for n in ("a", "b")]
    plan = PlacementPlan("x", (group(("a", "b"), 1),))
    out, cluster = serve(cpu, [a, b], plan, reqs, stats=STATS)
    (inst,) = cluster.instances
    assert type(inst) is CoResidentInstance and type(inst.policy) is FCFS
    assert all(o.finished for o in out) and inst.model_swaps == 0
    out, cluster = serve(gpu, [a, b], plan, reqs, stats=STATS)
    (inst,) = cluster.instances
    assert type(inst) is not CoResidentInstance and inst.model_swaps >= 1
    assert all(o.finished for o in out)


def test_both_estimators_report_each_groups_attainment():
    """A light service alone on one group and an overloaded pair on another: each group's attainment is
    that of the requests its instances serve, in the simulated estimate and the analytic one."""
    from tessera.control.placement import Group, estimate, simulate_performance

    light = _hist_service("a", [i * 2.0 for i in range(100)])
    heavy = [
        ServiceInput(
            n, 14 * GIB, 512 * 1024, LM, mean_prompt_tokens=8000, mean_output_tokens=20,
            history=tuple(HistoryRequest(i * 0.05, 8000, 20) for i in range(2000)),
        )
        for n in ("b", "c")
    ]  # fmt: skip
    groups = [Group(0, 1, services=["a"]), Group(1, 1, services=["b", "c"])]
    cpu = PoolInput("p", "A800", 80 * GIB, 8, engines_sleep=False)
    for est in (simulate_performance(cpu, [light, *heavy], groups), estimate(cpu, [light, *heavy], groups)):
        assert set(est.by_group) == {(("a",), 1), (("b", "c"), 1)}
        assert est.by_group[(("a",), 1)] > 0.95 > 0.5 > est.by_group[(("b", "c"), 1)]
