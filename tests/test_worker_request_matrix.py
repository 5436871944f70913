"""Every policy serves every request shape through the worker's HTTP layer (sim engine).

Each policy gets a worker whose only slot is taken by a long request first, so the rest queue behind
it (and preemptive policies may displace it); then a completion with a text prompt, one with token
ids and a chat request, streamed and not, arrive together. Every answer must be a 200 with exactly
the tokens the deterministic simulated model gives for that prompt, however often it was preempted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tessera.api.worker_config import parse_config
from tessera.worker.engines.sim_realtime import next_token
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

# Policy configurations a worker can run without benchmark hints (oracles need true lengths).
POLICIES: dict[str, dict[str, Any]] = {
    "fcfs": {"policy": "fcfs"},
    "edf": {"policy": "edf"},
    "edf-late-last": {"policy": "edf", "settings": {"lateLast": True}},  # late ones set back, all served
    "isrtf": {"policy": "isrtf"},  # the text predictor: needs a prompt text for every shape
    "isrtf-running-mean": {"policy": "isrtf", "settings": {"predictor": "running-mean", "window_tokens": 2}},
    "qoe": {"policy": "qoe"},
    "qlm": {"policy": "qlm"},  # late ones set back, bounded
    "qlm-unbounded-late-evict-streams": {
        "policy": "qlm",
        "settings": {"lateSetBackS": None, "evictStreams": True},
    },
    "qlm-late-first": {"policy": "qlm", "settings": {"lateLast": False}},
    "seallm": {"policy": "seallm"},
    "fcfs+chiron": {"policy": "fcfs", "autoscale": {"enabled": True}},
}
MAX_TOKENS = 6


def _tokens(text: str) -> list[int]:
    """The sim engine's tokenizer (BOS 0, then one id per byte shifted past the specials)."""
    return [0, *(b + 3 for b in text.encode())]


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def _shapes() -> list[tuple[str, str, dict[str, Any], list[int]]]:
    """(name, path, body, prompt ids the engine sees) for each request shape, streamed and not."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = _tokens("user: What is the capital of France?\nassistant:")
    base: list[tuple[str, str, dict[str, Any], list[int]]] = [
        ("completion-text", "/v1/completions", {"prompt": "Tell me a story"}, _tokens("Tell me a story")),
        ("completion-ids", "/v1/completions", {"prompt": [72, 105, 33]}, [72, 105, 33]),
        ("chat", "/v1/chat/completions", {"messages": messages}, chat_ids),
    ]
    out = []
    for name, path, body, ids in base:
        for stream in (False, True):
            full = {"model": "m", "max_tokens": MAX_TOKENS, "return_token_ids": True, **body}
            if stream:
                full["stream"] = True
            out.append((f"{name}{'-stream' if stream else ''}", path, full, ids))
    return out


def _answer_ids(resp: httpx.Response, stream: bool) -> list[int]:
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        for choice in json.loads(ln[6:])["choices"]:
            ids += choice.get("token_ids") or []
    return ids


@pytest.mark.parametrize("policy", list(POLICIES))
async def test_every_policy_serves_every_request_shape(policy: str) -> None:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "classes": {"chat": {"slo": {"ttftSeconds": 1, "itlSeconds": 0.1}}},
            "scheduling": {"batch": {"min": 1, "max": 1, "initial": 1}, **POLICIES[policy]},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            long_body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 40, "return_token_ids": True}
            long = asyncio.create_task(c.post("/v1/completions", json=long_body))
            await asyncio.sleep(0.05)
            shapes = _shapes()
            answers = await asyncio.wait_for(
                asyncio.gather(*(c.post(path, json=body) for _, path, body, _ in shapes)), 60
            )
            for (name, _, body, ids), resp in zip(shapes, answers, strict=True):
                got = _answer_ids(resp, bool(body.get("stream")))
                assert got == _expected(ids, MAX_TOKENS), f"{policy} {name}"
            assert _answer_ids(await asyncio.wait_for(long, 60), False) == _expected([5, 6, 7], 40)
            metrics = (await c.get("/metrics")).text
            assert 'tessera_decision_failures_total{model="m"} 0.0' in metrics
            assert (await c.get("/ready")).status_code == 200
    finally:
        await worker.stop()


async def test_isrtf_worker_serves_a_chat_request_and_the_completion_behind_it() -> None:
    """A chat request must not stall an ISRTF worker (its text predictor needs the prompt's text)."""
    config = parse_config(
        {"models": [{"name": "m", "engine": "sim", "maxModelLen": 512}], "scheduling": {"policy": "isrtf"}}
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            done = await asyncio.wait_for(
                asyncio.gather(
                    c.post("/v1/chat/completions", json=chat),
                    c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4}),
                ),
                15,
            )
        assert [r.status_code for r in done] == [200, 200]
        policy = worker.scheduler.policy
        assert policy.fallback_predictions == 0  # the chat's text reached the predictor
    finally:
        await worker.stop()


async def test_a_failing_policy_falls_back_to_arrival_order_and_reports_not_ready() -> None:
    config = parse_config({"models": [{"name": "m", "engine": "sim", "maxModelLen": 512}]})
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)

    def broken(view: object) -> object:
        raise RuntimeError("policy bug")

    await worker.start()
    sched = worker.scheduler
    sched.policy.schedule = broken  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            body = {"model": "m", "prompt": "hello", "max_tokens": 3}
            done = await asyncio.wait_for(
                asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3))), 15
            )
            assert [r.status_code for r in done] == [200, 200, 200]
            assert [r.json()["usage"]["completion_tokens"] for r in done] == [3, 3, 3]
            failures = sched.decision_failures
            assert failures >= 1
            assert (
                f'tessera_decision_failures_total{{model="m"}} {float(failures)}'
                in (await c.get("/metrics")).text
            )
            # Keeps failing: the worker says so on /ready (it still serves in arrival order).
            while sched.policy_ok:
                sched.decide()
            ready = await c.get("/ready")
            assert ready.status_code == 503 and ready.json()["policies"] == {"m": False}
    finally:
        await worker.stop()
