"""The pod's queue bounds are split between tenants: one tenant's flood fills its own share of a
model's or a class's queue, never another tenant's (``tessera.core.queue_share``)."""

from __future__ import annotations

import pytest
from scheduler_harness import one_model_scheduler

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec
from tessera.core.queue_share import tenant_queue_share
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import InstanceScheduler, Job, QueueFull

CHAT = ServiceClass("chat", ttft_slo_s=2.0)
BULK = ServiceClass("bulk", kind="batch", deadline_s=600.0)


def test_a_tenant_holds_its_weighted_share_and_alone_the_whole_bound() -> None:
    assert tenant_queue_share(10, 1.0, []) == 10
    assert tenant_queue_share(10, 1.0, [1.0]) == 5
    assert tenant_queue_share(8, 3.0, [1.0]) == 6 and tenant_queue_share(8, 1.0, [3.0]) == 2
    assert tenant_queue_share(9, 1.0, [1.0, 1.0]) == 3
    assert tenant_queue_share(3, 1.0, [100.0]) == 1  # never nothing: every tenant may queue one
    with pytest.raises(ValueError, match="weights > 0"):
        tenant_queue_share(10, 0.0, [1.0])
    with pytest.raises(ValueError, match="bound >= 1"):
        tenant_queue_share(0, 1.0, [])


def _scheduler(max_queued: int, chat_limit: int | None, batch: int = 1) -> InstanceScheduler:
    profile = ProfileSpec(decode_c0=0.01, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0).to_profile(
        "m", 10**6
    )
    return one_model_scheduler(
        SimEngine("m", profile, 4096),
        make_policy("fcfs"),
        profile=profile,
        batch=BatchBounds(max=batch),
        autoscale=AutoscaleSpec(),
        max_queued=max_queued,
        class_limits={"chat": chat_limit},
        metrics=WorkerMetrics(),
    )


def _jobs(tenant: str, n: int, cls: ServiceClass = CHAT, weight: float = 1.0) -> list[Job]:
    reqs = [Request(f"{tenant}{i}", 0.0, 4, 8, model="m", service_class=cls, tenant=tenant,
                    tenant_weight=weight) for i in range(n)]  # fmt: skip
    return [Job(r, [1, 2, 3, 4], {}) for r in reqs]


def _submit(sched: InstanceScheduler, jobs: list[Job]) -> int:
    """How many of ``jobs`` the scheduler accepts, submitted one by one."""
    accepted = 0
    for job in jobs:
        try:
            sched.submit(job)
        except QueueFull:
            continue
        accepted += 1
    return accepted


async def test_a_flood_fills_its_share_of_the_class_queue_not_the_other_tenants() -> None:
    sched = _scheduler(max_queued=1000, chat_limit=10)
    try:
        assert _submit(sched, _jobs("b", 12)) == 10  # alone, b may hold the class's whole bound
        with pytest.raises(QueueFull, match="class chat is full"):
            sched.submit(_jobs("b", 1)[0])
        # a arrives at the queue b filled: it still gets its half, the flood gets nothing more
        assert _submit(sched, _jobs("a", 7)) == 5
        with pytest.raises(QueueFull, match="tenant 'a' holds its share, 5"):
            sched.submit(_jobs("a", 1)[0])
        assert _submit(sched, _jobs("b", 3)) == 0
        # another class is bounded on its own (here by the model's bound only)
        assert _submit(sched, _jobs("b", 3, BULK)) == 3
    finally:
        await sched.stop()


async def test_weights_split_the_bound_and_running_requests_free_their_place() -> None:
    sched = _scheduler(max_queued=1000, chat_limit=8, batch=2)
    try:
        assert _submit(sched, _jobs("b", 1)) == 1
        assert _submit(sched, _jobs("a", 9, weight=3.0)) == 6  # weight 3 of 4: 6 of the 8 places
        assert _submit(sched, _jobs("b", 5)) == 1  # b holds its 2
        sched.decide()  # two start (FCFS: b0, then a0): they no longer wait
        assert sum(1 for j in sched.inflight if j.req.tenant == "b") == 1
        assert _submit(sched, _jobs("b", 5)) == 1 and _submit(sched, _jobs("a", 3, weight=3.0)) == 1
    finally:
        await sched.stop()


async def test_the_models_bound_is_split_the_same_way() -> None:
    sched = _scheduler(max_queued=6, chat_limit=None)
    try:
        assert _submit(sched, _jobs("b", 8)) == 6
        assert _submit(sched, _jobs("a", 8, BULK)) == 3
        with pytest.raises(QueueFull, match="model m is full"):
            sched.submit(_jobs("a", 1)[0])
    finally:
        await sched.stop()
