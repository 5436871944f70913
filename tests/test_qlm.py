"""QLM: group formation, estimator equations, MILP vs brute force, EDF fallback, LSO effects."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from tessera.bench.runner import run_one
from tessera.core.policies.qlm import QLMPolicy
from tessera.core.policies.qlm.baseline import SwapBatched, SwapFCFS
from tessera.core.policies.qlm.estimator import (
    EngineRates,
    EpsMeter,
    GroupCosts,
    QueuedGroup,
    TokenStats,
    first_violation,
    group_costs,
    start_times,
)
from tessera.core.policies.qlm.groups import Grouper, GroupKey, RequestGroup, VirtualQueue
from tessera.core.policies.qlm.lso import ModelTiers, TierCosts, eviction_victims
from tessera.core.policies.qlm.milp import (
    GroupSpec,
    QueueSpec,
    SolverSettings,
    _window,
    evaluate,
    heuristic_plan,
    solve,
)
from tessera.core.policy import Decision, InstanceView
from tessera.core.profile import StepProfile
from tessera.core.profiles import load_profile
from tessera.core.request import Request, ServiceClass
from tessera.sim.cluster import ClusterConfig, make_router
from tessera.sim.engine import EngineConfig
from tessera.sim.workloads import Mix, build_requests

INTER = ServiceClass("interactive", "interactive", ttft_slo_s=20.0)
BATCH = ServiceClass("batch", "batch", deadline_s=3600.0)


def _req(i: int, t: float = 0.0, model: str = "m", cls: ServiceClass = BATCH, out: int = 100) -> Request:
    return Request(f"r{i}", t, 50, out, model=model, service_class=cls, true_output_tokens=out)


# ---- groups ---------------------------------------------------------------------------------------
def test_groups_split_by_key_and_size_and_close_when_started() -> None:
    grouper = Grouper(lambda key: 3)
    reqs = [_req(i, i) for i in range(7)] + [_req(10, 10, model="other")] + [_req(11, 11, cls=INTER)]
    groups = [grouper.add(r)[0] for r in reqs]
    assert [g.id for g in groups[:7]] == [0, 0, 0, 1, 1, 1, 2]  # FCFS chunks of at most 3
    assert groups[7].id not in {g.id for g in groups[:7]}  # other model: own group
    assert groups[8].id not in {g.id for g in groups[:8]}  # other class: own group
    g2 = groups[6]
    g2.mark_running(reqs[6])
    assert not g2.is_open
    assert grouper.add(_req(12, 12))[1]  # a started group takes no new member


def test_group_fcfs_and_eviction_returns_to_its_place() -> None:
    grouper = Grouper(lambda key: 10)
    reqs = [_req(i, float(i)) for i in range(4)]
    for r in reqs:
        grouper.add(r)
    group = grouper.of[id(reqs[0])]
    group.mark_running(reqs[0])
    group.mark_running(reqs[1])
    assert group.head() is reqs[2]
    group.mark_waiting(reqs[1])  # evicted: back ahead of later arrivals
    assert list(group.pending()) == [reqs[1], reqs[2], reqs[3]]
    for r in reqs:
        grouper.forget(r)
    assert group.done
    vq = VirtualQueue("i0")
    vq.append(group)
    vq.drop_done()
    assert len(vq) == 0


# ---- estimator --------------------------------------------------------------------------------------
PROFILE = StepProfile("t", 0.01, 0.0, 0.0, 0.02, 0.001, kv_capacity_tokens=10_000)


def test_theta_and_group_costs_hand_computed() -> None:
    stats = TokenStats(mu_in=100, mu_out=100, var_out=400)  # sigma 20
    rates = EngineRates(PROFILE, max_batch=64, eps=1.25)
    # B = min(64, 10000 / 200) = 50; d = 0.01 s (flat profile). A request: its prefill 0.02 + 0.001 * 100
    # (which gives its first token), then 99 decode shares of 0.01 / 50; T = 1.25 * 0.1398 s.
    assert rates.batch_for(stats) == pytest.approx(50)
    t_req = 1.25 * (0.12 + 99 * 0.01 / 50)
    assert rates.request_time(stats) == pytest.approx(t_req)
    assert rates.theta(stats) == pytest.approx(100 / t_req)  # 572 tok/s, not Eq. 15's 4000
    token = 1.25 * 0.01 / 50  # eps d / B: the spread's per-token time
    c = group_costs([100] * 16, stats=stats, rates=rates, z=2.0, max_tokens=300, context_len=4096)
    assert c.drain == pytest.approx(16 * t_req + 2 * 20 * 4 * token)  # n T + z sigma sqrt(n) eps d / B
    assert c.last_wait == pytest.approx(15 * t_req + 2 * 20 * math.sqrt(15) * token)
    assert c.prefill == pytest.approx(0.02 + 0.001 * 100)
    assert c.completion == pytest.approx(c.last_wait + c.prefill + 300 * 1.25 * 0.01)  # O_max eps d
    capped = group_costs([100] * 16, stats, rates, 2.0, max_tokens=10_000, context_len=1000)
    assert capped.completion == pytest.approx(c.last_wait + c.prefill + 900 * 1.25 * 0.01)  # ctx - mu_I


def test_group_costs_count_each_waiting_members_own_prompt() -> None:
    stats = TokenStats(mu_in=100, mu_out=100, var_out=0)
    rates = EngineRates(PROFILE, max_batch=64)
    long_last = group_costs([100, 100, 2100], stats, rates, 0.0, max_tokens=100, context_len=4096)
    long_first = group_costs([2100, 100, 100], stats, rates, 0.0, max_tokens=100, context_len=4096)
    # The same members drain in the same time; the 2000 extra prompt tokens (2 s of prefill at
    # 0.001 s a token) delay the last member only when they are ahead of it, and the last
    # member's own prefill is its P.
    assert long_first.drain == pytest.approx(long_last.drain)
    assert long_first.last_wait == pytest.approx(long_last.last_wait + 2.0)
    assert long_last.prefill == pytest.approx(0.02 + 0.001 * 2100)
    assert long_first.prefill == pytest.approx(0.02 + 0.001 * 100)


def test_estimated_waits_of_a_prompt_heavy_burst_match_the_simulator() -> None:
    # Long prompts and short answers (Azure's code trace: 2k-token prompts, 27-token answers):
    # the prefills stall the batch and take most of the instance's time. The wait of every queued
    # request is checked against when the simulator really starts it; a decode-only Theta (the
    # paper's Eq. 15) put the last request's wait below a tenth of the real one.
    rng = np.random.default_rng(3)
    prompts = rng.choice([300, 6000], size=160).tolist()
    outputs = rng.integers(10, 50, size=160).tolist()
    reqs = build_requests(np.zeros(160), prompts, outputs, rng, Mix(classes=((BATCH, 1.0),)), prefix="b")
    seeds = {("default", "batch"): (float(np.mean(prompts)), float(np.mean(outputs)), float(np.std(outputs)))}
    snaps: list[tuple[float, dict[int, float]]] = []

    class Probe(QLMPolicy):
        def schedule(self, view: InstanceView) -> Decision:
            if not snaps and view.now >= 5.0:
                snaps.append((view.now, self.estimated_waits(view.now)))
            return super().schedule(view)

    done, _ = run_one(
        reqs,
        lambda: Probe(reorder=False, token_seeds=seeds, eps_window_s=math.inf),
        _cluster(max_batch=16),
    )
    t, estimates = snaps[0]
    actual = {id(r): r.first_scheduled_at - t for r in done}
    assert len(estimates) > 100
    waits = np.array([actual[rid] for rid in estimates])
    est = np.array(list(estimates.values()))
    assert est.sum() / waits.sum() == pytest.approx(1.0, abs=0.05)
    assert np.abs(est - waits).max() < 0.05 * waits.max()


def test_decode_time_uses_the_length_biased_context_of_running_requests() -> None:
    profile = StepProfile("c", 0.01, 0.0, 1e-6, 0.02, 0.001, kv_capacity_tokens=10_000)
    stats = TokenStats(mu_in=100, mu_out=100, var_out=100**2)  # CV 1: mean age E[O^2]/(2 mu) = 100
    rates = EngineRates(profile, max_batch=10)
    # B = 10; each running request holds 100 prompt + 100 generated tokens on average (not 50).
    assert rates.decode_time(stats) == pytest.approx(0.01 + 1e-6 * 10 * 200)


def test_eps_meter_counts_only_saturated_time() -> None:
    meter = EpsMeter(window_s=math.inf)
    meter.observe(0.0, 0, 0.0, batch=10, decode_step_s=0.01, saturated=True)
    # 10 s saturated at batch 10, d = 0.01 s: 10 000 tokens at full speed; 5 000 seen -> eps = 2.
    meter.observe(10.0, 5_000, 0.0, batch=10, decode_step_s=0.01, saturated=False)
    meter.observe(20.0, 123, 1.0, batch=10, decode_step_s=0.01, saturated=True)  # idle interval: ignored
    assert meter.flush() == pytest.approx(2.0)
    assert meter.flush() is None  # the window was consumed


def test_eps_meter_counts_prefills_as_modelled_work() -> None:
    meter = EpsMeter(window_s=math.inf)
    meter.observe(0.0, 0, 0.0, batch=10, decode_step_s=0.01, saturated=True)
    # 5 000 tokens are 5 s of modelled decode, the prefills 3 s more: 10 s observed -> eps = 1.25.
    meter.observe(10.0, 5_000, 3.0, batch=10, decode_step_s=0.01, saturated=True)
    assert meter.flush() == pytest.approx(1.25)


def test_token_stats_ewma_moves_towards_observations() -> None:
    stats = TokenStats(10, 100, 0, alpha=0.5)
    stats.observe_output(200)
    assert stats.mu_out == pytest.approx(150)
    assert stats.var_out == pytest.approx(0.5 * (0 + 100 * 50))


def test_violation_walk_charges_drain_and_swap_hand_computed() -> None:
    a = QueuedGroup("a", GroupCosts(10, 9, 30, 1), slack=100)
    b = QueuedGroup("b", GroupCosts(5, 4, 20, 1), slack=100)
    starts = start_times([a, a, b], loaded_model="a", residual=2, swap_s=7)
    # b waits for a's drain twice, then the second a's completion beyond drain (30-10) and the swap.
    assert starts == pytest.approx([2, 12, 22 + 20 + 7])
    late_b = QueuedGroup("b", GroupCosts(5, 4, 20, 1), slack=52)
    assert first_violation([a, a, late_b], "a", 2, 7, tail_aware=True) == 2  # 49 + 4 + 1 > 52
    assert first_violation([a, a, late_b], "a", 2, 7, tail_aware=False) is None


def test_the_walk_charges_an_adapter_load_not_a_swap_between_adapters_of_one_engine() -> None:
    costs = GroupCosts(10, 9, 30, 1)
    a1, a2, base, other = (QueuedGroup(m, costs, slack=100) for m in ("a1", "a2", "base", "other"))
    of = {"a1": "base", "a2": "base"}
    # a1 runs now (held: no load), a2 loads in 0.5 s, the base needs none, another model is a swap
    starts = start_times(
        [a1, a2, base, other], "base", 2, 7, adapter_of=of, adapter_load_s=0.5, held_adapters={"a1"}
    )
    assert starts == pytest.approx([2, 12.5, 22.5, 32.5 + 20 + 7])
    assert start_times([a1, a2], "base", 2, 7) == pytest.approx([2 + 7, 19 + 20 + 7])  # no adapters known
    assert first_violation([a1, a2], "base", 2, 7, True, adapter_of=of, adapter_load_s=0.5) is None


def test_estimated_waits_behind_another_adapter_of_the_engine_match_the_simulator() -> None:
    """Two adapters' groups on one base's engine: the second starts once the first's members have all
    started, plus its load, as the simulator serves it; a model swap (20 s and more) is no part of it."""
    reqs = [_req(i, 0.0, model="a1" if i < 48 else "a2") for i in range(96)]
    seeds = {(m, "batch"): (50.0, 100.0, 0.0) for m in ("a1", "a2")}
    snaps: list[tuple[float, dict[int, float], float]] = []

    class Probe(QLMPolicy):
        def schedule(self, view: InstanceView) -> Decision:
            if not snaps and view.now >= 1.0:
                snaps.append((view.now, self.estimated_waits(view.now), self.swap_time()))
            return super().schedule(view)

    config = ClusterConfig(
        {"base": load_profile("a100-llama3-8b")},
        engine=EngineConfig(max_batch=16),
        adapters={"a1": "base", "a2": "base"},
    )
    done, _ = run_one(reqs, lambda: Probe(reorder=False, token_seeds=seeds, eps_window_s=math.inf), config)
    t, estimates, swap = snaps[0]
    second = [r for r in done if r.model == "a2"]
    est = np.array([estimates[id(r)] for r in second])
    waits = np.array([r.first_scheduled_at - t for r in second])
    assert est.sum() / waits.sum() == pytest.approx(1.0, abs=0.15)
    assert np.abs(est - waits).max() < 1.0 < swap / 10


def test_one_decision_mixes_adapters_groups_up_to_the_engine_s_lora_slots() -> None:
    """Three adapters' groups queued on one base's engine with room for all: with two LoRA slots the
    first two groups start in the same decision, as vLLM mixes them (not one group per decision), and
    the third waits for a slot."""
    reqs = [_req(i, 0.0, model=f"a{i // 4}") for i in range(12)]
    config = ClusterConfig(
        {"base": load_profile("a100-llama3-8b")},
        engine=EngineConfig(max_batch=16, max_loras=2),
        adapters={f"a{k}": "base" for k in range(3)},
    )
    done, _ = run_one(reqs, lambda: QLMPolicy(reorder=False), config)
    starts = {m: {r.first_scheduled_at for r in done if r.model == m} for m in ("a0", "a1", "a2")}
    assert starts["a0"] == starts["a1"] == {0.0}
    assert min(starts["a2"]) >= min(r.finished_at for r in done if r.model != "a2")


def test_the_milp_orders_adapters_groups_as_their_engine_s_without_swaps() -> None:
    """Three adapters' chat and batch requests interleaved on one base's engine. Priced as models of
    their own, every change between them was a swap: every solve fell back to EDF (13 of 13), its
    reorders evicted running work, and chat met 54 % of its TTFT SLO; as their base's, plans hold."""
    chat = ServiceClass("chat", "interactive", ttft_slo_s=2.0)
    reqs = [
        Request(f"r{i}", i * 0.05, 200, 200, model=f"a{i % 3}", service_class=chat if i % 2 else BATCH,
                true_output_tokens=200)
        for i in range(300)
    ]  # fmt: skip
    adapters = {f"a{k}": "base" for k in range(3)}
    config = ClusterConfig(
        {"base": load_profile("a100-llama3-8b")}, engine=EngineConfig(max_batch=32), adapters=adapters
    )
    policies: list[QLMPolicy] = []

    def make() -> QLMPolicy:
        policies.append(QLMPolicy())
        return policies[-1]

    _, metrics = run_one(reqs, make, config)
    (policy,) = policies
    assert policy.counters["model_swaps"] == 0
    assert policy.counters["fallbacks"] < policy.counters["solves"]
    assert metrics["slo_attainment_by_class"]["chat"] > 0.6


# ---- MILP ---------------------------------------------------------------------------------------------
def _brute_force(groups, queues, tail_aware=True):  # type: ignore[no-untyped-def]
    best = None
    names = [q.name for q in queues]
    for assign in itertools.product(names, repeat=len(groups)):
        if any(q not in g.costs for g, q in zip(groups, assign, strict=True)):
            continue
        per = {n: [g.id for g, q in zip(groups, assign, strict=True) if q == n] for n in names}
        for orders in itertools.product(*(itertools.permutations(per[n]) for n in names)):
            order = dict(zip(names, (list(o) for o in orders), strict=True))
            total, ok = evaluate(order, groups, queues, tail_aware)
            if ok and (best is None or total < best):
                best = total
    return best


def _random_case(rng: np.random.Generator, n: int, n_queues: int, models: int):  # type: ignore[no-untyped-def]
    queues = [QueueSpec(f"q{g}", f"m{g % models}", float(rng.uniform(0, 3)), 8.0) for g in range(n_queues)]
    groups = []
    for i in range(n):
        costs = {}
        for q in queues:
            w = float(rng.uniform(2, 12))
            costs[q.name] = GroupCosts(w, 0.8 * w, 0.8 * w + float(rng.uniform(1, 10)), 0.5)
        groups.append(GroupSpec(i, f"m{rng.integers(models)}", float(rng.uniform(15, 60)), costs))
    return groups, queues


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force_on_small_cases(seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups, queues = _random_case(rng, n=int(rng.integers(3, 6)), n_queues=int(rng.integers(1, 3)), models=2)
    best = _brute_force(groups, queues)
    plan = solve(groups, queues, SolverSettings(time_limit_s=20, mip_gap=0.0, slots_factor=10))
    if best is None:
        assert plan.status == "edf-infeasible"
    else:
        assert plan.status == "optimal"
        assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-6)
        assert evaluate(plan.order, groups, queues)[1]  # every p <= 0


def test_single_model_single_queue_rule_matches_brute_force() -> None:
    rng = np.random.default_rng(7)
    queues = [QueueSpec("q", "m", 1.0, 5.0)]
    for _ in range(5):
        groups = []
        for i in range(6):
            w = float(rng.uniform(1, 10))
            groups.append(GroupSpec(i, "m", float(rng.uniform(10, 50)), {"q": GroupCosts(w, w, w + 5, 0.2)}))
        best = _brute_force(groups, queues)
        plan = solve(groups, queues, SolverSettings())
        if best is None:
            assert plan.status == "edf-infeasible"
        else:
            assert plan.objective == pytest.approx(best)


def test_a_group_capped_below_its_keys_answers_still_gets_a_plan() -> None:
    # Members asking for 4 tokens where the key's answers average 800: the drain counts 800 per
    # member, the completion the cap, so C < W. The swap behind such a group waits for no negative
    # time, and the MILP's warm start (which PuLP checks against the lower bound 0) does not fail.
    rates = EngineRates(load_profile("a100-llama3-8b"), max_batch=64)
    costs = group_costs([200] * 8, TokenStats(mu_in=200, mu_out=800, var_out=100.0), rates, 0.0, 4, 4096)
    assert costs.completion < costs.drain
    queues = [QueueSpec("q", "m0", 0.0, 8.0)]
    groups = [GroupSpec(i, f"m{i % 2}", 500.0, {"q": costs}) for i in range(4)]
    plan = solve(groups, queues, SolverSettings(time_limit_s=10))
    assert sorted(plan.order["q"]) == [0, 1, 2, 3]
    walk = [QueuedGroup("m0", costs, 500.0), QueuedGroup("m1", costs, 500.0)]
    assert start_times(walk, "m0", 0.0, 8.0) == pytest.approx([0.0, costs.drain + 8.0])


def test_infeasible_falls_back_to_edf_and_keeps_every_group() -> None:
    c = GroupCosts(10, 9, 20, 1)
    queues = [QueueSpec("q0", "m", 0, 5), QueueSpec("q1", "m", 0, 5)]
    groups = [
        GroupSpec(i, "m", slack, {"q0": c, "q1": c}, current=f"q{i % 2}")
        for i, slack in enumerate([5, 3, 50])
    ]
    plan = solve(groups, queues, SolverSettings())
    assert plan.status == "edf-infeasible"
    assert sorted(g for o in plan.order.values() for g in o) == [0, 1, 2]
    assert plan.order["q0"] == [0, 2] and plan.order["q1"] == [1]  # own VQ, by slack


def _placed(plan) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(g for o in plan.order.values() for g in o)


@pytest.mark.parametrize("seed", range(3))
def test_milp_matches_brute_force_on_three_queues(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    groups, queues = _random_case(rng, n=5, n_queues=3, models=3)
    best = _brute_force(groups, queues)
    plan = solve(groups, queues, SolverSettings(time_limit_s=20, mip_gap=0.0, slots_factor=10))
    assert best is not None  # slacks of 15-60 s leave room on three VQs
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert set(plan.phases) == {"build_s", "write_s", "solve_s"}


def test_tiny_time_limit_falls_back_without_losing_a_group() -> None:
    from tessera.bench.scenarios.qlm import synthetic_groups

    groups, queues = synthetic_groups(24, 4, seed=0)
    plan = solve(groups, queues, SolverSettings(time_limit_s=1e-3))
    assert plan.status in ("heuristic", "edf-timeout")  # no MILP answer claimed
    assert _placed(plan) == list(range(24))
    assert plan.solve_s < 0.5


def test_warm_start_returned_when_cbc_finds_nothing_better() -> None:
    from tessera.bench.scenarios.qlm import synthetic_groups

    groups, queues = synthetic_groups(100, 4, seed=0)
    # The joint model (13.6k binaries) forced: CBC's root alone takes most of the limit.
    plan = solve(groups, queues, SolverSettings(time_limit_s=1.5, joint_max_binaries=10**9))
    warm = heuristic_plan(groups, queues)
    assert plan.status == "heuristic"
    assert plan.order == warm.order
    assert plan.objective == pytest.approx(evaluate(warm.order, groups, queues)[0])
    assert plan.solve_s < 1.5 + 0.3  # the limit bounds build, write and CBC (killed at the deadline)


@pytest.mark.parametrize("seed", range(4))
def test_window_milp_is_optimal_over_the_window_with_the_tail_fixed(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    groups, queues = _random_case(rng, n=7, n_queues=2, models=2)
    settings = SolverSettings(time_limit_s=20, mip_gap=0.0, joint_max_binaries=1, window_groups=3)
    plan = solve(groups, queues, settings)
    warm = heuristic_plan(groups, queues)
    window, tail_order, _ = _window(warm.order, groups, queues, settings)
    names = [q.name for q in queues]
    best = None  # brute force: every placement of the window's groups ahead of the fixed tails
    for assign in itertools.product(names, repeat=len(window)):
        per = {n: [g.id for g, q in zip(window, assign, strict=True) if q == n] for n in names}
        for orders in itertools.product(*(itertools.permutations(per[n]) for n in names)):
            order = {n: list(o) + tail_order.get(n, []) for n, o in zip(names, orders, strict=True)}
            total, ok = evaluate(order, groups, queues)
            if ok and (best is None or total < best):
                best = total
    assert _placed(plan) == list(range(7))
    if best is None:
        assert plan.status in ("heuristic", "edf-timeout")
    else:
        assert plan.status == "window-optimal"
        assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_window_covering_every_group_is_the_joint_optimum() -> None:
    rng = np.random.default_rng(3)
    groups, queues = _random_case(rng, n=5, n_queues=2, models=2)
    best = _brute_force(groups, queues)
    plan = solve(
        groups, queues, SolverSettings(mip_gap=0.0, slots_factor=10, joint_max_binaries=1, window_groups=5)
    )
    assert best is not None
    assert plan.status == "window-optimal"
    assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_hundred_groups_use_the_window_milp_and_keep_every_group() -> None:
    from tessera.bench.scenarios.qlm import synthetic_groups

    groups, queues = synthetic_groups(100, 4, seed=3)  # the heuristic plan misses one SLO here
    assert not evaluate(heuristic_plan(groups, queues).order, groups, queues)[1]
    plan = solve(groups, queues, SolverSettings(time_limit_s=5.0))
    assert plan.status in ("window-optimal", "feasible")  # the late group is in the window
    assert _placed(plan) == list(range(100))
    assert evaluate(plan.order, groups, queues)[1]


def test_interactive_group_never_behind_a_swap_longer_than_its_slack() -> None:
    c = GroupCosts(5, 4, 10, 0.5)
    queues = [QueueSpec("q0", "a", 0, 30), QueueSpec("q1", "b", 0, 30)]
    groups = [
        GroupSpec(0, "a", 20, {"q0": c, "q1": c}),  # interactive-like: slack 20 s < swap 30 s
        GroupSpec(1, "b", 20, {"q0": c, "q1": c}),
        GroupSpec(2, "a", 500, {"q0": c, "q1": c}),
    ]
    plan = solve(groups, queues, SolverSettings())
    assert plan.status == "optimal"
    assert 0 in plan.order["q0"] and 1 in plan.order["q1"]  # each on the instance with its model loaded


def test_pinned_group_does_not_migrate() -> None:
    c = GroupCosts(5, 4, 10, 0.5)
    queues = [QueueSpec("q0", "m", 50, 1), QueueSpec("q1", "m", 0, 1)]
    groups = [
        GroupSpec(0, "m", 500, {"q0": c, "q1": c}, pinned="q0"),
        GroupSpec(1, "m", 500, {"q0": c, "q1": c}),
    ]
    plan = solve(groups, queues, SolverSettings())
    assert plan.order["q0"] == [0] and plan.order["q1"] == [1]


# ---- LSOs -----------------------------------------------------------------------------------------------
def test_eviction_victims_latest_position_first_and_only_enough() -> None:
    running = [_req(i) for i in range(4)]
    pos = {id(running[0]): 0, id(running[1]): 2, id(running[2]): 2, id(running[3]): 3}
    victims = eviction_victims(1, running, pos, need_slots=2, need_tokens=0, free_slots=0, free_tokens=0)
    assert victims == [running[3], running[2]]  # position 3 first, then LIFO within position 2


def test_tiers_warm_model_swaps_faster_than_cold() -> None:
    tiers = ModelTiers(TierCosts(engine_reinit_s=20, disk_to_cpu_bytes_per_s=2e9, cpu_model_bytes=40e9))
    assert tiers.extra_swap_s("b", 16e9, 0.0) == pytest.approx(28.0)  # S0 + storage read
    tiers.plan(["a", "b"], {"a": 16e9, "b": 16e9}, now=0.0)
    assert tiers.extra_swap_s("b", 16e9, 100.0) == pytest.approx(20.0)  # prefetched: S0 only
    cold = ModelTiers(TierCosts(warm_start=False))
    cold.plan(["a", "b"], {"a": 16e9, "b": 16e9}, now=0.0)
    assert cold.extra_swap_s("b", 16e9, 100.0) == pytest.approx(28.0)


def _cluster(
    models: tuple[str, ...] = ("default",), instances: int = 1, max_batch: int = 16
) -> ClusterConfig:
    profile = load_profile("a100-llama3-8b")
    return ClusterConfig(
        {m: profile for m in models}, instances=instances, engine=EngineConfig(max_batch=max_batch)
    )


def test_eviction_lets_interactive_run_within_an_iteration() -> None:
    rng = np.random.default_rng(0)
    batch = build_requests(
        np.zeros(32), [200] * 32, [1500] * 32, rng, Mix(classes=((BATCH, 1.0),)), prefix="b"
    )
    inter = build_requests(
        np.full(4, 5.0), [100] * 4, [50] * 4, rng, Mix(classes=((INTER, 1.0),)), prefix="i"
    )
    seeds = {("default", "batch"): (200.0, 1500.0, 1.0), ("default", "interactive"): (100.0, 50.0, 1.0)}
    waits = {}
    for evict in (True, False):
        reqs, _ = run_one(
            batch + inter, lambda evict=evict: QLMPolicy(eviction=evict, token_seeds=seeds), _cluster()
        )
        waits[evict] = max(r.first_scheduled_at - r.arrival for r in reqs if r.id.startswith("i"))
    assert waits[True] < 0.1
    assert waits[False] > 10 * waits[True]


def test_eviction_spares_interactive_streams_unless_asked() -> None:
    relaxed = ServiceClass("relaxed", "interactive", ttft_slo_s=600.0)
    tight = ServiceClass("tight", "interactive", ttft_slo_s=2.0)
    rng = np.random.default_rng(0)
    streams = build_requests(
        np.zeros(24), [200] * 24, [1500] * 24, rng, Mix(classes=((relaxed, 1.0),)), prefix="s"
    )
    urgent = build_requests(
        np.full(4, 5.0), [100] * 4, [50] * 4, rng, Mix(classes=((tight, 1.0),)), prefix="u"
    )
    seeds = {("default", "relaxed"): (200.0, 1500.0, 1.0), ("default", "tight"): (100.0, 50.0, 1.0)}
    evicted, waits = {}, {}
    for streams_too in (False, True):
        reqs, _ = run_one(
            streams + urgent,
            lambda s=streams_too: QLMPolicy(evict_streams=s, token_seeds=seeds),
            _cluster(),
        )
        evicted[streams_too] = sum(r.preemptions for r in reqs if r.id.startswith("s"))
        waits[streams_too] = max(r.first_scheduled_at - r.arrival for r in reqs if r.id.startswith("u"))
    assert evicted[False] == 0  # a stream under way keeps its slot: the urgent group waits for one to free
    assert evicted[True] > 0 and waits[True] < 0.1 < waits[False]


def test_late_last_serves_the_requests_still_on_time_first_under_overload() -> None:
    chat = ServiceClass("chat", "interactive", ttft_slo_s=5.0)
    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.uniform(0, 60, 150))  # about 2.5 req/s against about 1.1 served
    reqs = build_requests(arrivals, [100] * 150, [300] * 150, rng, Mix(classes=((chat, 1.0),)))
    seeds = {("default", "chat"): (100.0, 300.0, 1.0)}
    met = {}
    for late_last in (False, True):
        _, metrics = run_one(
            reqs, lambda ll=late_last: QLMPolicy(late_last=ll, token_seeds=seeds), _cluster(max_batch=4)
        )
        met[late_last] = metrics["slo_attainment"]
    assert met[True] > met[False] + 0.02  # 0.673 against 0.640


def test_late_set_back_puts_late_chat_ahead_of_batch_work_with_ample_slack() -> None:
    # Chat overloads the instance while batch work with an hour of slack waits: unbounded, a late chat
    # request waits behind every on-time batch one; bounded at 10 s, only behind those due within 10 s.
    chat = ServiceClass("chat", "interactive", ttft_slo_s=5.0)
    rng = np.random.default_rng(0)
    arrivals = np.sort(rng.uniform(0, 60, 150))
    chats = build_requests(arrivals, [100] * 150, [300] * 150, rng, Mix(classes=((chat, 1.0),)), prefix="c")
    batch = build_requests(
        np.zeros(60), [100] * 60, [300] * 60, rng, Mix(classes=((BATCH, 1.0),)), prefix="b"
    )
    seeds = {("default", "chat"): (100.0, 300.0, 1.0), ("default", "batch"): (100.0, 300.0, 1.0)}
    worst_chat, batch_met = {}, {}
    for bound in (None, 10.0):
        done, _ = run_one(
            chats + batch,
            lambda b=bound: QLMPolicy(late_last=True, late_set_back_s=b, token_seeds=seeds),
            _cluster(max_batch=4),
        )
        worst_chat[bound] = max(r.first_token_at - r.arrival for r in done if r.id.startswith("c"))
        batch_met[bound] = all(r.finished_at - r.arrival <= 3600 for r in done if r.id.startswith("b"))
    assert worst_chat[10.0] < worst_chat[None] - 20  # 85.1 s against 121.9 s
    assert batch_met[10.0] and batch_met[None]
    with pytest.raises(ValueError, match="late_set_back_s"):
        QLMPolicy(late_last=True, late_set_back_s=-1.0)


@pytest.mark.parametrize(("middle_ttft_s", "pulled"), [(20.0, {"r0", "r1"}), (60.0, {"r2", "r0"})])
def test_a_late_request_waits_behind_the_on_time_ones_due_within_the_set_back(
    middle_ttft_s: float, pulled: set[str]
) -> None:
    # VQ order: batch work with an hour of slack, a late interactive request, an on-time interactive
    # one; two slots at 15 s. An on-time request due within the 10 s bound (slack 5 s) goes ahead of the
    # late one; one with 45 s of slack goes after it. (VQ order alone pulls r0 and r2 in both cases;
    # the unbounded set-back r0 and r1 in both.)
    middle = ServiceClass("middle", "interactive", ttft_slo_s=middle_ttft_s)
    tight = ServiceClass("tight", "interactive", ttft_slo_s=5.0)
    policy = QLMPolicy(reorder=False, eviction=False, late_set_back_s=10.0)
    for req in (_req(0), _req(2, cls=tight), _req(1, cls=middle)):
        policy.add(req, 0.0)
    profile = load_profile("a100-llama3-8b")
    view = InstanceView(15.0, "i0", [], max_batch=2, kv_capacity_tokens=100_000, kv_used_tokens=0,
                        profile=profile)  # fmt: skip
    assert {r.id for r in policy.schedule(view).run} == pulled


def test_reordering_meets_interactive_slo_where_fcfs_does_not() -> None:
    rng = np.random.default_rng(1)
    batch = build_requests(
        np.zeros(200), [200] * 200, [400] * 200, rng, Mix(classes=((BATCH, 1.0),)), prefix="b"
    )
    inter = build_requests(
        np.full(8, 2.0), [100] * 8, [50] * 8, rng, Mix(classes=((INTER, 1.0),)), prefix="i"
    )
    from tessera.core.registry import make_policy

    fcfs, _ = run_one(batch + inter, lambda: make_policy("fcfs"), _cluster())
    qlm, _ = run_one(batch + inter, lambda: QLMPolicy(eviction=False), _cluster())

    def worst(reqs: list[Request]) -> float:
        return max(r.first_token_at - r.arrival for r in reqs if r.id.startswith("i"))

    assert worst(fcfs) > 20.0
    assert worst(qlm) < 20.0


def test_grouping_and_load_balancing_cut_model_swaps() -> None:
    rng = np.random.default_rng(2)
    models = ("a", "b", "c")
    mix = Mix(classes=((BATCH, 1.0),), models=tuple((m, 1.0) for m in models))
    reqs = build_requests(np.linspace(0, 5, 150), [100] * 150, [100] * 150, rng, mix)
    cluster = _cluster(models, instances=2)
    _, naive = run_one(reqs, SwapFCFS, cluster)
    _, qlm = run_one(reqs, QLMPolicy, cluster, router=make_router("least-wait"))
    assert qlm["swaps"] <= 2 * len(models)
    assert naive["swaps"] > 5 * qlm["swaps"]
    assert qlm["throughput_rps"] > 2 * naive["throughput_rps"]


def test_live_route_keeps_models_together_and_uses_every_instance() -> None:
    # Two models on two instances, the first request alone: the live route counts each instance's
    # requests of every model and a swap where it has none of the request's model, so each model
    # settles on its own instance (one swap each at most) and both instances serve.
    rng = np.random.default_rng(3)
    models = ("a", "b")
    mix = Mix(classes=((BATCH, 1.0),), models=tuple((m, 1.0) for m in models))
    arrivals = np.concatenate([[0.0], np.linspace(5, 10, 199)])
    reqs = build_requests(arrivals, [500] * 200, [200] * 200, rng, mix)
    done, metrics = run_one(reqs, QLMPolicy, _cluster(models, instances=2), router=make_router("least-wait"))
    served = Counter(r.instance for r in done)
    assert len(served) == 2 and min(served.values()) >= 50, served
    assert all(r.finished_at is not None for r in done)
    assert metrics["swaps"] <= len(models), metrics["swaps"]


def test_new_groups_join_after_their_model_and_save_swaps() -> None:
    vq = VirtualQueue("q")
    groups = [RequestGroup(i, GroupKey(m, "batch"), limit=1) for i, m in enumerate("aba")]
    for i, g in enumerate(groups[:2]):
        g.add(_req(i))
        vq.append(g)
    groups[2].add(_req(2))
    vq.insert_after_model(groups[2])
    assert [g.id for g in vq] == [0, 2, 1]
    # Interleaved arrivals of two models on one instance, many small groups: appended at the tail
    # they alternate models and the instance swaps at almost every group.
    rng = np.random.default_rng(4)
    mix = Mix(classes=((BATCH, 1.0),), models=(("a", 1.0), ("b", 1.0)))
    reqs = build_requests(np.linspace(0, 20, 200), [200] * 200, [100] * 200, rng, mix)
    swaps = {}
    for where in ("tail", "after-model"):
        _, m = run_one(
            reqs,
            lambda where=where: QLMPolicy(new_group=where, delta_rg=0.1),
            _cluster(("a", "b"), max_batch=8),
        )
        swaps[where] = m["swaps"]
    assert swaps["after-model"] * 2 < swaps["tail"], swaps


def test_batched_swapping_serves_a_model_queue_before_swapping() -> None:
    # Interleaved arrivals of three models: per-request FCFS swaps at almost every request, the
    # per-model queues once per model and round (and at least once per waiting model).
    rng = np.random.default_rng(2)
    models = ("a", "b", "c")
    mix = Mix(classes=((BATCH, 1.0),), models=tuple((m, 1.0) for m in models))
    reqs = build_requests(np.linspace(0, 5, 150), [100] * 150, [100] * 150, rng, mix)
    cluster = _cluster(models, instances=1)
    _, naive = run_one(reqs, SwapFCFS, cluster)
    done, batched = run_one(reqs, lambda: SwapBatched(max_wait_s=1e9), cluster)
    assert len(models) <= batched["swaps"] <= 2 * len(models)
    assert naive["swaps"] > 5 * batched["swaps"]
    assert all(r.finished_at is not None for r in done)
    # A bound on the wait: another model's request waiting max_wait_s forces a swap sooner.
    _, eager = run_one(reqs, lambda: SwapBatched(max_wait_s=0.0), cluster)
    assert eager["swaps"] > batched["swaps"]


class _PrepareFirst:
    """Drives a policy as the worker does: ``prepare``'s work (run inline here) before every
    ``schedule``; counts the solves that went that way."""

    def __init__(self, inner: QLMPolicy) -> None:
        self.inner = inner
        self.works = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def schedule(self, view: InstanceView) -> Decision:
        work = self.inner.prepare(view)
        if work is not None:
            work()
            self.works += 1
        return self.inner.schedule(view)


def test_milp_solved_ahead_of_the_decision_is_installed_and_meets_the_slo() -> None:
    """The worker's path: the MILP runs in ``prepare``'s work (off the event loop there) and the
    next ``schedule`` installs its plan; no solve happens inside ``schedule``."""
    rng = np.random.default_rng(1)
    batch = build_requests(
        np.zeros(200), [200] * 200, [400] * 200, rng, Mix(classes=((BATCH, 1.0),)), prefix="b"
    )
    inter = build_requests(
        np.full(8, 2.0), [100] * 8, [50] * 8, rng, Mix(classes=((INTER, 1.0),)), prefix="i"
    )
    made: list[_PrepareFirst] = []

    def factory() -> _PrepareFirst:
        made.append(_PrepareFirst(QLMPolicy(eviction=False)))
        return made[-1]

    reqs, _ = run_one(batch + inter, factory, _cluster())  # type: ignore[arg-type]
    assert max(r.first_token_at - r.arrival for r in reqs if r.id.startswith("i")) < 20.0
    (policy,) = made
    assert policy.works >= 1
    assert policy.inner.counters["solves"] == policy.works  # every plan came from prepare's work


def test_completion_deadline_groups_are_checked_to_their_last_members_completion() -> None:
    # A batch class's deadline is on completion, an interactive one's on the first token; the group
    # knows which, and its costs measure the span that SLO measures.
    assert _group_of(BATCH).slo_at_completion and not _group_of(INTER).slo_at_completion
    stats = TokenStats(mu_in=100, mu_out=100, var_out=0)
    rates = EngineRates(PROFILE, max_batch=64)
    batch = group_costs([100] * 4, stats, rates, 0.0, max_tokens=1000, context_len=4096, to_completion=True)
    first = group_costs([100] * 4, stats, rates, 0.0, max_tokens=1000, context_len=4096)
    assert first.slo_span == pytest.approx(first.last_wait + first.prefill)
    # The last member's 1000 capped tokens at the iteration time of a full batch, prefills included:
    # B = 10000 / 200 = 50 requests share T = 0.12 + 99 * 0.01 / 50 s per 100 tokens.
    iteration = 50 * (0.12 + 99 * 0.01 / 50) / 100
    assert rates.iteration_time(stats) == pytest.approx(iteration)
    assert batch.slo_span == pytest.approx(first.slo_span + 1000 * iteration)
    # Slack between the last member's first token and its completion: the first tokens are in time,
    # the completion is not, so the check must flag the batch group and not the first-token one.
    slack = (first.slo_span + batch.slo_span) / 2
    assert first_violation([QueuedGroup("m", batch, slack)], "m", 0.0, 0.0, tail_aware=True) == 0
    assert first_violation([QueuedGroup("m", first, slack)], "m", 0.0, 0.0, tail_aware=True) is None


def test_milp_orders_by_completion_deadlines() -> None:
    # Group 0 (batch) completes 30 s after its start, its first tokens 10 s after; its slack is 32.
    # Shortest drain first (group 1, then group 0) would start it at 5: first tokens at 15, in time,
    # completion at 35, late. Only group 0 first meets every SLO.
    late_if_second = GroupCosts(10, 9, 30, 1, slo_decode=20)
    short = GroupCosts(5, 4, 8, 1)
    queues = [QueueSpec("q", "m")]
    groups = [GroupSpec(0, "m", 32.0, {"q": late_if_second}), GroupSpec(1, "m", 100.0, {"q": short})]
    assert evaluate({"q": [1, 0]}, groups, queues) == (pytest.approx(5.0), False)
    plan = solve(groups, queues, SolverSettings(time_limit_s=10))
    assert plan.order["q"] == [0, 1]
    assert heuristic_plan(groups, queues).order["q"] == [0, 1]


def test_fallback_keeps_models_together_when_it_leaves_fewer_groups_late() -> None:
    # No order meets every SLO. EDF alternates the two models by slack and pays the 20 s swap at each
    # change (3 groups late); the heuristic's block per model swaps once (2 late). "fewest-late" takes
    # the heuristic order, "edf" keeps QLM's EDF.
    costs = GroupCosts(5, 4, 5, 1)
    queues = [QueueSpec("q", "a", swap_s=20.0)]
    groups = [
        GroupSpec(i, m, slack, {"q": costs})
        for i, (m, slack) in enumerate(zip("abab", (10, 11, 12, 13), strict=True))
    ]
    assert not evaluate(heuristic_plan(groups, queues).order, groups, queues)[1]
    edf = solve(groups, queues, SolverSettings(time_limit_s=10, fallback="edf"))
    assert edf.status.startswith("edf") and edf.order["q"] == [0, 1, 2, 3]
    fewest = solve(groups, queues, SolverSettings(time_limit_s=10))
    assert fewest.status == edf.status
    assert [groups[i].model for i in fewest.order["q"]] == ["a", "a", "b", "b"]
    assert "2 groups late where EDF leaves 3" in fewest.notes[-1]
    with pytest.raises(ValueError, match="fallback"):
        SolverSettings(fallback="fifo")  # type: ignore[arg-type]


def test_estimates_use_the_batch_the_engine_ran() -> None:
    # Eq. 16 charges every request its whole answer of KV (2100 tokens: a batch of 200), while the
    # engine admits on the KV in use, prompts plus the tokens generated so far, and runs a larger batch.
    rng = np.random.default_rng(5)
    reqs = build_requests(np.zeros(800), [100] * 800, [2000] * 800, rng, Mix(classes=((BATCH, 1.0),)))
    made: dict[str, QLMPolicy] = {}

    def policy(kind: str) -> QLMPolicy:
        made[kind] = QLMPolicy(batch_estimate=kind, eps_window_s=2.0)  # type: ignore[arg-type]
        return made[kind]

    for kind in ("measured", "eq16"):
        run_one(reqs, lambda kind=kind: policy(kind), _cluster(max_batch=512))
    measured, eq16 = made["measured"].rates, made["eq16"].rates
    assert eq16 is not None and eq16.measured_batch is None
    assert measured is not None and measured.measured_batch is not None
    stats = next(iter(made["measured"].stats.values()))
    assert measured.measured_batch > 1.1 * measured.kv_batch(stats)  # 233 against 202
    assert measured.batch_for(stats) == pytest.approx(measured.measured_batch)
    assert eq16.batch_for(stats) == eq16.kv_batch(stats)


def test_fallback_lets_a_doomed_group_wait_under_overload() -> None:
    # One model, no order meets every SLO: EDF serves the group that is late anyway first and makes
    # both others late (3 late); the heuristic order serves the two that can still make it (1 late).
    queues = [QueueSpec("q", "a")]
    short = GroupCosts(5, 4, 5, 1)
    groups = [
        GroupSpec(0, "a", 5.0, {"q": GroupCosts(10, 9, 10, 1)}),
        GroupSpec(1, "a", 12.0, {"q": short}),
        GroupSpec(2, "a", 13.0, {"q": short}),
    ]
    assert solve(groups, queues, SolverSettings(fallback="edf")).order["q"] == [0, 1, 2]
    plan = solve(groups, queues, SolverSettings())
    assert plan.order["q"][-1] == 0 and "1 groups late where EDF leaves 3" in plan.notes[-1]


def _group_of(cls: ServiceClass) -> RequestGroup:
    group = RequestGroup(0, GroupKey("m", cls.name), limit=4)
    group.add(_req(0, cls=cls))
    return group
