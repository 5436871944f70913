"""Chiron's local autoscaler in the worker: the batch size it chooses is published as
``tessera_batch_size`` and moves while the worker serves, and the requests in flight never exceed it
(nor ``batch.max``, the engine's ``--max-num-seqs``): the rest wait in the worker's queue."""

from __future__ import annotations

import asyncio

import httpx

from tessera.api.worker_config import parse_config
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

BATCH_MAX = 12


async def test_chiron_grows_the_published_batch_size_and_the_in_flight_cap_follows() -> None:
    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "engine": "sim",
                    "maxModelLen": 512,
                    # 4 ms decode steps: far below the 0.2 s ITL SLO, so Chiron grows the batch
                    "profile": {"decodeC0": 0.004, "decodeC1": 0.0, "prefillP0": 0.001, "prefillP1": 0.0},
                }
            ],
            "classes": {"chat": {"slo": {"ttftSeconds": 60, "itlSeconds": 0.2}}},
            "scheduling": {
                "batch": {"min": 1, "max": BATCH_MAX, "initial": 2},
                "autoscale": {"enabled": True, "minIterations": 5, "minIntervalSeconds": 0.05},
            },
        }
    )
    worker = Worker(config)
    await worker.start()
    sched = worker.scheduler
    published: list[float] = []
    over_cap = []
    try:
        transport = httpx.ASGITransport(app=create_app(worker, manage_worker=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=60) as c:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 150}
            calls = asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2 * BATCH_MAX)))
            task = asyncio.ensure_future(calls)
            while not task.done():
                metrics = (await c.get("/metrics")).text
                line = next(
                    ln for ln in metrics.splitlines() if ln.startswith('tessera_batch_size{model="m"}')
                )
                published.append(float(line.rsplit(" ", 1)[1]))
                if len(sched.inflight) > min(sched.batch_size, BATCH_MAX):
                    over_cap.append((len(sched.inflight), sched.batch_size))
                await asyncio.sleep(0.01)
            answers = await task
    finally:
        await worker.stop()
    assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 150 for a in answers)
    assert published[0] == 2 and max(published) > 2, published
    assert max(published) <= BATCH_MAX and not over_cap, over_cap
