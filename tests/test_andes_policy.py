"""Andes' scheduler (spec §B.5-B.7) on hand-built instance views."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessera.core import InstanceView, Phase, Request, ServiceClass, StepProfile
from tessera.core.policies.qoe import AndesQoE, exact_pack, greedy_pack
from tessera.core.registry import make_policy

CLS = ServiceClass(name="chat", reading_speed_tps=5.0, ttft_target_s=1.0)


def profile(
    kv: int = 1000, c0: float = 0.02, c1: float = 0.0, p1: float = 0.0, block: int = 1
) -> StepProfile:
    return StepProfile("t", c0, c1, 0.0, 0.0, p1, kv_capacity_tokens=kv, block_size=block)


def request(rid: str, arrival: float, prompt: int, cls: ServiceClass = CLS) -> Request:
    return Request(rid, arrival, prompt, 100_000, service_class=cls)


def run(req: Request, first: float, count: int, interval: float) -> Request:
    """Mark ``req`` running with ``count`` tokens delivered from ``first`` every ``interval`` s."""
    req.tokens.append_run(first, count, interval)
    req.generated = count
    req.phase = Phase.RUNNING
    req.kv_resident = True
    return req


def view(running: list[Request], now: float, prof: StepProfile, max_batch: int = 64) -> InstanceView:
    used = sum(r.prompt_tokens + r.generated + 1 for r in running)
    return InstanceView(now, "i0", running, max_batch, prof.kv_capacity_tokens, used, prof)


def test_registered_and_settings_validated() -> None:
    assert isinstance(make_policy("qoe"), AndesQoE)
    assert make_policy("qoe").horizon_s == 10.0  # spec default Δt
    for bad, match in [
        ({"horizon_s": 0}, "horizon_s"),
        ({"kv_watermark": 1.5}, "kv_watermark"),
        ({"solver": "greedy"}, "unknown setting 'solver'"),  # an ablation: constructor keyword only
        ({"preemption": "drop"}, "preemption"),
        ({"quantum_iterations": 0}, "quantum_iterations"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_policy("qoe", **bad)
    with pytest.raises(ValueError, match="solver must be one of greedy, lqsf, dp"):
        AndesQoE(solver="milp")  # type: ignore[arg-type]


def test_untriggered_behaves_like_fcfs_without_preemption() -> None:
    prof = profile(kv=100_000)
    pol = AndesQoE()
    a = run(request("a", 0.0, 100), 0.5, 5, 0.02)
    b, c = request("b", 2.0, 100), request("c", 1.0, 100)
    for r in (a, b, c):
        pol.add(r, 2.0)
    d = pol.schedule(view([a], 2.0, prof))
    assert [r.id for r in d.run] == ["a", "c", "b"]  # running, then arrival order
    assert d.recheck_after_tokens == 10  # the scheduling quantum
    assert pol.solves == 0


def test_memory_pressure_preempts_the_buffered_long_request_for_new_ones() -> None:
    # Paper Fig. 8: R1 holds the most memory and has buffered tokens far ahead of its reader,
    # so it is preempted to admit the newcomers; with zero overheads the refiner agrees.
    prof = profile(kv=1000)
    pol = AndesQoE(preemption_cap="none")
    now = 20.0
    r1 = run(request("r1", 0.0, 700), 1.0, 200, 0.02)  # 200 tokens = 40 s of reading buffered
    r2 = run(request("r2", 15.0, 100), 16.0, 20, 0.05)
    newcomers = [request(f"n{i}", 19.0, 120) for i in range(2)]
    for r in (r1, r2, *newcomers):
        pol.add(r, now)
    d = pol.schedule(view([r1, r2], now, prof))
    assert pol.solves == 1
    ids = [r.id for r in d.run]
    assert "r1" not in ids and "r2" in ids
    assert {"n0", "n1"} <= set(ids)


def test_refiner_cancels_admission_whose_stall_costs_more_than_it_gains() -> None:
    # The running requests have no buffer (each token is read as it arrives); admitting the
    # newcomer needs a 60 s prefill stall, which would cost them far more than it gains.
    prof = profile(kv=1000, p1=0.5)
    now = 30.0
    running = [run(request(f"r{i}", 0.0, 100), 1.0, 146, 0.2) for i in range(4)]  # on the ideal pace
    newcomer = request("n", 29.0, 120)
    with_refiner, without = AndesQoE(), AndesQoE(refiner=False)
    for pol in (with_refiner, without):
        for r in (*running, newcomer):
            pol.add(r, now)
    kept = with_refiner.schedule(view(running, now, prof, max_batch=4))
    assert [r.id for r in kept.run] == [r.id for r in running]
    greedy = without.schedule(view(running, now, prof, max_batch=4))
    assert "n" in [r.id for r in greedy.run]  # what the refiner overruled


def test_zero_overhead_refiner_accepts_every_greedy_decision() -> None:
    rng = np.random.default_rng(0)
    prof = profile(kv=2000)
    for _ in range(30):
        now = 50.0
        running = []
        for i in range(int(rng.integers(2, 8))):
            n = int(rng.integers(1, 150))
            running.append(run(request(f"r{i}", float(rng.uniform(0, 40)), int(rng.integers(50, 300))),
                               float(rng.uniform(40, 45)), n, float(rng.uniform(0.01, 0.05))))  # fmt: skip
        waiting = [request(f"w{i}", float(rng.uniform(40, 50)), int(rng.integers(50, 400))) for i in range(5)]
        a, b = AndesQoE(preemption_cap="none"), AndesQoE(refiner=False, preemption_cap="none")
        for pol in (a, b):
            for r in (*running, *waiting):
                pol.add(r, now)
        v = InstanceView(now, "i0", running, 8, prof.kv_capacity_tokens, 1900, prof)  # over the watermark
        assert {r.id for r in a.schedule(v).run} == {r.id for r in b.schedule(v).run}


def test_compute_bound_trigger() -> None:
    # 40 running at 0.02 + 0.005·B s per token = 0.22 s > 1/5 s: slower than the readers need
    prof = profile(kv=100_000, c0=0.02, c1=0.005)
    pol = AndesQoE()
    running = [run(request(f"r{i}", 0.0, 10), 1.0, 10, 0.2) for i in range(40)]
    waiting = request("w", 4.0, 10)
    for r in (*running, waiting):
        pol.add(r, 4.0)
    pol.schedule(view(running, 4.0, prof))
    assert pol.solves == 1
    fast = AndesQoE()
    for r in (*running[:10], waiting):
        fast.add(r, 4.0)
    fast.schedule(view(running[:10], 4.0, prof))
    assert fast.solves == 0


def test_batch_size_search_bounds() -> None:
    # TGL(B) = 0.02 + 0.01·B; fastest reader 5 tok/s -> B_min = floor((0.2-0.02)/0.01) = 18.
    prof = profile(kv=10_000, c0=0.02, c1=0.01)
    pol = AndesQoE(batch_grid_span=1000)
    reqs = [request(f"w{i}", 0.0, 99) for i in range(60)]  # l = 100 each -> B_max = 99 capped at 60 reqs
    for r in reqs:
        pol.add(r, 1.0)
    waiting = pol._table.active[: pol._table.size].copy()
    st = pol._gather(view([], 1.0, prof), np.empty(0, dtype=int), waiting)
    sizes = pol._batch_sizes(view([], 1.0, prof, max_batch=50), st, 10_000.0, 99.0)
    assert sizes[0] == 18 and sizes[-1] == 50  # B_max: 100 fit in memory, capped by max_batch
    grid = AndesQoE(batch_grid_span=4, batch_grid_points=5)._batch_sizes(
        view([], 1.0, prof, max_batch=50), st, 10_000.0, 99.0
    )
    assert grid[0] == 18 and grid[-1] == 50 and len(grid) <= 7


def brute_force(q: np.ndarray, w: np.ndarray, cap: int, batch: int) -> float:
    best = -np.inf
    for combo in itertools.combinations(range(q.size), batch):
        if w[list(combo)].sum() <= cap:
            best = max(best, float(q[list(combo)].sum()))
    return best


def test_exact_solver_matches_brute_force_and_bounds_greedy() -> None:
    rng = np.random.default_rng(7)
    ratios = []
    for case in range(120):
        n = int(rng.integers(2, 11)) if case < 60 else int(rng.integers(10, 31))
        cap = int(rng.integers(50, 501))
        q = rng.uniform(0, 1, n) * (rng.random(n) < 0.8)
        w = rng.integers(5, 120, n).astype(float)
        best_dp, best_greedy = -np.inf, 0.0
        for batch in range(1, n + 1):
            value, sel = exact_pack(q, w, cap, batch)
            if case < 60:
                assert value == pytest.approx(brute_force(q, w, cap, batch))
            if value > -np.inf:
                assert len(sel) == batch and w[sel].sum() <= cap
                assert q[sel].sum() == pytest.approx(value)
            best_dp = max(best_dp, value)
            g = greedy_pack(q / w, w, cap, batch)
            assert len(g) <= batch and w[g].sum() <= cap
            best_greedy = max(best_greedy, float(q[g].sum()))
        assert best_dp >= best_greedy - 1e-9
        if best_dp > 0:
            ratios.append(best_greedy / best_dp)
    assert np.mean(ratios) >= 0.85  # spec Q2


def test_greedy_stops_at_first_misfit() -> None:
    # Alg. 1 breaks at the first item that does not fit rather than skipping ahead
    sel = greedy_pack(np.array([3.0, 2.0, 1.0]), np.array([5.0, 10.0, 1.0]), 10.0, 3)
    assert sel.tolist() == [0]


@pytest.mark.parametrize(("kv", "expected"), [(500, {"r", "w"}), (400, {"w"})])
def test_dp_policy_runs_on_small_case(kv: int, expected: set[str]) -> None:
    # r (l = 351) has 50 tokens buffered, to 11 s of reading; w (l = 51) waits. Both fit in 500;
    # in 400 the exact solver serves w and lets r's buffer carry it.
    prof = profile(kv=kv)
    pol = AndesQoE(solver="dp", preemption_cap="none")
    running = [run(request("r", 0.0, 300), 1.0, 50, 0.02)]
    waiting = [request("w", 9.0, 50)]
    for r in (*running, *waiting):
        pol.add(r, 10.0)
    d = pol.schedule(InstanceView(10.0, "i0", running, 8, kv, kv - 10, prof))
    assert {r.id for r in d.run} == expected


def memory_pressure_case(cap: str, newcomer_arrival: float) -> set[str]:
    """The Fig. 8 case of the test above, under a preemption cap setting."""
    prof = profile(kv=1000)
    pol = AndesQoE(preemption_cap=cap)  # type: ignore[arg-type]
    r1 = run(request("r1", 0.0, 700), 1.0, 200, 0.02)
    r2 = run(request("r2", 15.0, 100), 16.0, 20, 0.05)
    newcomers = [request(f"n{i}", newcomer_arrival, 120) for i in range(2)]
    for r in (r1, r2, *newcomers):
        pol.add(r, 20.0)
    return {r.id for r in pol.schedule(view([r1, r2], 20.0, prof)).run}


def test_refcode_cap_blocks_preemption_when_the_least_slack_is_below_one_overhead() -> None:
    # Newcomers that arrived at 19.0 have slack 19 + 1 - 20 = 0 s: the 10th-percentile slack buys
    # no preemption (REF-CODE cap); arriving at 19.9 they have 0.9 s, which buys several.
    assert "r1" in memory_pressure_case("refcode", 19.0)
    assert "r1" not in memory_pressure_case("refcode", 19.9)
    assert "r1" not in memory_pressure_case("none", 19.0)


def swap_case(swap_free: int | None) -> set[str]:
    """A buffered request must make room for a newcomer; seven young requests run on the ideal
    pace (no buffer), so any stall costs them QoE. The victim's swap-out is the only stall
    (prefill is free in this profile)."""
    prof = StepProfile("t", 0.02, 0.0, 0.0, 0.0, 0.0, kv_capacity_tokens=1100, block_size=1,
                       kv_bytes_per_token=25_000_000, host_link_bytes_per_s=25e9)  # fmt: skip
    pol = AndesQoE(preemption_cap="none", preemption="swap")
    buffered = run(request("b", 0.0, 700), 1.0, 200, 0.02)  # swap-out: 900 tokens x 1 ms = 0.9 s
    tight = [run(request(f"t{i}", 18.0, 10), 19.0, 6, 0.2) for i in range(7)]  # next due at 20.2 s
    newcomer = request("n", 19.5, 150)
    running = [buffered, *tight]
    for r in (*running, newcomer):
        pol.add(r, 20.0)
    used = sum(r.prompt_tokens + r.generated + 1 for r in running)
    v = InstanceView(20.0, "i0", running, 9, 1100, used, prof, swap_free_tokens=swap_free)
    return {r.id for r in pol.schedule(v).run} - {r.id for r in tight}


def test_preemption_priced_as_recompute_once_swap_space_is_full() -> None:
    # With swap room the 0.9 s swap-out stalls "t" and the refiner refuses; without room the engine
    # would recompute (no stall now), so the admission goes ahead.
    assert swap_case(swap_free=10_000) == {"b"}
    assert swap_case(swap_free=100) == {"n"}


def test_admissions_stop_at_the_prefill_budget() -> None:
    # Plenty of KV and slots, but the engine prefills at most 300 tokens per iteration (the first
    # request always starts): the decision proposes no more than that.
    prof = profile(kv=10_000)
    pol = AndesQoE(preemption_cap="none", kv_watermark=0.01)
    running = [run(request("r", 0.0, 100), 1.0, 10, 0.02)]
    waiting = [request(f"w{i}", 9.0 + i / 10, 200) for i in range(4)]
    for r in (*running, *waiting):
        pol.add(r, 10.0)
    v = InstanceView(10.0, "i0", running, 8, 10_000, 9_000, prof, prefill_budget_tokens=300)
    d = pol.schedule(v)
    assert pol.solves == 1
    assert len([r for r in d.run if r.id.startswith("w")]) == 1


def test_kept_arrays_match_a_fresh_policy_after_the_engine_moves_on() -> None:
    # Decisions refresh only requests that ran or were proposed; a fresh policy reads everything.
    prof = profile(kv=100_000)
    pol = AndesQoE()
    reqs = [request(f"q{i}", float(i), 50 + i) for i in range(6)]
    for r in reqs:
        pol.add(r, 6.0)
    pol.schedule(view([], 6.0, prof, max_batch=3))
    for r in reqs[:3]:  # the engine admitted three and decoded them
        run(r, 7.0, 20, 0.05)
    pol.schedule(view(reqs[:3], 8.0, prof, max_batch=3))
    reqs[0].phase, reqs[0].kv_resident = Phase.PREEMPTED, False  # preempted by the engine
    pol.schedule(view(reqs[1:3], 9.0, prof, max_batch=3))
    fresh = AndesQoE()
    for r in reqs:
        fresh.add(r, 9.0)
    a, b = pol._table, fresh._table
    for r in reqs:
        i, j = a.slot[id(r)], b.slot[id(r)]
        for column in ("delivered", "last_consumption", "resident", "swapped", "ideal_start", "prompt"):
            assert getattr(a, column)[i] == getattr(b, column)[j], (r.id, column)


def test_observed_latency_triggers_when_stalls_slow_the_tokens() -> None:
    # The profile says 20 ms per token, but the running requests got one token per second
    # (prefill stalls): the observed trigger fires, the profile trigger does not.
    prof = profile(kv=100_000)
    fired = {}
    for mode in ("observed", "profile"):
        pol = AndesQoE(trigger_latency=mode)  # type: ignore[arg-type]
        r = run(request("r", 0.0, 10), 1.0, 5, 0.02)
        w = request("w", 0.5, 10)
        for x in (r, w):
            pol.add(x, 1.0)
        pol.schedule(view([r], 2.0, prof))
        r.tokens.append_run(4.5, 2, 1.0)
        r.generated = 7
        pol.schedule(view([r], 6.0, prof))
        fired[mode] = pol.solves
    assert fired == {"observed": 1, "profile": 0}


def test_mean_tds_is_the_per_request_speed_averaged() -> None:
    from tessera.bench.scenarios.andes import mean_tds

    fast = run(request("f", 0.0, 10), 1.0, 11, 0.1)  # 10 tokens over 1 s: 10 tok/s
    slow = run(request("s", 0.0, 10), 1.0, 3, 1.0)  # 2 tokens over 2 s: 1 tok/s
    single = run(request("o", 0.0, 10), 1.0, 1, 0.0)  # one token: no speed
    assert mean_tds([fast, slow, single]) == pytest.approx(5.5)  # not 1 / mean ITL (= 1.82)


def waste_case(charge_waste: bool) -> set[str]:
    """Fig. 8 again, but resuming the buffered victim r1 later costs a 8.5 s re-prefill, and ten
    large requests wait far past their TTFT target (too big to be picked). The running r2 has
    8 s of tokens buffered, so the newcomer's 1.2 s prefill stall costs the running set nothing."""
    prof = profile(kv=1000, p1=0.01)
    pol = AndesQoE(preemption_cap="none", preemption="recompute", refiner_waste_loss=charge_waste)
    r1 = run(request("r1", 0.0, 650), 1.0, 200, 0.02)  # l = 851, 40 s of reading buffered
    r2 = run(request("r2", 15.0, 40), 16.0, 60, 0.02)  # consumed until 28 s
    newcomer = request("n", 19.0, 120)
    crowd = [request(f"c{i}", 0.0, 800) for i in range(10)]
    for r in (r1, r2, newcomer, *crowd):
        pol.add(r, 20.0)
    return {r.id for r in pol.schedule(view([r1, r2], 20.0, prof)).run}


def test_refiner_charges_wasted_work_to_the_waiting_requests() -> None:
    # Without the charge the swap of r1 for the newcomer looks free (nobody running stalls); with
    # it, the 8.5 s of re-prefill delays ten late waiting requests by more than the admission gains.
    assert waste_case(charge_waste=False) == {"n", "r2"}
    assert waste_case(charge_waste=True) == {"r1", "r2"}
