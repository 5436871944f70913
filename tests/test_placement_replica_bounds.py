"""An LLMService's replicas.max bounds how many instances host it, under every placement strategy."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.control.placement import plan_placement
from tessera.core.planners import PoolInput, ServiceInput
from tessera.core.profile import StepProfile

GIB = 2**30
LM7 = StepProfile("lm", 0.008, 2e-5, 6.6e-8, 0.005, 8.5e-5, 65536)


def svc(name: str, rate: float, max_replicas: int | None) -> ServiceInput:
    return ServiceInput(
        name, 14 * GIB, 512 * 1024, LM7, request_rate=rate, p99_context_tokens=2048, max_replicas=max_replicas
    )


def hosts(plan, name: str) -> int:
    return sum(g.replicas.total for g in plan.groups if name in g.services)


@pytest.mark.parametrize("strategy", ["dedicated", "seallm"])
def test_plan_respects_max_replicas(strategy: str) -> None:
    pool = PoolInput("p", "A800", 80 * GIB, 8)
    capped, free = svc("capped", 5.0, max_replicas=1), svc("free", 0.1, max_replicas=None)
    plan = plan_placement(pool, [capped, free], strategy=strategy, now=0.0)
    assert hosts(plan, "capped") == 1  # the busier service would take more GPUs without its cap
    assert hosts(plan, "free") >= 1


def test_previous_plan_over_a_lowered_cap_is_not_kept() -> None:
    pool = PoolInput("p", "A800", 80 * GIB, 8)
    services = [svc("a", 5.0, None), svc("b", 0.1, None)]
    previous = plan_placement(pool, services, strategy="seallm", now=0.0)
    assert hosts(previous, "a") > 1
    lowered = [dataclasses.replace(services[0], max_replicas=1), services[1]]
    plan = plan_placement(pool, lowered, strategy="seallm", now=1.0, previous=previous)
    assert hosts(plan, "a") == 1


def test_max_below_min_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_replicas 1 is below min_replicas 2"):
        ServiceInput("s", GIB, 1024, LM7, min_replicas=2, max_replicas=1)
