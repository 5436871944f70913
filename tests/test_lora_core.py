"""The LoRA rules the pod's scheduler and the simulator share (``tessera.core.lora``)."""

import pytest

from tessera.core.lora import AdapterCache, admits, batch_adapters, engine_batch
from tessera.core.request import Request

ADAPTERS = {"a1": "base", "a2": "base", "a3": "base"}


def _req(rid: str, model: str) -> Request:
    return Request(id=rid, arrival=0.0, prompt_tokens=8, max_tokens=8, model=model)


def test_batch_adapters_counts_distinct_adapters_not_the_base() -> None:
    batch = [_req("1", "a1"), _req("2", "a1"), _req("3", "base"), _req("4", "a2")]
    assert batch_adapters(batch, ADAPTERS) == {"a1", "a2"}


def test_a_full_batch_admits_its_own_adapters_and_the_base_only() -> None:
    full = frozenset({"a1", "a2"})
    assert admits(full, "a1", ADAPTERS, max_loras=2)
    assert admits(full, "base", ADAPTERS, max_loras=2)
    assert not admits(full, "a3", ADAPTERS, max_loras=2)
    assert admits(full, "a3", ADAPTERS, max_loras=3)


def test_cache_loads_once_and_evicts_the_least_recently_used_idle_adapter() -> None:
    cache = AdapterCache(2)
    assert cache.use("a1") == (True, None)
    assert cache.use("a2") == (True, None)
    assert cache.use("a1") == (False, None)  # a1 is now the most recent
    assert cache.use("a3") == (True, "a2")
    assert cache.resident == {"a1", "a3"}
    # a busy adapter stays: a1 runs, so a3 makes room although a1 is older
    assert cache.use("a2", busy={"a1"}) == (True, "a3")
    # every resident adapter busy: the cache holds one more for the moment
    assert cache.use("a3", busy={"a1", "a2"}) == (True, None)
    assert cache.resident == {"a1", "a2", "a3"}
    assert cache.drop("a1") and not cache.drop("a1")
    assert "a1" not in cache


def test_cache_refuses_no_room() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AdapterCache(0)


def test_engine_batch_keeps_running_requests_and_skips_adapters_without_a_slot() -> None:
    old = _req("old", "a1")
    new = [_req("n2", "a2"), _req("n3", "a3"), _req("nb", "base"), _req("n1", "a1")]
    run, deferred = engine_batch([old, *new], {old}, ADAPTERS, max_loras=2)
    assert [r.id for r in run] == ["old", "n2", "nb", "n1"]
    assert [r.id for r in deferred] == ["n3"]
    everything, none = engine_batch([old, *new], {old}, ADAPTERS, max_loras=0)
    assert len(everything) == 5 and none == []


def test_each_base_engine_has_its_own_slots() -> None:
    adapter_of = {**ADAPTERS, "b1": "other"}
    assert admits({"a1", "a2"}, "b1", adapter_of, max_loras=2)
    assert not admits({"a1", "a2"}, "a3", adapter_of, max_loras=2)
