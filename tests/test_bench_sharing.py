"""The pieces of the multi-model benches that run without vLLM: the pod scheduler's decision time over
several models' queues, and the simulator's side of ``real-sharing``."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from tessera.bench.decision_time import decision_times
from tessera.bench.real_sharing import LONG, SHORT, _plan, _worker_config
from tessera.bench.sharing_sim import simulated_ratios, simulated_run
from tessera.core.profiles import PROFILES


@pytest.mark.parametrize("policy", ["fcfs", "seallm", "qlm"])
def test_decisions_over_three_models_are_timed(policy: str) -> None:
    times = asyncio.run(decision_times(policy, 3, 200, 20, 8, 0))
    assert len(times) == 20 and all(t > 0 for t in times)


def test_the_simulated_side_plays_both_services_on_one_co_resident_instance() -> None:
    long = PROFILES["smollm2-cpu"]
    short = dataclasses.replace(
        long, name=SHORT, decode_c0=long.decode_c0 / 5, prefill_p1=long.prefill_p1 / 5
    )
    profiles = {LONG: long, SHORT: short}
    exec_s = {LONG: long.exec_time(32, 48), SHORT: short.exec_time(32, 16)}
    plan = _plan(random.Random(0), exec_s, 20.0, 32, {LONG: 48, SHORT: 16}, 1.5, 4)
    assert {m for _, m, _, _ in plan} == {LONG, SHORT}
    out = simulated_run(profiles, plan, "fcfs", 4, 5.0)
    assert set(out) == {"all", LONG, SHORT}
    # queueing behind a shared batch of 4: every service waits longer than alone, on average
    assert all(norm > 1.0 for norm, _ in out.values())
    ratios = simulated_ratios(profiles, [plan], 4, 5.0)
    assert set(ratios) == {"all", LONG, SHORT} and all(r > 0 for r in ratios.values())


def test_the_seallm_worker_gets_each_services_measured_statistics() -> None:
    config = _worker_config({LONG: "http://a", SHORT: "http://b"}, "seallm", 4, {LONG: 2.0, SHORT: 0.5}, 5.0)
    services = config["scheduling"]["settings"]["services"]
    assert services[SHORT] == {"meanExecS": 0.5, "starvationS": 1.25}
    assert [m["name"] for m in config["models"]] == [LONG, SHORT]
