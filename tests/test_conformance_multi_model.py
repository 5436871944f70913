"""Conformance of the two shells on instances of several models: the simulator's co-resident instance
(``tessera.sim.coresident``) and the worker's one ``InstanceScheduler`` over sim engines.

The simulator runs a trace of 2 and 3 models to the end; at each of its decision points the worker's
scheduler is brought to the same state (the same requests submitted, one token per instance iteration
to every in-flight stream, finished streams ended, the clock at the same time) and asked to decide. The
views the policy gets are equal in every field, each engine's ``ModelView`` included, so both shells
apply the same sequence of decisions (run sets, preemptions), which is compared too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from scheduler_harness import SetClock, replay_decisions, run_iterations

from tessera.api.worker_config import AutoscaleSpec, BatchBounds
from tessera.core.policy import Decision, InstanceView, Policy
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.coresident import CoResidentInstance
from tessera.sim.engine import EngineConfig, SimInstance
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import InstanceScheduler, Job

CHAT = ServiceClass("chat", ttft_slo_s=1.0)
BULK = ServiceClass("bulk", kind="batch", deadline_s=60.0)
PROFILES = {
    "a": StepProfile("a", 0.001, 0.0001, 0.0, 0.001, 0.00001, kv_capacity_tokens=4_096, block_size=16),
    "b": StepProfile("b", 0.003, 0.0002, 0.0, 0.002, 0.00002, kv_capacity_tokens=2_048, block_size=16),
    "c": StepProfile("c", 0.002, 0.0001, 0.0, 0.001, 0.00001, kv_capacity_tokens=1_024, block_size=32),
}
MAX_BATCH, MAX_RUNNING = 4, 3
# (model, prompt tokens, output tokens, class) of each request; all arrive at 0
TRACE = [
    ("a", 20, 30, BULK), ("b", 33, 8, CHAT), ("c", 17, 12, CHAT), ("a", 40, 6, CHAT), ("b", 25, 40, BULK),
    ("c", 31, 7, BULK), ("a", 12, 15, CHAT), ("b", 18, 5, CHAT), ("c", 50, 20, BULK), ("a", 22, 9, BULK),
]  # fmt: skip


class Recorder(Policy):
    """Wraps a policy; records each view as it was and each decision's run."""

    name = "recorder"

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.snapshots: list[dict[str, Any]] = []
        self.views: list[InstanceView] = []
        self.runs: list[list[str]] = []

    def add(self, req: Request, now: float) -> None:
        """Delegated."""
        self.inner.add(req, now)

    def remove(self, req: Request, now: float) -> None:
        """Delegated."""
        self.inner.remove(req, now)

    def observe(self, view: InstanceView) -> None:
        """Recorded, delegated."""
        self.views.append(view)
        self.snapshots.append(_comparable(view))
        self.inner.observe(view)

    def schedule(self, view: InstanceView) -> Decision:
        """Delegated, recorded."""
        decision = self.inner.schedule(view)
        self.runs.append([r.id for r in decision.run])
        return decision

    def __len__(self) -> int:
        return len(self.inner)


def _comparable(view: InstanceView) -> dict[str, Any]:
    out = {f.name: getattr(view, f.name) for f in dataclasses.fields(view)}
    out["running"] = [(r.id, r.model, r.generated, r.phase, r.kv_resident) for r in view.running]
    out["models"] = dict(view.models)
    return out


def _requests(models: tuple[str, ...]) -> list[Request]:
    return [
        Request(f"r{i}", 0.0, p, n, model=m, service_class=c, true_output_tokens=n)
        for i, (m, p, n, c) in enumerate(TRACE)
        if m in models
    ]


@pytest.mark.parametrize("models", [("a", "b"), ("a", "b", "c")], ids=["2-models", "3-models"])
@pytest.mark.parametrize("policy", ["seallm", "qlm", "round-robin-sharing", "fcfs"])
async def test_a_co_resident_trace_gives_the_same_views_and_decisions(
    policy: str, models: tuple[str, ...]
) -> None:
    profiles = {m: PROFILES[m] for m in models}
    config = EngineConfig(
        max_batch=MAX_BATCH, chunked_prefill=True, swap_space_tokens=0, co_resident=True,
        max_running=MAX_RUNNING,
    )  # fmt: skip
    sim_rec = Recorder(make_policy(policy))
    inst = CoResidentInstance("+".join(models), profiles, sim_rec, config)
    for req in _requests(models):
        inst.add(req, 0.0)
    while inst.seg is not None:
        inst.advance()
    assert all(r.finished for r in inst.assigned) and not inst.assigned
    assert len(sim_rec.views) >= 5
    # the trace exercises what a shared instance decides: several engines busy at once, and a batch
    # that cannot hold every request
    assert any(len({r.model for r in v.running}) > 1 for v in sim_rec.views)

    clock = SetClock()
    worker_rec = Recorder(make_policy(policy))
    sched = InstanceScheduler(
        {m: SimEngine(m, p, 4096) for m, p in profiles.items()},
        worker_rec,
        profiles=profiles,
        batch=BatchBounds(max=MAX_BATCH),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        max_running=dict.fromkeys(models, MAX_RUNNING),
        metrics=WorkerMetrics(),
        clock=clock,
    )
    jobs = [Job(req, list(range(1, req.prompt_tokens + 1)), {}) for req in _requests(models)]
    for job in jobs:
        sched.submit(job)
    try:
        replay_decisions(sched, sim_rec.views, sim_rec.snapshots, worker_rec.snapshots, clock)
    finally:
        await sched.stop()
    assert worker_rec.runs == sim_rec.runs
    assert len(worker_rec.views) == len(sim_rec.views)


@pytest.mark.parametrize("models", [("a", "b"), ("a", "b", "c")], ids=["2-models", "3-models"])
@pytest.mark.parametrize("policy", ["seallm", "qlm", "round-robin-sharing", "fcfs"])
async def test_a_swapping_trace_gives_the_same_views_decisions_and_swaps(
    policy: str, models: tuple[str, ...]
) -> None:
    """The same on an instance whose engines sleep: one model awake at a time, ``load_model`` (or, with
    none asked, the model of the work the decision names) swaps; the worker's swap is awaited where
    the simulator's instance is busy loading."""
    from tessera.sim.engine import SimInstance
    from tessera.worker.swap import ModelSwapper

    profiles = {m: dataclasses.replace(PROFILES[m], weights_bytes=1_000_000) for m in models}  # 1 ms swaps
    config = EngineConfig(max_batch=MAX_BATCH, chunked_prefill=True, swap_space_tokens=0)
    sim_rec = Recorder(make_policy(policy))
    inst = SimInstance("+".join(models), profiles, sim_rec, config)
    for req in _requests(models):
        inst.add(req, 0.0)
    while inst.seg is not None:
        inst.advance()
    assert not inst.assigned and inst.model_swaps >= len(models) - 1
    actives = [v.active_model for v in sim_rec.views]

    now = 0.0
    worker_rec = Recorder(make_policy(policy))
    engines = {m: SimEngine(m, p, 4096, supports_sleep=True) for m, p in profiles.items()}
    for engine in engines.values():
        await engine.start()
    swapper = ModelSwapper(engines, WorkerMetrics())
    await swapper.start()
    sched = InstanceScheduler(
        engines,
        worker_rec,
        profiles=profiles,
        batch=BatchBounds(max=MAX_BATCH),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        metrics=swapper.metrics,
        swapper=swapper,
        clock=lambda: now,
    )
    assert sched.mode == "swapping"
    jobs = [Job(req, list(range(1, req.prompt_tokens + 1)), {}) for req in _requests(models)]
    for job in jobs:
        sched.submit(job)
    iteration = 0
    try:
        for n, (sim_view, sim_snapshot) in enumerate(zip(sim_rec.views, sim_rec.snapshots, strict=True)):
            run_iterations(sched, sim_view.iteration - iteration)
            iteration = sim_view.iteration
            now = sim_view.now
            while swapper.swapping:  # the simulator's instance was busy loading meanwhile
                assert swapper._task is not None
                await swapper._task
            sched.decide()
            assert worker_rec.snapshots[-1] == sim_snapshot, f"decision {n + 1}"
    finally:
        await sched.stop()
        for engine in engines.values():
            await engine.close()
    assert worker_rec.runs == sim_rec.runs
    assert swapper.swaps == inst.model_swaps
    assert [v.active_model for v in worker_rec.views] == actives


# A base and three LoRA adapters of it on one engine, two GPU slots: (model, prompt, output, class).
LORA_TRACE = [
    ("a1", 20, 12, CHAT), ("a2", 33, 8, CHAT), ("a3", 17, 10, CHAT), ("base", 40, 6, CHAT),
    ("a1", 25, 9, BULK), ("a3", 31, 7, BULK), ("a2", 12, 15, CHAT), ("base", 18, 5, BULK),
]  # fmt: skip
LORA_ADAPTERS = {"a1": "a", "a2": "a", "a3": "a"}


def _lora_requests() -> list[Request]:
    return [
        Request(f"r{i}", 0.0, p, n, model="a" if m == "base" else m, service_class=c, true_output_tokens=n)
        for i, (m, p, n, c) in enumerate(LORA_TRACE)
    ]


@pytest.mark.parametrize("policy", ["fcfs", "edf", "qoe", "qlm", "seallm"])
async def test_a_trace_of_lora_adapters_gives_the_same_views_and_decisions(policy: str) -> None:
    """Adapters are models of their base's engine in both shells: the same views (one engine, the
    adapters and their slots), the same decisions, and never more adapters in a batch than slots."""
    profile = PROFILES["a"]
    requests = _lora_requests()
    config = EngineConfig(max_batch=MAX_BATCH, chunked_prefill=True, swap_space_tokens=0, max_loras=2,
                          max_cpu_loras=3)  # fmt: skip
    sim_rec = Recorder(make_policy(policy))
    inst = SimInstance("a+a1+a2+a3", {"a": profile}, sim_rec, config, adapters=LORA_ADAPTERS)
    for req in requests:
        inst.add(req, 0.0)
    while inst.seg is not None:
        inst.advance()
        assert len({r.model for r in inst.running} & set(LORA_ADAPTERS)) <= 2
    assert len(sim_rec.views) >= 4
    assert all(v.adapter_of == LORA_ADAPTERS and v.max_loras == 2 for v in sim_rec.views)
    # the slots bind: two adapters run together while the third's requests wait
    assert any(len({r.model for r in v.running} & set(LORA_ADAPTERS)) == 2 for v in sim_rec.views)

    clock = SetClock()
    worker_rec = Recorder(make_policy(policy))
    models = ["a", *LORA_ADAPTERS]
    sched = InstanceScheduler(
        {m: SimEngine(m, profile, 4096) for m in models},
        worker_rec,
        profiles=dict.fromkeys(models, profile),
        batch=BatchBounds(max=MAX_BATCH),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        metrics=WorkerMetrics(),
        clock=clock,
        adapter_of=LORA_ADAPTERS,
        max_loras={"a": 2},
        adapter_cache={"a": 3},
    )
    for req in _lora_requests():
        sched.submit(Job(req, list(range(1, req.prompt_tokens + 1)), {}))
    try:
        replay_decisions(sched, sim_rec.views, sim_rec.snapshots, worker_rec.snapshots, clock)
    finally:
        await sched.stop()
    assert worker_rec.runs == sim_rec.runs
