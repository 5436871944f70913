"""Co-resident simulated instances (sim.coresident): one engine per model with its own KV share, run
side by side at the co-resident cost; hand-computed step times, per-engine admission and KV limits."""

from __future__ import annotations

import pytest

from tessera.core.baselines import FCFS
from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.profile import StepProfile
from tessera.core.request import Request
from tessera.core.sharing import CoResidentCost
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.coresident import CoResidentInstance
from tessera.sim.engine import EngineConfig, SimInstance

A = StepProfile("a", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=16_000, block_size=16)
B = StepProfile("b", 0.02, 0.002, 0.0002, 0.2, 0.002, kv_capacity_tokens=3_200, block_size=32)
COST = CoResidentCost((0.75,), source="test")


class RunAll(Policy):
    """Every request it holds, in arrival order (the engine admits what fits)."""

    name = "run-all"

    def __init__(self) -> None:
        self.queue: list[Request] = []
        self.views: list[InstanceView] = []

    def add(self, req: Request, now: float) -> None:
        self.queue.append(req)

    def remove(self, req: Request, now: float) -> None:
        self.queue.remove(req)

    def schedule(self, view: InstanceView) -> Decision:
        self.views.append(view)
        return Decision(run=list(self.queue))

    def __len__(self) -> int:
        return len(self.queue)


def co_resident(policy: Policy, **engine) -> CoResidentInstance:
    config = EngineConfig(co_resident=True, coresident_cost=COST, chunked_prefill=True, **engine)
    return CoResidentInstance("i0", {"a": A, "b": B}, policy, config)


def drain(inst: SimInstance, reqs: list[Request]) -> None:
    for r in reqs:
        inst.add(r, r.arrival)
    while inst.seg is not None:
        inst.advance()


def test_one_busy_engine_runs_at_its_own_speed_as_a_single_model_instance():
    alone = [Request("x", 0.0, 40, 9, model="a", true_output_tokens=6)]
    shared = [Request("x", 0.0, 40, 9, model="a", true_output_tokens=6)]
    drain(SimInstance("s", {"a": A}, RunAll(), EngineConfig(chunked_prefill=True)), alone)
    drain(co_resident(RunAll()), shared)
    assert shared[0].tokens.times() == pytest.approx(alone[0].tokens.times())


def test_busy_engines_share_the_accelerator_at_the_co_resident_cost():
    """Two requests, one per model, arrive together: each iteration is one step of both engines, at
    0.75 x the sum of their step times (the mixed first iteration: each engine's prefill-only step)."""
    reqs = [
        Request("a0", 0.0, 31, 9, model="a", true_output_tokens=3),
        Request("b0", 0.0, 63, 9, model="b", true_output_tokens=3),
    ]
    drain(co_resident(RunAll()), reqs)
    t1 = 0.75 * (A.prefill(31) + B.prefill(63))
    step2 = 0.75 * (A.decode_step(1, 32) + B.decode_step(1, 64))
    step3 = 0.75 * (A.decode_step(1, 33) + B.decode_step(1, 65))
    for r in reqs:
        assert r.tokens.times() == pytest.approx([t1, t1 + step2, t1 + step2 + step3])


def test_each_engine_admits_head_of_line_within_its_own_kv_share():
    """b's engine holds 100 blocks of 32 tokens: its first request takes 63 of them, the second (63 more)
    does not fit and stops b's engine, while a's request behind both is admitted into a's own share."""
    policy = RunAll()
    inst = co_resident(policy, watermark=0.0)
    reqs = [
        Request("b0", 0.0, 2000, 10, model="b", true_output_tokens=5),
        Request("b1", 0.0, 2000, 10, model="b", true_output_tokens=5),
        Request("a0", 0.0, 100, 10, model="a", true_output_tokens=5),
    ]
    for r in reqs:
        inst.add(r, 0.0)
    inst.advance()  # the decision at t=0
    assert [r.id for r in inst.running] == ["b0", "a0"]
    view = inst.view(inst.now)
    assert view.active_model is None and view.prefill_budget_tokens is None
    assert set(view.models) == {"a", "b"}
    assert view.models["b"].kv_capacity_tokens == 3_200
    assert view.models["b"].kv_used_tokens == 63 * 32
    assert view.models["a"].kv_used_tokens == 7 * 16
    assert (view.models["a"].running, view.models["b"].running) == (1, 1)
    assert view.kv_capacity_tokens == 16_000 + 3_200
    assert view.kv_used_tokens == 63 * 32 + 7 * 16
    while inst.seg is not None:
        inst.advance()
    assert all(r.finished for r in reqs)
    assert reqs[1].first_scheduled_at >= reqs[0].finished_at  # waited for b's share, not a's


def test_an_engines_sequence_limit_holds_under_the_instances_batch_cap():
    inst = co_resident(RunAll(), max_running=1, max_batch=8)
    for i in range(3):
        inst.add(Request(f"b{i}", 0.0, 10, 5, model="b", true_output_tokens=2), 0.0)
        inst.add(Request(f"a{i}", 0.0, 10, 5, model="a", true_output_tokens=2), 0.0)
    inst.advance()
    assert sorted(r.id for r in inst.running) == ["a0", "b0"]
    assert inst.view(inst.now).models["a"].max_running == 1


def test_kv_exhaustion_preempts_on_the_engine_that_ran_out_only():
    """b's engine (100 blocks) fills up with two long decodes; its later request is preempted, a's
    request keeps running."""
    inst = co_resident(RunAll(), watermark=0.0)
    reqs = [
        Request("b0", 0.0, 1500, 1700, model="b", true_output_tokens=1600),
        Request("b1", 0.0, 1500, 1700, model="b", true_output_tokens=1600),
        Request("a0", 0.0, 100, 3000, model="a", true_output_tokens=3000),
    ]
    drain(inst, reqs)
    assert all(r.finished for r in reqs)
    assert reqs[1].preemptions >= 1 and reqs[0].preemptions == 0 and reqs[2].preemptions == 0
    assert inst.engine_used == {"a": 0, "b": 0}


def test_the_cluster_builds_co_resident_instances_for_several_models_only():
    config = EngineConfig(co_resident=True, chunked_prefill=True)
    cluster = Cluster(ClusterConfig({"a": A, "b": B}, 0, config), FCFS)
    both = cluster.add_instance(models=["a", "b"], cold=False)
    one = cluster.add_instance(models=["a"], cold=False)
    assert type(both) is CoResidentInstance and type(one) is SimInstance
    reqs = [
        Request(f"{m}{i}", 0.05 * i, 50, 20, model=m, true_output_tokens=10)
        for i in range(6)
        for m in ("a", "b")
    ]
    result = cluster.run(reqs)
    assert all(r.finished for r in reqs) and result.model_swaps == 0
    assert both.engine_seconds["a"] > 0 and both.engine_seconds["b"] > 0


def test_co_resident_refuses_a_shared_kv_pool_and_prefix_caching():
    with pytest.raises(ValueError, match="shared_kv"):
        EngineConfig(co_resident=True, shared_kv=True)
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(co_resident=True, prefix_caching=True)
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig(max_running=0)
