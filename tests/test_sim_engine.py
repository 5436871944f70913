"""Simulator engine: hand-computed cases, conservation, KV limits, closed form vs step by step."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.core.baselines import FCFS, SRTFOracle
from tessera.core.policy import Decision, InstanceView
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Phase, Request
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.engine import EngineConfig, SimInstance, blocks_for
from tessera.sim.workloads import build_requests, copy_requests, poisson_arrivals

PROF = StepProfile(
    "hand", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=16_000, block_size=16, weights_bytes=10**9
)


def simulate(reqs, policy="fcfs", profile=PROF, instances=1, **engine):
    cfg = ClusterConfig({"default": profile}, instances, EngineConfig(**engine))
    factory = policy if callable(policy) else (lambda: make_policy(policy))
    return Cluster(cfg, factory).run(reqs)


def test_three_requests_hand_computed():
    reqs = [
        Request(f"r{i}", 0.0, p, 100, true_output_tokens=n)
        for i, (p, n) in enumerate([(10, 3), (20, 5), (30, 2)])
    ]
    simulate(reqs, max_batch=8)
    # One prefill of 60 tokens: 0.1 + 0.06; decode steps c0 + c1*B + c2*S with S the batch's context.
    t_prefill = 0.16
    t1 = t_prefill + 0.01 + 0.003 + 0.0001 * 63  # B=3, S=11+21+31
    t2 = t1 + 0.01 + 0.002 + 0.0001 * 34  # r2 done; B=2, S=12+22
    t3 = t2 + 0.01 + 0.001 + 0.0001 * 23
    t4 = t3 + 0.01 + 0.001 + 0.0001 * 24
    assert [r.first_token_at for r in reqs] == pytest.approx([t_prefill] * 3)
    assert [r.finished_at for r in reqs] == pytest.approx([t2, t4, t1])
    assert reqs[1].tokens.times() == pytest.approx([t_prefill, t1, t2, t3, t4])


def test_batch_limit_one_serialises_in_arrival_order():
    reqs = [Request(f"r{i}", 0.001 * i, 10, 100, true_output_tokens=2) for i in range(3)]
    simulate(reqs, max_batch=1)
    prefill = 0.1 + 0.01
    step = 0.01 + 0.001 + 0.0001 * 11
    ends = [prefill + step, 2 * (prefill + step), 3 * (prefill + step)]
    assert [r.finished_at for r in reqs] == pytest.approx(ends)


def random_requests(seed, n=60, rate=20.0, max_out=120):
    rng = np.random.default_rng(seed)
    arr = poisson_arrivals(n, rate, rng)
    return build_requests(arr, rng.integers(1, 300, n), rng.integers(1, max_out, n), rng)


class StepByStep(FCFS):
    """FCFS that asks to be called after every decode iteration: the engine never runs k > 1."""

    name = "fcfs-step"

    def schedule(self, view: InstanceView) -> Decision:
        d = super().schedule(view)
        d.recheck_after_tokens = 1
        return d


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("chunked", [False, True])
def test_closed_form_runs_equal_iterating(seed, chunked):
    small = StepProfile("s", 0.01, 0.002, 3e-5, 0.02, 2e-4, kv_capacity_tokens=4000, block_size=16)
    base = random_requests(seed)
    a, b = copy_requests(base), copy_requests(base)
    simulate(a, FCFS, small, max_batch=8, chunked_prefill=chunked)
    simulate(b, StepByStep, small, max_batch=8, chunked_prefill=chunked)
    for x, y in zip(a, b, strict=True):
        assert x.tokens.times() == pytest.approx(y.tokens.times(), rel=1e-9, abs=1e-9)
        assert x.preemptions == y.preemptions


class Checked(SimInstance):
    """An instance that checks the KV invariant after every segment."""

    def advance(self) -> None:
        super().advance()
        resident = self.running + self.paused_kv
        held = sum(blocks_for(r.prompt_tokens + r.generated, self.block) for r in resident)
        assert self.used_blocks == held
        assert self.used_blocks <= self.capacity_blocks
        assert len(self.running) <= self.max_batch


@pytest.mark.parametrize("policy", ["fcfs", "srtf-oracle"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_kv_never_exceeded_and_conservation(monkeypatch, policy, mode):
    import tessera.sim.cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "SimInstance", Checked)
    tight = StepProfile("t", 0.01, 0.001, 1e-5, 0.02, 1e-4, kv_capacity_tokens=1600, block_size=16)
    reqs = random_requests(7, n=80, rate=50.0, max_out=200)
    finished: list[str] = []
    result = simulate(reqs, policy, tight, instances=2, max_batch=16, preempt_mode=mode)
    for r in reqs:
        finished.append(r.id)
        assert r.phase is Phase.FINISHED
        assert r.generated == r.target_output_tokens == r.tokens.total
        assert np.all(np.diff(r.tokens.times()) >= -1e-12)
        assert r.first_token_at >= r.arrival
    assert len(set(finished)) == len(reqs)
    assert result.preemptions > 0  # the tight cache forced the engine to preempt
    assert sum(r.preemptions for r in reqs) == result.preemptions


def test_swap_mode_swaps_and_keeps_progress():
    tight = StepProfile("t", 0.01, 0.001, 1e-5, 0.02, 1e-4, kv_capacity_tokens=1600, block_size=16)
    reqs = random_requests(3, n=80, rate=50.0, max_out=200)
    result = simulate(reqs, "fcfs", tight, max_batch=16, preempt_mode="swap")
    assert result.kv_swaps > 0
    assert all(r.generated == r.target_output_tokens for r in reqs)


def test_determinism_for_a_seed():
    a, b = random_requests(11), random_requests(11)
    simulate(a, "srtf-oracle", max_batch=4)
    simulate(b, "srtf-oracle", max_batch=4)
    assert [r.finished_at for r in a] == [r.finished_at for r in b]
    c = random_requests(12)
    simulate(c, "srtf-oracle", max_batch=4)
    assert [r.finished_at for r in a] != [r.finished_at for r in c]


def test_request_too_large_for_kv_is_rejected_clearly():
    reqs = [Request("big", 0.0, 15_990, 100, true_output_tokens=100)]
    with pytest.raises(ValueError, match="big needs"):
        simulate(reqs)


class Swapper(FCFS):
    """Loads the model of the oldest request first (a minimal model-swapping policy)."""

    name = "swapper"

    def schedule(self, view: InstanceView) -> Decision:
        d = super().schedule(view)
        if d.run and d.run[0].model != view.active_model:
            d.load_model = d.run[0].model
        return d


def test_model_swap_costs_weights_over_host_link():
    other = StepProfile(
        "o", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=16_000, weights_bytes=2 * 10**9
    )
    cfg = ClusterConfig({"a": PROF, "b": other}, 1, EngineConfig(max_batch=8))
    reqs = [Request("x", 0.0, 10, 5, model="b", true_output_tokens=1)]
    result = Cluster(cfg, Swapper).run(reqs)
    assert result.model_swaps == 1
    load = other.model_load_time()  # 2 GB / 25 GB/s
    assert reqs[0].first_token_at == pytest.approx(load + 0.1 + 0.01)


def test_srtf_preempts_for_a_shorter_job():
    reqs = [
        Request("long", 0.0, 10, 500, true_output_tokens=500),
        Request("short", 0.5, 10, 5, true_output_tokens=5),
    ]
    simulate(reqs, lambda: SRTFOracle(recheck_tokens=50), max_batch=1)
    assert reqs[1].finished_at < reqs[0].finished_at
    assert reqs[0].preemptions == 1


def test_chunked_prefill_budget_spreads_a_long_prompt():
    reqs = [Request("p", 0.0, 1200, 10, true_output_tokens=1)]
    simulate(reqs, max_batch=4, chunked_prefill=True, token_budget=512)
    # three prefill-only iterations of 512, 512 and 176 tokens
    expected = 3 * 0.1 + 0.001 * 1200
    assert reqs[0].finished_at == pytest.approx(expected)


def test_request_overhead_delays_entry_but_counts_from_arrival():
    """A profile's per-request serving overhead is paid once, before the engine sees the request."""
    from dataclasses import replace

    prof = replace(PROF, request_overhead_s=0.05)
    plain = [Request("a", 0.0, 10, 100, true_output_tokens=3)]
    slow = copy_requests(plain)
    simulate(plain, max_batch=8)
    simulate(slow, profile=prof, max_batch=8)
    assert slow[0].first_token_at - slow[0].arrival == pytest.approx(plain[0].first_token_at + 0.05)
    assert slow[0].finished_at == pytest.approx(plain[0].finished_at + 0.05)
    assert slow[0].arrival == 0.0


@pytest.mark.parametrize("shared_kv", [False, True])
def test_a_policy_blind_to_models_serves_a_co_located_group_model_after_model(shared_kv: bool):
    """FCFS asks for no model swap; on an instance of two models the engine loads the other model once
    the active one has nothing left to run, as the worker's scheduler holding work for a sleeping model
    asks the swapper for it. Before, the instance took no step again and the run never ended."""
    other = StepProfile("o", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=16_000, weights_bytes=10**9)
    cfg = ClusterConfig({"a": PROF, "b": other}, 1, EngineConfig(max_batch=8, shared_kv=shared_kv))
    reqs = [
        Request(f"{m}{i}", 0.01 * i, 10, 5, model=m, true_output_tokens=3)
        for i in range(4)
        for m in ("b", "a")
    ]
    result = Cluster(cfg, FCFS).run(reqs)
    assert all(r.finished for r in reqs)
    assert result.model_swaps >= (0 if shared_kv else 1)  # shared KV: both models stay resident


def test_work_left_on_instances_that_take_no_step_is_a_stall_not_an_endless_run():
    """Requests assigned to an instance whose policy never runs them, with a controller ticking: the run
    ended only when the clock overflowed. It now stops with the instances that hold the work."""
    from tessera.sim.cluster import ClusterController, SimulationStalled

    class Idle(FCFS):
        name = "idle"

        def schedule(self, view: InstanceView) -> Decision:
            return Decision(run=[])

    class Ticks(ClusterController):
        interval_s = 1.0

        def tick(self, view):  # type: ignore[no-untyped-def]
            return []

    cfg = ClusterConfig({"default": PROF}, 1, EngineConfig(max_batch=8))
    reqs = [Request("r", 0.0, 10, 5, true_output_tokens=3)]
    with pytest.raises(SimulationStalled, match=r"instances that take no step: i0 \(1\)"):
        Cluster(cfg, Idle, controller=Ticks()).run(reqs)


class Scripted(FCFS):
    """FCFS's queue with a scripted ``run`` per decision (preempting with ``keep``)."""

    name = "scripted"

    def __init__(self, runs: list[list[Request]]) -> None:
        super().__init__()
        self.runs = runs

    def schedule(self, view: InstanceView) -> Decision:
        return Decision(run=self.runs.pop(0), preempt_mode="keep")


@pytest.mark.parametrize(
    ("d_prompt", "budget", "d_admitted"),
    [
        (50, 64, False),  # D's KV fits once B's is dropped, but C + D exceed the token budget
        (100, 8192, False),  # D's KV does not fit even with B's dropped
        (50, 8192, True),  # D is admitted in B's blocks: B gives way
    ],
)
def test_paused_kv_gives_way_only_to_an_admission_that_happens(d_prompt, budget, d_admitted):
    """A request paused with its KV (B) loses it only when the admission that needs its blocks (D)
    then happens. Before, B's KV was dropped as soon as D's blocks did not fit, and D was then refused
    by the token budget (or still did not fit): B re-prefilled for nothing."""
    small = StepProfile("s", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=160, block_size=16)
    a, b, c = (Request(x, 0.0, p, 100, true_output_tokens=50) for x, p in (("a", 30), ("b", 30), ("c", 40)))
    d = Request("d", 0.0, d_prompt, 100, true_output_tokens=50)
    policy = Scripted([[a, b], [a, c, d]])
    inst = SimInstance("i0", {"default": small}, policy, EngineConfig(watermark=0.0, token_budget=budget))
    for r in (a, b, c, d):
        inst.add(r, 0.0)
    inst.advance()  # decides at 0: a and b prefill (2 blocks each of 10)
    assert inst.running == [a, b] and inst.used_blocks == 4
    inst.advance()  # prefill done; b paused with its KV, c admitted (3 blocks), then d
    assert c in inst.running
    assert (d in inst.running) is d_admitted
    assert b.kv_resident is not d_admitted and (b in inst.paused_kv) is not d_admitted
    held = sum(blocks_for(r.prompt_tokens + r.generated, 16) for r in inst.running + inst.paused_kv)
    assert inst.used_blocks == held <= inst.capacity_blocks
