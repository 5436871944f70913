"""Placement charges a base model for its LoRA adapters: their requests are its compute (loads merged
into the base's), its engine's steps pay the LoRA overhead (``tessera.core.lora.charged_profile``), and
the simulated estimator runs the adapters' requests in the engine's adapter slots (``max_loras``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_lora_adapters import _adapter, _quickstart

from tessera.control.inputs import ServiceLoad, with_adapter_loads
from tessera.control.placement import Group, simulate_performance
from tessera.control.placement_sim import ENGINES, group_profiles, pool_sharing
from tessera.control.pool_plan import PoolDesired, desired_pool
from tessera.core.baselines import FCFS
from tessera.core.lora import LoraCost, charged_profile
from tessera.core.planners import HistoryRequest, LoraAdapters, PoolInput, ServiceInput
from tessera.core.profiles import load_profile
from tessera.core.request import Request, ServiceClass
from tessera.core.slo import slo_met
from tessera.sim.cluster import Cluster, ClusterConfig


def _load(rate: float, prompt: float, output: float, arrivals: tuple[float, ...] = ()) -> ServiceLoad:
    history = tuple(HistoryRequest(t, round(prompt), round(output)) for t in arrivals)
    return ServiceLoad(rate, prompt, output, "declared", "declared", "declared", history=history)


def test_adapter_loads_add_to_their_base_s() -> None:
    merged = with_adapter_loads(
        _load(1.0, 100, 50, (0.0, 2.0)), {"support": _load(3.0, 200, 10, (1.0,)), "idle": _load(0.0, 1, 1)}
    )
    assert merged.rate == 4.0 and merged.adapter_rate == 3.0
    assert merged.prompt_tokens == pytest.approx((100 + 3 * 200) / 4)
    assert merged.output_tokens == pytest.approx((50 + 3 * 10) / 4)
    assert [(h.arrival, h.adapter) for h in merged.history] == [(0.0, None), (1.0, "support"), (2.0, None)]
    assert merged.adapters == ("support", "idle")
    base = _load(1.0, 100, 50)
    assert with_adapter_loads(base, {}) is base


def test_a_charged_profile_pays_the_overhead_on_every_step() -> None:
    profile = load_profile("h100-llama3-8b")
    charged = charged_profile(profile, LoraCost(step_overhead=0.25))
    assert charged.decode_step(32, 32_000) == pytest.approx(1.25 * profile.decode_step(32, 32_000))
    assert charged.prefill(1000) == pytest.approx(1.25 * profile.prefill(1000))
    assert charged_profile(profile, LoraCost(step_overhead=0.0)) is profile


def _expecting(body: dict[str, Any], rate: float) -> dict[str, Any]:
    body["spec"]["expectedLoad"] = {"requestsPerSecond": rate, "promptTokens": 500, "outputTokens": 100}
    return body


def test_the_base_is_planned_for_its_adapters_demand_at_the_lora_cost() -> None:
    pool, (base,), classes = _quickstart()
    _expecting(base, 2.0)
    alone = desired_pool(pool, [base], classes, None, 0.0)
    shared = desired_pool(
        pool,
        [base, _expecting(_adapter("support"), 3.0), _expecting(_adapter("sales"), 5.0)],
        classes,
        None,
        0.0,
    )
    assert isinstance(alone, PoolDesired) and isinstance(shared, PoolDesired)
    name = base["metadata"]["name"]
    assert alone.loads[name].rate == 2.0
    assert shared.loads[name].rate == 10.0 and shared.loads[name].adapter_rate == 8.0
    plain, lora = alone.inputs[name].profile, shared.inputs[name].profile
    assert lora.decode_step(8, 4000) == pytest.approx(
        plain.decode_step(8, 4000) * LoraCost().step_factor(True)
    )
    assert shared.inputs[name].request_rate == 10.0


H100 = load_profile("h100-llama3-8b")
ONE_GPU = PoolInput("p", "H100", 80 * 2**30, 1)
ADAPTERS = tuple(f"a{i}" for i in range(8))
CHAT = ServiceClass("chat", ttft_slo_s=1.0)
# A minute at 5 req/s, the eight adapters in turn: every adapter is busy all the time
BUSY = tuple(HistoryRequest(i / 5, 500, 200, ADAPTERS[i % 8]) for i in range(300))


def _base(slots: int) -> ServiceInput:
    return ServiceInput(
        "base", H100.weights_bytes, H100.kv_bytes_per_token, charged_profile(H100, LoraCost()),
        mean_prompt_tokens=500, mean_output_tokens=200, slo_class=CHAT, policy="fcfs", history=BUSY,
        lora=LoraAdapters(ADAPTERS, slots, len(ADAPTERS)),
    )  # fmt: skip


def _simulated(slots: int) -> float:
    """The simulator's own adapter engine on the same history: the base's plain profile (the engine
    charges the LoRA step itself), ``slots`` GPU slots, every adapter held after its first load."""
    profile = group_profiles(ONE_GPU, [replace(_base(slots), profile=H100)], 1)["base"]
    engine = replace(ENGINES[pool_sharing(ONE_GPU)], max_loras=slots, max_cpu_loras=len(ADAPTERS))
    config = ClusterConfig({"base": profile}, engine=engine, adapters=dict.fromkeys(ADAPTERS, "base"))
    requests = [
        Request(f"r{i}", h.arrival, h.prompt_tokens, h.output_tokens, model=h.adapter,
                true_output_tokens=h.output_tokens, service_class=CHAT)
        for i, h in enumerate(BUSY)
    ]  # fmt: skip
    result = Cluster(config, FCFS).run(requests)
    assert result.adapter_loads == len(ADAPTERS)
    return sum(bool(slo_met(r)) for r in result.requests) / len(requests)


def test_the_simulated_estimate_charges_the_adapter_slot_limit_as_the_simulator_does() -> None:
    """Eight busy adapters on an engine of two slots: a batch mixes two of them, the others wait. The
    estimate drops with the slots and is the simulator's own attainment for the same history."""
    group = [Group(0, 1, services=["base"])]
    enough, few = (simulate_performance(ONE_GPU, [_base(n)], group) for n in (8, 2))
    assert enough.slo_attainment == pytest.approx(_simulated(8), abs=1e-9)
    assert few.slo_attainment == pytest.approx(_simulated(2), abs=1e-9)
    assert enough.slo_attainment >= 0.99
    assert few.slo_attainment < enough.slo_attainment - 0.3
    assert few.norm_latency > 2 * enough.norm_latency


def test_a_history_naming_an_adapter_the_base_has_not_is_refused() -> None:
    with pytest.raises(ValueError, match=r"names adapters \['a9'\]"):
        replace(_base(2), history=(HistoryRequest(0.0, 10, 10, "a9"),))
    with pytest.raises(ValueError, match=r"its adapters: none"):
        replace(_base(2), lora=None)
    with pytest.raises(ValueError, match="max_cpu_loras >= max_loras"):
        LoraAdapters(("a0",), 2, 1)
    with pytest.raises(ValueError, match="distinct"):
        LoraAdapters(("a0", "a0"), 1, 2)
    with pytest.raises(ValueError, match="empty string"):
        HistoryRequest(0.0, 10, 10, "")
    with pytest.raises(ValueError, match="tokens >= 0"):
        HistoryRequest(0.0, -1, 10)


def _planned(**pool_spec: Any) -> PoolDesired:
    """The operator's plan of the quickstart's base with four adapters of 4 req/s each."""
    pool, (base,), classes = _quickstart()
    pool["spec"] |= pool_spec
    pool["spec"]["placement"]["replacementInterval"] = {"initialSeconds": 60}  # a short history: fast
    adapters = [_expecting(_adapter(f"ad{i}"), 4.0) for i in range(4)]
    decided = desired_pool(pool, [_expecting(base, 1.0), *adapters], classes, None, 0.0)
    assert isinstance(decided, PoolDesired)
    return decided


def test_the_operator_s_placement_estimates_a_base_worse_with_fewer_lora_slots_than_busy_adapters() -> None:
    enough, few = _planned(), _planned(maxLoras=1)
    name = "llama-8b"
    assert enough.inputs[name].lora == LoraAdapters(("ad0", "ad1", "ad2", "ad3"), 4, 4)
    assert few.inputs[name].lora == LoraAdapters(("ad0", "ad1", "ad2", "ad3"), 1, 4)
    assert {h.adapter for h in few.inputs[name].history} == {None, "ad0", "ad1", "ad2", "ad3"}
    worse, better = few.plan.estimated_slo_attainment, enough.plan.estimated_slo_attainment
    assert worse is not None and better is not None
    assert better >= 0.99 and worse < better - 0.1
    assert few.plan.estimated_norm_latency > 2 * enough.plan.estimated_norm_latency


def test_a_co_resident_group_replays_its_base_s_adapters_as_the_base_s_own_requests() -> None:
    """The simulator does not model adapters beside another model's co-resident engine: there the slot
    limit is not charged (the requests run as the base's); a swapping group charges it."""
    other = ServiceInput("other", 2 * 2**30, H100.kv_bytes_per_token, H100, mean_output_tokens=50)
    group = [Group(0, 1, services=["base", "other"])]
    co_resident = replace(ONE_GPU, engines_sleep=False)
    alone = simulate_performance(ONE_GPU, [_base(2)], [Group(0, 1, services=["base"])])
    assert simulate_performance(co_resident, [_base(2), other], group).slo_attainment >= 0.99
    assert simulate_performance(ONE_GPU, [_base(2), other], group).slo_attainment == alone.slo_attainment
