"""The router reads which LoRA adapters each worker's engine holds, and its slots, from the worker's
/metrics, so that the adapter-affinity route ranks instances on what the engines report."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.api import load_documents
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.router.app import RouterState
from tessera.router.backends import Backend
from tessera.worker.metrics import WorkerMetrics

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The worker configuration local mode plans for the example (the operator's, on the sim engine): a base
# and its two adapters in one pod.
CONFIG = plan_local(load_documents(EXAMPLES / "lora-adapters.yaml"), LocalEngine()).instances[0].config
BASE = "meta-llama/Llama-3.1-8B-Instruct"
AD1, AD2 = "acme/support-bot", "acme/legal-summaries"


def exposition(resident: dict[str, int], slots: int) -> str:
    """A worker's real /metrics with these adapters' resident gauges and its base's slots set."""
    metrics = WorkerMetrics()
    for adapter, value in resident.items():
        metrics.lora_resident.labels(adapter, BASE).set(value)
    metrics.lora_slots.labels(BASE).set(slots)
    metrics.batch_size.labels(BASE).set(8)
    return metrics.exposition().decode()


def state(route: str = "adapter-affinity") -> RouterState:
    out = RouterState([Backend(name=n, url=f"http://{n}", config=CONFIG) for n in ("a", "b")], route=route)
    for name in ("a", "b"):
        out.set_health(name, True)
    return out


def test_observe_fills_each_adapters_base_resident_set_and_slots() -> None:
    router = state()
    router.observe("a", exposition({AD1: 1, AD2: 0}, slots=2))
    ad1, ad2, base = (router.loads[("a", m)] for m in (AD1, AD2, BASE))
    assert (ad1.adapter_of, ad1.resident_adapters, ad1.adapter_slots) == (BASE, frozenset({AD1}), 2)
    assert (ad2.adapter_of, ad2.resident_adapters, ad2.adapter_slots) == (BASE, frozenset({AD1}), 2)
    assert base.adapter_of is None and base.batch_size == 8
    router.observe("a", exposition({AD1: 0, AD2: 1}, slots=2))  # AD1 unloaded, AD2 loaded
    assert router.loads[("a", AD1)].resident_adapters == frozenset({AD2})
    assert router.loads[("b", AD1)].adapter_of is None  # b never reported


@pytest.mark.parametrize("holder", ["a", "b"])
def test_the_adapter_affinity_route_sends_an_adapter_to_the_instance_whose_engine_holds_it(
    holder: str,
) -> None:
    router = state()
    other = "b" if holder == "a" else "a"
    # both engines full (one slot each): the other one would first have to release AD2's slot
    router.observe(holder, exposition({AD1: 1, AD2: 0}, slots=1))
    router.observe(other, exposition({AD1: 0, AD2: 1}, slots=1))
    assert {router.pick(AD1, "interactive", set()).load.instance for _ in range(4)} == {holder}
    assert router.pick(AD2, "interactive", set()).load.instance == other


def test_observe_reads_the_adapters_in_each_batch_and_waiting_from_the_pod_s_scheduler() -> None:
    """A worker's scheduler reports each adapter's requests running (it holds a GPU slot) and waiting:
    the router's resident and waiting sets, as the simulator fills them for the shared scorer."""
    metrics = WorkerMetrics()
    for adapter in (AD1, AD2):
        metrics.lora_resident.labels(adapter, BASE).set(1)  # both loaded
    metrics.lora_requests.labels(AD1, BASE, "running").set(3)
    metrics.lora_requests.labels(AD1, BASE, "waiting").set(0)
    metrics.lora_requests.labels(AD2, BASE, "running").set(0)
    metrics.lora_requests.labels(AD2, BASE, "waiting").set(2)
    metrics.lora_slots.labels(BASE).set(1)
    router = state()
    router.observe("a", metrics.exposition().decode())
    load = router.loads[("a", AD2)]
    assert load.resident_adapters == frozenset({AD1}) and load.waiting_adapters == frozenset({AD2})
    assert load.adapter_slots == 1
