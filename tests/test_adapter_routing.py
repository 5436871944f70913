"""Adapter-affinity routing (tessera.core.routing): a LoRA adapter's request goes where the adapter is
resident, else where its base's engine has a free adapter slot, each weighed in seconds against the
queue there; adapters never pay a model swap's engine restart."""

from __future__ import annotations

import pytest

from tessera.core.profile import StepProfile
from tessera.core.routing import (
    AdapterSettings,
    InstanceLoad,
    RouteRequest,
    adapter_cost,
    adapter_scorer,
    estimated_wait,
    make_route,
    seed_stats,
    swap_penalty,
)

PROFILE = StepProfile("m", 0.01, 0.001, 0.0, 0.01, 0.0001, kv_capacity_tokens=1_000_000)
LOAD_S = AdapterSettings().load_seconds


def lora(
    name: str,
    resident: set[str],
    *,
    slots: int = 2,
    outstanding: int = 0,
    others: int = 0,
    waiting: set[str] = frozenset(),
) -> InstanceLoad:
    """The load of adapter ``a1`` on instance ``name``, whose base engine holds ``resident`` in its
    batch and has requests of ``waiting`` queued."""
    return InstanceLoad(
        name, "a1", "interactive", PROFILE, 4, outstanding, other_outstanding=others, last_model="base",
        adapter_of="base", resident_adapters=frozenset(resident), adapter_slots=slots,
        waiting_adapters=frozenset(waiting),
    )  # fmt: skip


def request() -> RouteRequest:
    return RouteRequest("a1", "interactive", seed_stats())


def pick(*loads: InstanceLoad) -> str:
    return make_route("adapter-affinity").pick(request(), list(loads)).instance


def test_resident_beats_free_slot_beats_full_slots() -> None:
    resident, free, full = lora("r", {"a1"}), lora("f", {"a2"}), lora("x", {"a2", "a3"})
    assert adapter_cost(request(), resident, LOAD_S) == 0.0
    assert adapter_cost(request(), free, LOAD_S) == LOAD_S
    assert adapter_cost(request(), full, LOAD_S) > LOAD_S  # a slot must be released first
    assert pick(full, free, resident) == "r"
    assert pick(full, free) == "f"
    # The release of a slot waits for a request to end: longer where the batch is larger (slower steps).
    busy = lora("x", {"a2", "a3"}, others=4)
    assert LOAD_S < adapter_cost(request(), full, LOAD_S) < adapter_cost(request(), busy, LOAD_S)


def test_adapters_waiting_for_a_slot_claim_it_and_queue_ahead() -> None:
    # One slot in use and one free, but a2 waits for it: a1 waits for a release too.
    claimed = lora("c", {"a3"}, waiting={"a2"})
    full = lora("x", {"a2", "a3"})
    assert adapter_cost(request(), lora("f", {"a3"}), LOAD_S) == LOAD_S
    assert adapter_cost(request(), claimed, LOAD_S) == pytest.approx(adapter_cost(request(), full, LOAD_S))
    # Each adapter waiting ahead is one more release; a1's own waiting requests put it in the queue.
    two_ahead = lora("q", {"a2", "a3"}, waiting={"a4", "a5"})
    one_ahead = lora("q", {"a2", "a3"}, waiting={"a4", "a1"})
    release = adapter_cost(request(), full, LOAD_S) - LOAD_S
    assert adapter_cost(request(), two_ahead, LOAD_S) == pytest.approx(LOAD_S + 3 * release)
    assert adapter_cost(request(), one_ahead, LOAD_S) == pytest.approx(LOAD_S + 2 * release)
    # A resident adapter's waiting requests are no queue for a slot: it holds one.
    assert adapter_cost(request(), lora("r", {"a1"}, waiting={"a1", "a2"}), LOAD_S) == 0.0


def test_a_long_queue_where_the_adapter_is_resident_sends_it_elsewhere() -> None:
    # 12 requests ahead of a batch of 4 on the resident instance: waiting for a slot there costs more
    # than loading the adapter into the idle instance's free slot.
    queued = lora("r", {"a1"}, outstanding=2, others=14)
    idle = lora("f", set())
    assert estimated_wait(queued, seed_stats()) > LOAD_S
    assert pick(queued, idle) == "f"
    # With a short queue, the resident instance keeps the adapter's requests together.
    assert pick(lora("r", {"a1"}, outstanding=2, others=1), idle) == "r"


def test_an_adapter_pays_no_engine_restart_and_a_full_model_no_adapter_cost() -> None:
    # Another model's requests in flight and none of its own: a full model would swap, an adapter loads.
    adapter = lora("a", set(), others=3)
    assert swap_penalty(adapter) == 0.0
    full = InstanceLoad("a", "m", "interactive", PROFILE, 4, 0, other_outstanding=3, last_model="n")
    assert swap_penalty(full) > 0.0 and adapter_cost(request(), full, LOAD_S) == 0.0
    score = adapter_scorer(AdapterSettings())
    assert score(RouteRequest("m", "interactive", seed_stats()), full) == pytest.approx(
        estimated_wait(full, seed_stats()), abs=1e-9
    )


def test_the_scorer_s_settings_are_typed() -> None:
    route = make_route("adapter-affinity", **{"adapter-affinity": {"load_seconds": 20.0}})
    # Loading costs 20 s: the resident instance keeps the request behind 12 queued ones (8.2 s).
    queued = lora("r", {"a1"}, outstanding=2, others=14)
    assert route.pick(request(), [queued, lora("f", set())]).instance == "r"
    with pytest.raises(ValueError, match="adapter-affinity"):
        make_route("adapter-affinity", **{"adapter-affinity": {"load_seconds": -1}})


def test_a_base_pays_no_swap_for_its_own_adapters_requests() -> None:
    # Only the base's adapters' requests there (its own engine) and an adapter served last: no swap.
    own = InstanceLoad("a", "base", "interactive", PROFILE, 4, 0, other_outstanding=3, last_model="base",
                       same_engine_outstanding=3)  # fmt: skip
    assert swap_penalty(own) == 0.0
    # One of them is another engine's model's: the base's engine must be woken.
    other = InstanceLoad("a", "base", "interactive", PROFILE, 4, 0, other_outstanding=3, last_model="base",
                         same_engine_outstanding=2)  # fmt: skip
    assert swap_penalty(other) > 0.0
