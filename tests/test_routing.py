"""Routing plugins (tessera.core.routing): the live router's least-wait route (model, class role, least
QLM-estimated wait, deterministic ties), the simulator's routes, and plugin validation."""

from __future__ import annotations

import pytest

from tessera.core.policies.qlm.estimator import EngineRates, request_wait
from tessera.core.policies.qlm.lso import TierCosts
from tessera.core.profile import StepProfile
from tessera.core.routing import (
    InstanceLoad,
    NoInstance,
    PrefillQueue,
    RouteRequest,
    RouteSpec,
    ScorerSpec,
    build_route,
    class_roles,
    estimated_wait,
    healthy,
    make_route,
    seed_stats,
    swap_penalty,
)

PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.0001, kv_capacity_tokens=1_000_000)


def choose(loads: list[InstanceLoad], model: str, kind: str, stats: object) -> InstanceLoad:
    """The live router's pick."""
    return make_route("least-wait").pick(RouteRequest(model, kind, stats), loads)  # type: ignore[arg-type]


def eligible(loads: list[InstanceLoad], kind: str) -> list[InstanceLoad]:
    return class_roles(RouteRequest("m", kind), healthy(RouteRequest("m", kind), loads))


def load(name: str, *, role: str = "interactive", batch: int = 4, outstanding: int = 0,
         model: str = "m", healthy: bool = True, profile: StepProfile = PROFILE) -> InstanceLoad:  # fmt: skip
    return InstanceLoad(name, model, role, profile, batch, outstanding, healthy)  # type: ignore[arg-type]


def test_wait_is_zero_with_a_free_batch_slot_and_qlm_rwt_beyond() -> None:
    stats = seed_stats()
    assert estimated_wait(load("a", batch=4, outstanding=3), stats) == 0.0
    busy = load("a", batch=4, outstanding=6)  # 3 requests must leave the batch first
    rates = EngineRates(PROFILE, 4)
    assert estimated_wait(busy, stats, z=1.0) == pytest.approx(request_wait([(3, stats, rates)], 1.0))
    assert estimated_wait(load("a", batch=4, outstanding=9), stats) > estimated_wait(busy, stats)


def test_a_multi_model_instance_counts_its_other_models_and_a_swap() -> None:
    stats = seed_stats()
    swap = TierCosts().engine_reinit_s + PROFILE.model_load_time()
    # Six requests of another model in flight: they are ahead of this one, and a swap after them.
    other = InstanceLoad("a", "m", "mixed", PROFILE, 4, 0, other_outstanding=6, last_model="n")
    assert swap_penalty(other) == pytest.approx(swap)
    rates = EngineRates(PROFILE, 4)
    assert estimated_wait(other, stats, z=1.0) == pytest.approx(request_wait([(3, stats, rates)], 1.0) + swap)
    # Requests of its own model there: it joins them, no swap of its own.
    joining = InstanceLoad("b", "m", "mixed", PROFILE, 4, 1, other_outstanding=5, last_model="n")
    assert swap_penalty(joining) == 0.0
    # An idle instance that last served another model still swaps; one model alone never does.
    assert swap_penalty(InstanceLoad("c", "m", "mixed", PROFILE, 4, last_model="n")) == pytest.approx(swap)
    assert swap_penalty(InstanceLoad("d", "m", "mixed", PROFILE, 4, last_model="m")) == 0.0
    assert swap_penalty(load("e", outstanding=0)) == 0.0
    assert choose([other, joining], "m", "batch", stats) is joining


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


def test_simulator_routes_least_loaded_takes_the_first_of_ties_and_round_robin_cycles() -> None:
    loads = [load("a", outstanding=1), load("b"), load("c")]
    req = RouteRequest("m", "interactive")
    assert make_route("least-loaded").pick(req, loads).instance == "b"
    rr = make_route("round-robin")
    assert [rr.pick(req, loads).instance for _ in range(4)] == ["a", "b", "c", "a"]


def test_started_filter_prefers_running_instances_else_the_one_that_starts_first() -> None:
    warming = [load("a"), load("b")]
    warming[0].ready_at, warming[1].ready_at = 30.0, 20.0
    assert make_route("least-loaded").pick(RouteRequest("m", now=10.0), warming).instance == "b"
    assert make_route("least-loaded").pick(RouteRequest("m", now=40.0), warming).instance == "a"


def test_routes_validate_plugins_and_their_typed_settings() -> None:
    with pytest.raises(ValueError, match="unknown filter 'nope'"):
        build_route("x", RouteSpec(filters=("nope",)))
    with pytest.raises(ValueError, match="unknown scorer 'fast'"):
        build_route("x", RouteSpec(filters=(), scorers=(ScorerSpec(name="fast"),)))
    with pytest.raises(ValueError, match="bad settings for scorer 'estimated-wait'"):
        make_route("least-wait", **{"estimated-wait": {"z": -1}})
    with pytest.raises(ValueError, match="unknown route"):
        make_route("fastest")
    stats = seed_stats()
    busy = [load("a", batch=1, outstanding=3), load("b", batch=1, outstanding=2)]
    z0 = make_route("least-wait", **{"estimated-wait": {"z": 0.0}})
    assert z0.pick(RouteRequest("m", "interactive", stats), busy).instance == "b"


def test_router_status_names_instances_without_their_addresses() -> None:
    from pathlib import Path

    from tessera.api import load_documents
    from tessera.local.control_plane import LocalEngine, plan_local
    from tessera.router.app import RouterState
    from tessera.router.backends import Backend

    examples = Path(__file__).resolve().parents[1] / "examples"
    config = plan_local(load_documents(examples / "quickstart.yaml"), LocalEngine()).instances[0].config
    state = RouterState([Backend(name="pod-0", url="http://10.1.2.3:8000", role="mixed", config=config)])
    assert [r["instance"] for r in state.status()["instances"]] == ["pod-0"]
    assert "10.1.2.3" not in str(state.status())


def test_the_prefill_queue_counts_what_is_sent_and_drains_it_at_the_prefill_rate() -> None:
    # PROFILE: 0.01 s per prefill plus 0.1 ms per token
    queue = PrefillQueue()
    queue.sent(1_000, 10.0, PROFILE)  # 0.11 s of prefill from t=10
    queue.sent(2_000, 10.05, PROFILE)  # queued behind the first: done at 10.11 + 0.21
    assert queue.tokens == 3_000 and queue.done_at == pytest.approx(10.32)
    assert queue.left(10.0, PROFILE) == 3_000  # nothing computed yet
    assert queue.left(10.22, PROFILE) == pytest.approx(1_000, abs=1)  # 0.1 s left: about 1,000 tokens
    assert queue.left(11.0, PROFILE) == 0  # past done_at: no prefill ahead though no first token came
    assert queue.left(11.0, None) == 3_000  # without a profile the time cannot bound it
    queue.first_token(1_000)
    assert queue.tokens == 2_000 and queue.left(10.05, PROFILE) == 2_000  # what came bounds it too
    queue.first_token(2_000)
    queue.sent(500, 10.2, PROFILE)  # empty: computed from now, not behind done_at
    assert queue.done_at == pytest.approx(10.26) and queue.left(10.2, PROFILE) == 500


def test_expected_ttft_charges_only_the_prefill_left_ahead() -> None:
    stats = seed_stats()
    busy = InstanceLoad("busy", "m", "interactive", PROFILE, 4)
    busy.prefill.sent(10_000, 0.0, PROFILE)  # 1.01 s of prefill
    idle = InstanceLoad("idle", "m", "interactive", PROFILE, 4)
    req = RouteRequest("m", "interactive", stats, 0.0, prompt_tokens=5_000, cached_tokens={"busy": 4_990})
    route = make_route("cache-aware")
    assert route.pick(req, [busy, idle]).instance == "idle"  # 1 s ahead + 0.011 s > 0.51 s
    half = RouteRequest("m", "interactive", stats, 0.8, prompt_tokens=5_000, cached_tokens={"busy": 4_990})
    assert route.pick(half, [busy, idle]).instance == "busy"  # 0.21 s left + 0.011 s < 0.51 s


def test_live_router_counts_a_multi_model_instance_s_other_models() -> None:
    """The live router keeps a load per (instance, model); a request of one model must see the requests
    of the instance's other models in flight and the model it last sent there."""
    from pathlib import Path

    from tessera.api import load_documents
    from tessera.local.control_plane import LocalEngine, plan_local
    from tessera.router.app import RouterState
    from tessera.router.backends import Backend

    examples = Path(__file__).resolve().parents[1] / "examples"
    config = plan_local(load_documents(examples / "quickstart.yaml"), LocalEngine()).instances[0].config
    first = config.models[0]
    two = config.model_copy(update={"models": [first, first.model_copy(update={"name": "other"})]})
    state = RouterState([Backend(name=n, url=f"http://{n}", role="mixed", config=two) for n in ("a", "b")])
    for load in state.loads.values():
        load.healthy, load.batch_size = True, 2
    state.loads[("a", "other")].outstanding = 6  # a is busy with the other model
    assert state.pick(first.name, "batch", set()).load.instance == "b"
    assert state.last_model == {"b": first.name}
    state.loads[("b", first.name)].outstanding = 1
    state.loads[("a", "other")].outstanding = 0
    # b serves the first model now: the other model's request goes to a, which last served it
    state.last_model["a"] = "other"
    assert state.pick("other", "batch", set()).load.instance == "a"
