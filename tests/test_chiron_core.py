"""Chiron's mechanisms live once in ``tessera.core.chiron``: the worker and the simulator run the same
local-autoscaler wrapper, and one global-autoscaler step serves every caller."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scheduler_harness import one_model_scheduler

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec, parse_config
from tessera.core.baselines import EDF, FCFS
from tessera.core.chiron import ChironLocal, ChironPolicy, GroupMemory, RunningStats, evaluate_group
from tessera.core.planners import AutoscalerState, ChironSettings, MetricsSnapshot, RoleCounts
from tessera.core.profiles import load_profile
from tessera.core.registry import POLICIES, make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.autoscaling import chiron_cluster
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.workloads import build_requests
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.runtime import Worker
from tessera.worker.scheduler import Job


def _config(policy: str, autoscale: bool) -> dict[str, object]:
    return {
        "models": [{"name": "m", "engine": "sim", "maxModelLen": 256}],
        "scheduling": {"policy": policy, "autoscale": {"enabled": autoscale}},
    }


async def test_worker_and_simulator_run_the_same_chiron_wrapper() -> None:
    worker = Worker(parse_config(_config("fcfs", autoscale=True)))
    await worker.start()
    try:
        sched = worker.scheduler
        assert type(sched.policy) is ChironPolicy and isinstance(sched.policy.inner, FCFS)
        local = sched.policy.local
        # A reload switches the inner policy; the learned batch size (the same ChironLocal) stays.
        worker.reload(parse_config(_config("edf", autoscale=True)))
        assert type(sched.policy) is ChironPolicy and isinstance(sched.policy.inner, EDF)
        assert sched.policy.local is local
        worker.reload(parse_config(_config("edf", autoscale=False)))
        assert isinstance(sched.policy, EDF)
    finally:
        await worker.stop()
    _, _, factory = chiron_cluster(
        ChironSettings(),
        RunningStats(),
        lambda: ChironLocal(1, 64, 16),
        group_s=1.0,
        interval_s=1.0,
        exec_margin_s=0.0,
        mean_context=100.0,
    )
    assert type(factory()) is ChironPolicy


async def test_the_worker_wrapper_moves_the_batch_size() -> None:
    """Over the worker's loop the wrapper sees the engine's iterations and tokens: an ITL SLO no engine
    can meet halves the batch size down to its minimum."""
    profile = ProfileSpec(decode_c0=0.002, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0).to_profile(
        "m", 10**6
    )
    engine = SimEngine("m", profile, 4096)
    await engine.start()
    sched = one_model_scheduler(
        engine,
        make_policy("fcfs"),
        profile=profile,
        batch=BatchBounds(min=1, max=8),
        autoscale=AutoscaleSpec(
            enabled=True, min_iterations=2, min_interval_seconds=0.01, interactive_itl_slo_seconds=1e-6
        ),
        max_queued=100,
        class_limits={},
        metrics=WorkerMetrics(),
    )
    await sched.start()
    chat = ServiceClass("chat", "interactive")
    jobs = [
        Job(Request(f"r{i}", 0.0, 3, 20 + 10 * i, service_class=chat, model="m"), [1, 2, 3], {})
        for i in range(8)
    ]
    for job in jobs:
        sched.submit(job)
    await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in jobs)), 20)
    await sched.stop()
    await engine.close()
    assert sched.chiron.history and sched.batch_size < 8


def test_evaluate_group_keeps_the_memory_without_a_measurement() -> None:
    settings = ChironSettings(eval_interval_s=5.0)
    memory = GroupMemory()
    assert memory.due(settings, 0.0)
    idle = evaluate_group(None, memory, settings, 0.0)
    assert idle.decision is None and idle.memory is memory and not idle.changed(RoleCounts(interactive=1))
    busy = MetricsSnapshot(
        ready=RoleCounts(interactive=1), instances_with_interactive=1, interactive_queued=3
    )
    step = evaluate_group(busy, memory, settings, 10.0)
    assert step.decision is not None and step.changed(RoleCounts(interactive=1))
    assert step.memory.last_eval == 10.0 and isinstance(step.memory.state, AutoscalerState)
    assert not step.memory.due(settings, 14.0) and step.memory.due(settings, 15.0)
    assert "IBP" in step.reason


# ISRTF's default text predictor loads a model; the wrapper needs no more than a constant one.
LIGHT: dict[str, dict[str, object]] = {"isrtf": {"predictor": "constant"}}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_wrapper_runs_around_every_policy(name: str) -> None:
    """Interactive requests arriving on an instance busy with batch work run under every inner policy;
    every request finishes and the wrapper's class counters return to zero."""
    profile = load_profile("a100-llama3-8b")
    inter = ServiceClass("interactive", "interactive", ttft_slo_s=10, itl_slo_s=0.2)
    batch = ServiceClass("batch", "batch", deadline_s=600, itl_slo_s=2.0)
    reqs = build_requests([0.0] * 6 + [0.5, 0.6], [100] * 8, [60] * 8, np.random.default_rng(0))
    for r in reqs:
        r.service_class = batch if r.arrival == 0.0 else inter
    policies: list[ChironPolicy] = []

    def factory() -> ChironPolicy:
        inner = make_policy(name, **LIGHT.get(name, {}))
        policies.append(ChironPolicy(inner, ChironLocal(min_batch=1, max_batch=8, initial=4)))
        return policies[-1]

    result = Cluster(ClusterConfig(profiles={"default": profile}, instances=1), factory).run(reqs)
    assert all(r.finished_at is not None for r in result.requests)
    assert policies[0].interactive == policies[0].batch == 0 and len(policies[0]) == 0
