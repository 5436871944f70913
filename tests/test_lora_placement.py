"""Placement charges a base model for its LoRA adapters: their requests are its compute (loads merged
into the base's) and its engine's steps pay the LoRA overhead (``tessera.core.lora.charged_profile``)."""

from __future__ import annotations

from typing import Any

import pytest
from test_lora_adapters import _adapter, _quickstart

from tessera.control.inputs import ServiceLoad, with_adapter_loads
from tessera.control.pool_plan import PoolDesired, desired_pool
from tessera.core.lora import LoraCost, charged_profile
from tessera.core.planners import HistoryRequest
from tessera.core.profiles import load_profile


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
