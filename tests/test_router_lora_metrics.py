"""The router reads which LoRA adapters each worker's engine holds, and its slots, from the worker's
/metrics, so that the adapter-affinity route ranks instances on what the engines report."""

from __future__ import annotations

import pytest

from tessera.api.worker_config import WorkerConfig
from tessera.router.app import RouterState
from tessera.router.backends import Backend
from tessera.worker.metrics import WorkerMetrics

CONFIG = WorkerConfig.model_validate({"models": [
    {"name": "base", "engine": "sim"},
    {"name": "ad1", "engine": "sim", "adapterOf": "base", "adapterSource": "/adapters/ad1", "adapterRank": 8},
    {"name": "ad2", "engine": "sim", "adapterOf": "base", "adapterSource": "/adapters/ad2", "adapterRank": 8},
]})  # fmt: skip


def exposition(resident: dict[str, int], slots: int) -> str:
    """A worker's real /metrics with these adapters' resident gauges and its base's slots set."""
    metrics = WorkerMetrics()
    for adapter, value in resident.items():
        metrics.lora_resident.labels(adapter, "base").set(value)
    metrics.lora_slots.labels("base").set(slots)
    metrics.batch_size.labels("base").set(8)
    return metrics.exposition().decode()


def state(route: str = "adapter-affinity") -> RouterState:
    out = RouterState([Backend(name=n, url=f"http://{n}", config=CONFIG) for n in ("a", "b")], route=route)
    for name in ("a", "b"):
        out.set_health(name, True)
    return out


def test_observe_fills_each_adapters_base_resident_set_and_slots() -> None:
    router = state()
    router.observe("a", exposition({"ad1": 1, "ad2": 0}, slots=2))
    ad1, ad2, base = (router.loads[("a", m)] for m in ("ad1", "ad2", "base"))
    assert (ad1.adapter_of, ad1.resident_adapters, ad1.adapter_slots) == ("base", frozenset({"ad1"}), 2)
    assert (ad2.adapter_of, ad2.resident_adapters, ad2.adapter_slots) == ("base", frozenset({"ad1"}), 2)
    assert base.adapter_of is None and base.batch_size == 8
    router.observe("a", exposition({"ad1": 0, "ad2": 1}, slots=2))  # ad1 unloaded, ad2 loaded
    assert router.loads[("a", "ad1")].resident_adapters == frozenset({"ad2"})
    assert router.loads[("b", "ad1")].adapter_of is None  # b never reported


@pytest.mark.parametrize("holder", ["a", "b"])
def test_the_adapter_affinity_route_sends_an_adapter_to_the_instance_whose_engine_holds_it(
    holder: str,
) -> None:
    router = state()
    other = "b" if holder == "a" else "a"
    # both engines full (one slot each): the other one would first have to release ad2's slot
    router.observe(holder, exposition({"ad1": 1, "ad2": 0}, slots=1))
    router.observe(other, exposition({"ad1": 0, "ad2": 1}, slots=1))
    assert {router.pick("ad1", "interactive", set()).load.instance for _ in range(4)} == {holder}
    assert router.pick("ad2", "interactive", set()).load.instance == other
