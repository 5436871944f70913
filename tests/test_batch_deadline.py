"""A request's own deadline (a batch line's job expiry, ``x-tessera-deadline``) orders the queues in
place of its class's: ``Request.slo_deadline``, Chiron's global queue, and a worker running EDF."""

from __future__ import annotations

import asyncio
import time

import httpx

from tessera.api.batch_link import DEADLINE_HEADER
from tessera.api.request_class import DEFAULT_CLASS_HEADER
from tessera.api.worker_config import parse_config
from tessera.core import Request, ServiceClass
from tessera.core.chiron import GlobalQueue
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

BATCH = ServiceClass("offline", "batch", deadline_s=3600.0)


def test_own_deadline_replaces_the_class_deadline() -> None:
    assert Request("a", 10.0, 5, 5, service_class=BATCH).slo_deadline == 3610.0
    assert Request("b", 10.0, 5, 5, service_class=BATCH, deadline=70.0).slo_deadline == 70.0


def test_global_queue_hands_out_the_earlier_own_deadline_first() -> None:
    queue = GlobalQueue(group_s=1.0)
    queue.push(Request("class-deadline", 0.0, 5, 5, service_class=BATCH))
    queue.push(Request("job-expiry", 5.0, 5, 5, service_class=BATCH, deadline=600.0))
    assert [queue.pop_batch().id for _ in range(2)] == ["job-expiry", "class-deadline"]


async def test_edf_worker_serves_the_line_whose_job_expires_first() -> None:
    """One batch slot, taken; a request of the batch class arrives, then one with a job expiry a minute
    away (its class's deadline is an hour): EDF serves the second first. A malformed one is refused."""
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "classes": {"offline": {"kind": "batch", "slo": {"deadlineSeconds": 3600}}},
            "scheduling": {"policy": "edf", "batch": {"min": 1, "max": 1, "initial": 1}},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    sched = worker.scheduler
    done: list[str] = []

    async def post(c: httpx.AsyncClient, name: str, max_tokens: int, deadline: str | None) -> httpx.Response:
        headers = {DEFAULT_CLASS_HEADER: "offline"} | ({DEADLINE_HEADER: deadline} if deadline else {})
        resp = await c.post("/v1/completions", json={"model": "m", "prompt": name, "max_tokens": max_tokens},
                            headers=headers)  # fmt: skip
        done.append(name)
        return resp

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            bad = await post(c, "bad", 1, "soon")
            assert bad.status_code == 400 and DEADLINE_HEADER in bad.json()["error"]["message"]
            done.clear()
            long = asyncio.create_task(post(c, "long", 60, None))
            while sched.waiting or not sched.inflight:
                await asyncio.sleep(0.01)
            late = asyncio.create_task(post(c, "class-deadline", 3, None))
            while sched.waiting < 1:
                await asyncio.sleep(0)
            soon = asyncio.create_task(post(c, "job-expiry", 3, f"{time.time() + 60:.3f}"))
            while sched.waiting < 2:
                await asyncio.sleep(0)
            assert not long.done()
            answers = await asyncio.wait_for(asyncio.gather(long, late, soon), 30)
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert done == ["long", "job-expiry", "class-deadline"]
    finally:
        await worker.stop()
