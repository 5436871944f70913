"""Chiron's local autoscaler inside the worker (sim engine): the batch size moves.

The worker decides at changes of the running set, so at batch size 1 every decision comes right
after a finish, with nothing running. The autoscaler must still see the finished requests' tokens,
the ITL level of the held requests and a full batch, or the batch size could never leave 1.
"""

from __future__ import annotations

import asyncio

import httpx

from tessera.api.worker_config import parse_config
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app


async def test_batch_size_grows_from_one_under_a_backlog() -> None:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "classes": {"chat": {"slo": {"ttftSeconds": 60}}},
            "scheduling": {
                "policy": "fcfs",
                "batch": {"min": 1, "max": 16, "initial": 1},
                "autoscale": {"enabled": True, "minIterations": 4, "minIntervalSeconds": 0.05},
            },
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    sched = worker.scheduler
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 24}
            done = await asyncio.wait_for(
                asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8))), 60
            )
            assert [r.status_code for r in done] == [200] * 8
            metrics = (await c.get("/metrics")).text
        grown = sched.policy.local.history
        assert grown and grown[0][1] > 1, grown
        assert f'tessera_batch_size{{model="m"}} {float(sched.batch_size)}' in metrics
    finally:
        await worker.stop()
