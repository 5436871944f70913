"""Policies on a real engine: the worker in front of the session's vLLM server (tiny model).

The sim-engine matrix (tests/test_worker_request_matrix.py) covers every policy x request shape;
here a subset runs on real vLLM, each answer compared with what vLLM itself gives for the same
request: a chat, a text and a token-id completion, streamed and not, queued behind a long request
(so preemptive policies may displace it) under ISRTF with its text predictor, Andes (QoE), QLM and
FCFS inside Chiron's local autoscaler. Then a paced Andes stream is released at the class's reading
speed, and Chiron's local autoscaler moves the batch size on a real engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api.worker_config import parse_config
from tessera.bench.harness import WorkerChild
from tessera.worker.engines.vllm_process import VLLMServer
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
POLICIES: dict[str, dict[str, Any]] = {
    "isrtf": {"policy": "isrtf"},  # the shipped text predictor: chat needs its rendered text
    "qoe": {"policy": "qoe", "pacing": True},
    "qlm": {"policy": "qlm"},
    "fcfs+chiron": {"policy": "fcfs", "autoscale": {"enabled": True}},
}


def _worker(url: str, tokenizer: Path, scheduling: dict[str, Any], classes: dict[str, Any]) -> Worker:
    model = {
        "name": TINY_MODEL_NAME,
        "url": url,
        "maxModelLen": TINY_MAX_MODEL_LEN,
        "tokenizer": str(tokenizer),
    }
    return Worker(parse_config({"models": [model], "classes": classes, "scheduling": scheduling}))


def _ids(resp: httpx.Response, stream: bool) -> list[int]:
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["token_ids"]
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    ids: list[int] = []
    for ln in lines[:-1]:
        for choice in json.loads(ln[6:])["choices"]:
            ids += choice.get("token_ids") or []
    return ids


def _shapes(n: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of each request shape, streamed and not."""
    base = [
        ("completion-text", "/v1/completions", {"prompt": "Tell me a story"}),
        ("completion-ids", "/v1/completions", {"prompt": [0, 72, 105, 33]}),
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Capital of France?"}]}),
    ]
    out = []
    for name, path, body in base:
        for stream in (False, True):
            full = {"model": TINY_MODEL_NAME, "max_tokens": n, **SAMPLING, **body}
            if stream:
                full["stream"] = True
            out.append((f"{name}{'-stream' if stream else ''}", path, full))
    return out


@pytest.mark.parametrize("policy", list(POLICIES))
async def test_policy_serves_every_shape_with_vllms_own_tokens(
    policy: str, vllm_server: VLLMServer, tiny_model_dir: Path
) -> None:
    n = 6
    shapes = _shapes(n)
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as direct:
        expected = {}
        for name, path, body in shapes:
            if not body.get("stream"):
                resp = await direct.post(path, json=body)
                expected[name] = expected[f"{name}-stream"] = _ids(resp, False)
    assert all(len(ids) == n for ids in expected.values())

    scheduling = {"batch": {"min": 1, "max": 1, "initial": 1}, **POLICIES[policy]}
    classes = {"chat": {"slo": {"ttftSeconds": 30, "itlSeconds": 5}}}
    worker = _worker(vllm_server.url, tiny_model_dir, scheduling, classes)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=120) as c:
            long_body = {"model": TINY_MODEL_NAME, "prompt": [0, 5, 6, 7], "max_tokens": 60, **SAMPLING}
            long = asyncio.create_task(c.post("/v1/completions", json=long_body))
            await asyncio.sleep(0.2)
            answers = await asyncio.wait_for(asyncio.gather(*(c.post(p, json=b) for _, p, b in shapes)), 180)
            for (name, _, body), resp in zip(shapes, answers, strict=True):
                assert _ids(resp, bool(body.get("stream"))) == expected[name], f"{policy} {name}"
            assert len(_ids(await asyncio.wait_for(long, 180), False)) == 60
            metrics = (await c.get("/metrics")).text
            assert f'tessera_decision_failures_total{{model="{TINY_MODEL_NAME}"}} 0.0' in metrics
        if policy == "isrtf":  # every shape's prompt text reached the text predictor
            assert worker.scheduler.policy.fallback_predictions == 0
    finally:
        await worker.stop()


def test_paced_qoe_stream_is_released_at_the_reading_speed(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Andes' token pacer: tokens reach the client no faster than the class's reading speed, although
    vLLM generates them much faster; the tokens are vLLM's own. A worker process over real HTTP (an
    in-process ASGI transport would buffer the stream and hide its timing)."""
    n, speed = 16, 8.0
    body = {"model": TINY_MODEL_NAME, "prompt": [0, 9, 10, 11], "max_tokens": n, **SAMPLING}
    start = time.monotonic()
    expected = _ids(httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120), False)
    unpaced_s = time.monotonic() - start
    model = {"name": TINY_MODEL_NAME, "url": vllm_server.url, "maxModelLen": TINY_MAX_MODEL_LEN}
    classes = {"chat": {"slo": {"ttftSeconds": 30}, "qoe": {"readingSpeedTokensPerSecond": speed}}}
    config = {"models": [model], "classes": classes, "scheduling": {"policy": "qoe", "pacing": True}}
    worker = WorkerChild(config, tmp_path)
    arrivals: list[float] = []
    ids: list[int] = []
    try:
        with httpx.stream(
            "POST", f"{worker.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    ids += got
                    arrivals += [time.monotonic()] * len(got)
    finally:
        worker.stop()
    assert ids == expected
    paced_s = arrivals[-1] - arrivals[0]
    # n tokens at `speed` per second: the last leaves (n - 1) / speed after the first (small slack
    # for timer jitter); vLLM alone produced all of them well within that.
    assert paced_s >= 0.9 * (n - 1) / speed, (paced_s, unpaced_s)
    assert unpaced_s < paced_s / 2, (paced_s, unpaced_s)


async def test_chiron_moves_the_batch_size_on_a_real_engine(
    vllm_server: VLLMServer, tiny_model_dir: Path
) -> None:
    """Chiron's local autoscaler, starting at batch 1 with an ITL SLO the tiny model easily meets,
    grows the batch size under a backlog; the worker never has more requests in vLLM than that size,
    and the size it chose is in /metrics."""
    scheduling = {
        "policy": "fcfs",
        "batch": {"min": 1, "max": 16, "initial": 1},
        "autoscale": {
            "enabled": True,
            "minIterations": 4,
            "minIntervalSeconds": 0.1,
            "interactiveItlSloSeconds": 2,
        },
    }
    worker = _worker(vllm_server.url, tiny_model_dir, scheduling, {"chat": {"slo": {"ttftSeconds": 60}}})
    app = create_app(worker, manage_worker=False)
    await worker.start()
    sched = worker.scheduler
    sizes: list[int] = []
    overfull: list[tuple[int, int]] = []

    async def watch() -> None:
        while True:
            size = sched.batch_size
            sizes.append(size)
            if len(sched.inflight) > size:
                overfull.append((len(sched.inflight), size))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=300) as c:
            body = {"model": TINY_MODEL_NAME, "prompt": [0, 20, 21], "max_tokens": 24, **SAMPLING}
            done = await asyncio.wait_for(
                asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(24))), 300
            )
            assert [r.status_code for r in done] == [200] * 24
            metrics = (await c.get("/metrics")).text
    finally:
        watcher.cancel()
        await worker.stop()
    assert sizes[0] == 1 and max(sizes) > 1, sizes
    assert not overfull
    gauge = next(ln for ln in metrics.splitlines() if ln.startswith("tessera_batch_size{"))
    assert 1 <= float(gauge.rsplit(" ", 1)[1]) <= 16
