"""The router's balancer: route by model and class role, least QLM-estimated wait, deterministic ties."""

from __future__ import annotations

import pytest

from tessera.core.policies.qlm.estimator import EngineRates, request_wait
from tessera.core.profile import StepProfile
from tessera.router.balancer import InstanceLoad, NoInstance, choose, eligible, estimated_wait, seed_stats

PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.0001, kv_capacity_tokens=1_000_000)


def load(name: str, *, role: str = "interactive", batch: int = 4, outstanding: int = 0,
         model: str = "m", healthy: bool = True, profile: StepProfile = PROFILE) -> InstanceLoad:  # fmt: skip
    return InstanceLoad(name, model, role, profile, batch, outstanding, healthy)  # type: ignore[arg-type]


def test_wait_is_zero_with_a_free_batch_slot_and_qlm_rwt_beyond() -> None:
    stats = seed_stats()
    assert estimated_wait(load("a", batch=4, outstanding=3), stats) == 0.0
    busy = load("a", batch=4, outstanding=6)  # 3 requests must leave the batch first
    theta = EngineRates(PROFILE, 4).theta(stats)
    assert estimated_wait(busy, stats, z=1.0) == pytest.approx(request_wait([(3, stats, theta)], 1.0))
    assert estimated_wait(load("a", batch=4, outstanding=9), stats) > estimated_wait(busy, stats)


def test_least_estimated_wait_wins_and_a_faster_instance_takes_a_longer_queue() -> None:
    stats = seed_stats()
    a, b = load("a", outstanding=8), load("b", outstanding=6)
    assert choose([a, b], "m", "interactive", stats) is b
    fast = StepProfile("m", 0.001, 0.0001, 0.0, 0.01, 0.0001, kv_capacity_tokens=1_000_000)
    c = load("c", outstanding=9, profile=fast)  # longer queue, ten times the throughput
    assert estimated_wait(c, stats) < estimated_wait(b, stats)
    assert choose([a, b, c], "m", "interactive", stats) is c


def test_ties_go_to_fewer_outstanding_then_name() -> None:
    stats = seed_stats()
    assert (
        choose([load("b", outstanding=1), load("a", outstanding=2)], "m", "interactive", stats).instance
        == "b"
    )
    assert choose([load("b"), load("a")], "m", "interactive", stats).instance == "a"


def test_classes_go_to_their_own_role_then_mixed_never_the_other_role() -> None:
    stats = seed_stats()
    inter, mixed, batch = load("i", role="interactive"), load("x", role="mixed"), load("b", role="batch")
    assert choose([inter, mixed, batch], "m", "interactive", stats) is inter
    assert choose([inter, mixed, batch], "m", "batch", stats) is batch
    assert eligible([inter, mixed, batch], "batch") == [mixed, batch]
    # own role full (wait > 0), mixed free: mixed takes it
    inter.outstanding = 10
    assert choose([inter, mixed, batch], "m", "interactive", stats) is mixed


def test_all_interactive_plan_still_serves_batch_and_unknown_model_or_unhealthy_fails() -> None:
    stats = seed_stats()
    only = [load("i1"), load("i2", outstanding=1)]
    assert choose(only, "m", "batch", stats).instance == "i1"
    with pytest.raises(NoInstance, match="'other'"):
        choose(only, "other", "interactive", stats)
    with pytest.raises(NoInstance):
        choose([load("i", healthy=False)], "m", "interactive", stats)
    assert (
        choose([load("i1", healthy=False), load("i2", outstanding=50)], "m", "interactive", stats).instance
        == "i2"
    )
