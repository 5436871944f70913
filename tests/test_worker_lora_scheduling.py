"""LoRA adapters in the pod's scheduler: models of the pod that run in their base's engine.

A pod serving a base and three adapters of it, with two GPU slots (``maxLoras``) and room for two
loaded adapters (``maxCpuLoras``): one engine in the view (one KV pool, one sequence limit), never
more than two adapters in flight, and an adapter the engine does not hold is loaded first (the LRU
idle one unloaded), its requests waiting meanwhile while the others go on.
"""

from __future__ import annotations

import asyncio

from scheduler_harness import run_iterations

from tessera.api.worker_config import AutoscaleSpec, BatchBounds
from tessera.core.lora import batch_adapters
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.worker.engines.base import EngineRejected
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import InstanceScheduler, Job

BASE = "base"
ADAPTERS = {"a1": BASE, "a2": BASE, "a3": BASE}
PROFILE = StepProfile(BASE, 0.001, 0.0001, 0.0, 0.001, 0.00001, kv_capacity_tokens=4_096, block_size=16)
CHAT = ServiceClass("chat", ttft_slo_s=1.0)


def _pod(
    loads: list[tuple[str, bool]],
    *,
    fail: str = "",
    max_running: int | None = None,
    clock: list[float] | None = None,
    unload_after: dict[str, float] | None = None,
) -> InstanceScheduler:
    async def loader(adapter: str, load: bool) -> None:
        loads.append((adapter, load))
        if adapter == fail:
            raise EngineRejected(f"the engine refused the adapter {adapter}")

    models = [BASE, *ADAPTERS]
    return InstanceScheduler(
        {m: SimEngine(m, PROFILE, 4096) for m in models},
        make_policy("fcfs"),
        profiles=dict.fromkeys(models, PROFILE),
        batch=BatchBounds(max=8),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        max_running={BASE: max_running} if max_running else None,
        metrics=WorkerMetrics(),
        clock=(lambda: clock[0]) if clock else (lambda: 0.0),
        adapter_of=ADAPTERS,
        max_loras={BASE: 2},
        adapter_cache={BASE: 2},
        adapter_loader=loader,
        unload_after=unload_after,
    )


def _submit(sched: InstanceScheduler, models: list[str], tokens: int = 4) -> list[Job]:
    jobs = []
    for i, model in enumerate(models):
        req = Request(f"{model}-{i}", 0.0, 16, tokens, model=model, service_class=CHAT)
        job = Job(req, list(range(1, 17)), {})
        sched.submit(job)
        jobs.append(job)
    return jobs


def _adapters_in_flight(sched: InstanceScheduler) -> set[str]:
    return set(batch_adapters((j.req for j in sched.inflight), ADAPTERS))


async def test_adapters_share_their_base_engine_in_the_view() -> None:
    sched = _pod([])
    try:
        assert sched.mode == "single"  # one engine, however many adapters
        _submit(sched, ["a1", "a2", BASE])
        sched.decide()
        view = sched._view(0.0)
        assert not view.models and view.active_model == BASE
        assert view.adapter_of == ADAPTERS and view.max_loras == 2
        assert view.kv_capacity_tokens == 4_096  # one KV pool, counted once
        assert len(view.running) == 3
        # the three requests' KV blocks, all in the base's pool
        assert view.kv_used_tokens == 3 * 2 * 16
    finally:
        await sched.stop()


async def test_a_batch_never_mixes_more_adapters_than_slots_and_a_third_is_loaded_on_demand() -> None:
    loads: list[tuple[str, bool]] = []
    sched = _pod(loads)
    try:
        jobs = _submit(sched, ["a1", "a2", "a3", BASE, "a1", "a3"], tokens=3)
        seen = []
        for _ in range(40):
            sched.decide()
            assert len(_adapters_in_flight(sched)) <= 2
            seen.append(_adapters_in_flight(sched))
            await asyncio.sleep(0)  # a load under way completes
            run_iterations(sched, 1)
            if all(j.done.is_set() for j in jobs):
                break
        assert all(j.done.is_set() and j.error is None for j in jobs)
        assert {"a1", "a2"} in seen  # two adapters did run together
        # a3 was not held: the least recently used idle adapter made room, then a3 was loaded
        (evicted, unload), load = loads
        assert load == ("a3", True) and unload is False and evicted in {"a1", "a2"}
        assert sched.adapter_loads == 1
        assert sched.adapter_caches[BASE].resident == ({"a1", "a2"} - {evicted}) | {"a3"}
    finally:
        await sched.stop()


async def test_a_failed_adapter_load_ends_only_that_adapter_s_requests() -> None:
    loads: list[tuple[str, bool]] = []
    sched = _pod(loads, fail="a3")
    try:
        jobs = _submit(sched, ["a3", BASE, "a1"], tokens=2)
        for _ in range(20):
            sched.decide()
            await asyncio.sleep(0)
            run_iterations(sched, 1)
            if all(j.done.is_set() for j in jobs):
                break
        a3, base, a1 = jobs
        assert isinstance(a3.error, EngineRejected) and "a3" in str(a3.error)
        assert base.error is None and a1.error is None and base.done.is_set() and a1.done.is_set()
        assert "a3" not in sched.adapter_caches[BASE]
    finally:
        await sched.stop()


async def test_the_base_s_sequence_limit_counts_its_adapters() -> None:
    sched = _pod([], max_running=2)
    try:
        _submit(sched, ["a1", BASE, "a2", BASE])
        sched.decide()
        assert len(sched.inflight) == 2
    finally:
        await sched.stop()


async def test_an_idle_adapter_is_unloaded_after_its_bound_and_loaded_again_by_a_request() -> None:
    loads: list[tuple[str, bool]] = []
    clock = [0.0]
    sched = _pod(loads, clock=clock, unload_after={"a1": 60.0})
    try:
        jobs = _submit(sched, ["a1"], tokens=1)
        sched.decide()
        run_iterations(sched, 1)
        assert jobs[0].done.is_set()
        sched.decide()  # idle from now
        clock[0] = 59.0
        sched.decide()
        assert "a1" in sched.adapter_caches[BASE] and loads == []
        clock[0] = 60.5
        sched.decide()
        await asyncio.sleep(0)
        assert loads == [("a1", False)] and "a1" not in sched.adapter_caches[BASE]
        assert "a2" in sched.adapter_caches[BASE]  # no bound: stays
        again = _submit(sched, ["a1"], tokens=1)
        sched.decide()
        assert not sched.inflight  # loading first
        await asyncio.sleep(0)
        sched.decide()
        assert loads[-1] == ("a1", True) and again[0] in sched.inflight
    finally:
        await sched.stop()
