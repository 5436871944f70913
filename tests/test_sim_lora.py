"""LoRA adapters in the simulator: one engine for a base and its adapters (one KV pool, one batch of at
most ``max_loras`` adapters), an adapter cache whose misses delay the engine by the load, the LoRA step
overhead, and the routing fields the cluster fills for the shared adapter-affinity scorer."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.core.baselines import FCFS
from tessera.core.lora import LoraCost, batch_adapters
from tessera.core.policy import Decision, InstanceView
from tessera.core.profile import StepProfile
from tessera.core.request import Request
from tessera.sim.cluster import Cluster, ClusterConfig, RouteRouter, _adapter_load, _same_engine
from tessera.sim.engine import EngineConfig

PROF = StepProfile(
    "hand", 0.01, 0.001, 0.0001, 0.1, 0.001, kv_capacity_tokens=16_000, block_size=16, weights_bytes=10**9
)
ADAPTERS = {f"a{i}": "base" for i in range(6)}


class Recorder(FCFS):
    """FCFS that keeps every view it was shown."""

    views: list[InstanceView]
    kv: list[tuple[int, int]]  # (KV tokens the view says are used, the running requests' blocks in tokens)

    def __init__(self) -> None:
        super().__init__()
        self.views = []
        self.kv = []

    def schedule(self, view: InstanceView) -> Decision:
        self.views.append(view)
        held = sum((r.prompt_tokens + r.generated) // 16 + 1 for r in view.running) * 16
        self.kv.append((view.kv_used_tokens, held))
        return super().schedule(view)


def _cluster(
    instances: int = 1, router: str = "least-loaded", **engine: object
) -> tuple[Cluster, list[Recorder]]:
    policies: list[Recorder] = []

    def factory() -> Recorder:
        policies.append(Recorder())
        return policies[-1]

    cfg = ClusterConfig({"base": PROF}, instances, EngineConfig(**engine), router=router, adapters=ADAPTERS)
    return Cluster(cfg, factory), policies


def _req(rid: str, model: str, arrival: float = 0.0, out: int = 5, prompt: int = 20) -> Request:
    return Request(rid, arrival, prompt, 100, model=model, true_output_tokens=out)


def test_a_batch_never_mixes_more_adapters_than_its_slots() -> None:
    rng = np.random.default_rng(3)
    reqs = [
        _req(f"r{i}", f"a{rng.integers(0, 6)}" if i % 4 else "base", 0.002 * i, out=int(rng.integers(2, 40)))
        for i in range(200)
    ]
    cluster, [policy] = _cluster(max_loras=2)
    cluster.run(reqs)
    assert all(r.finished for r in reqs)
    mixed = [len(batch_adapters(v.running, ADAPTERS)) for v in policy.views]
    assert max(mixed) == 2  # the slots were used, never exceeded
    assert all(v.max_loras == 2 and dict(v.adapter_of) == ADAPTERS for v in policy.views)
    # the base's own requests take no slot: they ran beside two adapters
    assert any(
        len(batch_adapters(v.running, ADAPTERS)) == 2 and any(r.model == "base" for r in v.running)
        for v in policy.views
    )


def test_an_adapter_cache_miss_delays_the_request_by_the_load() -> None:
    cost = LoraCost(load_s=0.5, step_overhead=0.0)
    base, first, again = _req("b", "base"), _req("x", "a1", 10.0), _req("y", "a1", 20.0)
    cluster, _ = _cluster(lora_cost=cost)
    result = cluster.run([base, first, again])
    ttft = [r.first_token_at - r.arrival for r in (base, first, again)]
    assert ttft == pytest.approx([ttft[0], ttft[0] + 0.5, ttft[0]])  # loaded once, then held
    assert result.adapter_loads == 1


def test_a_full_adapter_cache_evicts_and_loads_again() -> None:
    reqs = [_req(f"r{i}", f"a{i % 3}", 10.0 * i) for i in range(6)]  # a0 a1 a2 a0 a1 a2, one at a time
    cluster, _ = _cluster(max_loras=1, max_cpu_loras=2)
    assert cluster.run(reqs).adapter_loads == 6  # LRU of two over three adapters in turn: every one misses
    cluster, _ = _cluster(max_loras=1, max_cpu_loras=3)
    assert cluster.run([_req(f"r{i}", f"a{i % 3}", 10.0 * i) for i in range(6)]).adapter_loads == 3


def test_steps_with_adapter_requests_pay_the_lora_overhead() -> None:
    cost = LoraCost(load_s=0.0, step_overhead=0.25)
    base, adapter = _req("b", "base", out=20), _req("x", "a1", 10.0, out=20)
    cluster, _ = _cluster(lora_cost=cost)
    cluster.run([base, adapter])
    gaps = [np.diff(r.tokens.times()) for r in (base, adapter)]
    assert gaps[1] == pytest.approx(gaps[0] * 1.25)
    ttfts = [r.first_token_at - r.arrival for r in (base, adapter)]
    assert ttfts[1] == pytest.approx(ttfts[0] * 1.25)


def test_a_base_and_its_adapters_share_one_kv_pool() -> None:
    reqs = [_req("b", "base", out=30, prompt=100), _req("x", "a1", out=30, prompt=100),
            _req("y", "a2", out=30, prompt=100)]  # fmt: skip
    cluster, [policy] = _cluster()
    cluster.run(reqs)
    at = next(i for i, v in enumerate(policy.views) if len(v.running) == 3)
    both = policy.views[at]
    assert both.kv_capacity_tokens == PROF.kv_capacity_tokens // 16 * 16
    used, held = policy.kv[at]
    assert used == held > 0  # the base's and both adapters' blocks, in one pool
    assert both.active_model == "base" and not both.models  # one engine, not one per adapter


def test_the_cluster_fills_the_adapter_fields_routing_reads() -> None:
    cluster, _ = _cluster(instances=2, router="adapter-affinity", max_loras=1)
    first, second = cluster.instances
    first.add(_req("x", "a1", out=50), 0.0)
    first.advance()  # a1 takes the one slot
    first.add(_req("w", "a2", out=50), 0.0)  # a2 waits for it
    assert _adapter_load(first, "a1") == {
        "adapter_of": "base", "resident_adapters": frozenset({"a1"}),
        "waiting_adapters": frozenset({"a2"}), "adapter_slots": 1,
    }  # fmt: skip
    assert _adapter_load(second, "a1")["resident_adapters"] == frozenset()
    assert _adapter_load(first, "base") == {}
    assert _same_engine(first, "base") == 2 and _same_engine(first, "a1") == 1
    # a1's next request joins it there, though that instance is the busier one; a2's goes to the free slot
    router = RouteRouter("adapter-affinity")
    assert router.route(_req("y", "a1"), cluster.view()) is first
    assert router.route(_req("z", "a2"), cluster.view()) is second


def test_adapters_need_a_base_and_slots_a_cache_that_holds_them() -> None:
    with pytest.raises(ValueError, match="base among"):
        ClusterConfig({"base": PROF}, 1, adapters={"a1": "other"})
    with pytest.raises(ValueError, match="at least max_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="prefix caching"):
        _cluster(prefix_caching=True)
    with pytest.raises(ValueError, match="co-resident"):
        cfg = ClusterConfig({"base": PROF, "b2": PROF}, 1, EngineConfig(co_resident=True), adapters=ADAPTERS)
        Cluster(cfg, FCFS)


def test_the_slots_are_the_awake_engine_s_alone() -> None:
    # Two bases swapping on one instance, one slot each: b2's adapter asked first takes no slot of
    # base's engine, which is awake and runs its own adapter at once.
    adapters = {"a0": "base", "c0": "b2"}
    cfg = ClusterConfig({"base": PROF, "b2": PROF}, 1, EngineConfig(max_loras=1), adapters=adapters)
    other, mine = _req("c", "c0"), _req("a", "a0")
    Cluster(cfg, FCFS).run([other, mine])
    assert mine.first_token_at < other.first_token_at


def test_base_requests_spread_over_instances_busy_with_its_adapters() -> None:
    # Each instance has adapter requests in flight: a base request pays no swap anywhere, so least-wait
    # spreads the base's requests by load instead of piling them where the base already runs.
    cluster, _ = _cluster(instances=2, router="least-wait")
    for inst in cluster.instances:
        inst.add(_req(f"x{inst.name}", "a1", out=50), 0.0)
    router = RouteRouter("least-wait")
    picked = [router.route(_req(f"b{k}", "base"), cluster.view()) for k in range(2)]
    picked[0].add(_req("b0", "base", out=50), 0.0)
    assert router.route(_req("b1", "base"), cluster.view()) is not picked[0]
