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
    name: str, resident: set[str], *, slots: int = 2, outstanding: int = 0, others: int = 0
) -> InstanceLoad:
    """The load of adapter ``a1`` on instance ``name``, whose base engine holds ``resident``."""
    return InstanceLoad(
        name, "a1", "interactive", PROFILE, 4, outstanding, other_outstanding=others, last_model="base",
        adapter_of="base", resident_adapters=frozenset(resident), adapter_slots=slots,
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
    # The release of a slot waits for a request to end: longer with fewer requests in flight to end.
    busy = lora("x", {"a2", "a3"}, others=4)
    assert LOAD_S < adapter_cost(request(), busy, LOAD_S) < adapter_cost(request(), full, LOAD_S)


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
