"""Parity: the same OpenAI requests under greedy decoding (chat, completion, logprobs, n = 2, echo, JSON
mode; streamed and not) get the same answers through the worker as from the engine directly.

- Fast: the worker on the sim engine, against the sim engine driven directly (its tokenizer, its
  stream, its log probabilities).
- Integration: the worker in front of the session's real tiny-model vLLM, against that vLLM's own
  OpenAI server.

Documented exceptions (``normalize`` leaves them out): ids and ``created`` differ; log probabilities
are compared within ``LOGPROB_TOL`` (vLLM's CPU kernels give results that vary in the last digits with
the batch a request runs in); chat ``top_logprobs`` come from the completions' candidates, which vLLM
keys by decoded text (two candidates decoding to the same text show once); n > 1 is greedy by
``top_k`` 1, since vLLM refuses it at temperature 0 (the worker serves it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

from tessera.api.worker_config import BENCH_TRUE_LENGTH_HEADER as TRUE_LENGTH
from tessera.api.worker_config import parse_config
from tessera.bench.harness import WorkerChild
from tessera.worker.engines.base import EngineJob, TokenDelta
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.engines.vllm import VLLMEngine
from tessera.worker.engines.vllm_process import VLLMServer
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

LOGPROB_TOL = 1e-3
# vLLM refuses n > 1 at temperature 0 ("n must be 1 when using greedy sampling"); top_k 1 is greedy too.
# The worker serves n > 1 at temperature 0 (n equal choices), as OpenAI does.
GREEDY_N = {"temperature": 1, "top_k": 1}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def cases(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of every request the suites send, streamed and not."""
    messages = [{"role": "user", "content": "Name three colours."}]
    base: list[tuple[str, str, dict[str, Any]]] = [
        ("chat", CHAT, {"messages": messages}),
        ("completion", COMPLETIONS, {"prompt": "The capital of France is"}),
        ("chat-logprobs", CHAT, {"messages": messages, "logprobs": True, "top_logprobs": 3}),
        ("completion-logprobs", COMPLETIONS, {"prompt": "Once upon a time", "logprobs": 2}),
        ("chat-n2", CHAT, {"messages": messages, "n": 2, **GREEDY_N}),
        ("completion-n2", COMPLETIONS, {"prompt": "Hello", "n": 2, **GREEDY_N}),
        ("completion-echo", COMPLETIONS, {"prompt": "Echo this:", "echo": True}),
        ("chat-json", CHAT, {"messages": messages, "response_format": {"type": "json_object"}}),
    ]
    out = []
    for name, path, body in base:
        full = {"model": model, "max_tokens": 8, "temperature": 0, **body}
        out.append((name, path, full))
        out.append(
            (f"{name}-stream", path, {**full, "stream": True, "stream_options": {"include_usage": True}})
        )
    return out


def normalize(path: str, resp: httpx.Response) -> dict[str, Any]:
    """The answer without what may differ: per choice its text, finish reason and log probabilities
    (token, value, candidates), and the usage; a stream's chunks are joined per choice."""
    assert resp.status_code == 200, resp.text
    chat = path == CHAT
    if resp.headers["content-type"].startswith("text/event-stream"):
        lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(ln) for ln in lines[:-1]]
    else:
        chunks = [resp.json()]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for ch in chunk["choices"]:
            into = choices.setdefault(ch["index"], {"text": "", "finish": None, "logprobs": []})
            part = ch.get("message") or ch.get("delta") or {}
            into["text"] += (part.get("content") or "") if chat else ch.get("text") or ""
            into["finish"] = ch.get("finish_reason") or into["finish"]
            lp = ch.get("logprobs")
            if lp and chat:
                into["logprobs"] += [
                    (x["token"], x["logprob"], [(y["token"], y["logprob"]) for y in x["top_logprobs"]])
                    for x in lp["content"]
                ]
            elif lp:
                tops = lp["top_logprobs"]
                into["logprobs"] += [
                    (t, v, sorted((top or {}).items()))
                    for t, v, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=True)
                ]
    usage = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} if usage else None
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def assert_same(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    """Equal answers, log probabilities within ``LOGPROB_TOL``."""
    assert got["usage"] == want["usage"], name
    assert len(got["choices"]) == len(want["choices"]), name
    for g, w in zip(got["choices"], want["choices"], strict=True):
        assert (g["text"], g["finish"]) == (w["text"], w["finish"]), name
        assert [t for t, _, _ in g["logprobs"]] == [t for t, _, _ in w["logprobs"]], name
        for (_, gv, gtop), (_, wv, wtop) in zip(g["logprobs"], w["logprobs"], strict=True):
            assert math.isclose(gv, wv, abs_tol=LOGPROB_TOL), (name, gv, wv)
            assert [t for t, _ in gtop] == [t for t, _ in wtop], name
            for (_, a), (_, b) in zip(gtop, wtop, strict=True):
                assert math.isclose(a, b, abs_tol=LOGPROB_TOL), (name, a, b)


# ------------------------------------------------------------------------------------------ sim engine


async def _sim_direct(engine: SimEngine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer the sim engine itself gives (normalized): its stream over the tokenized prompt."""
    if path == CHAT:
        ids = await engine.tokenize_chat(body["messages"])
        top = body.get("top_logprobs", 0) if body.get("logprobs") else None
    else:
        ids = await engine.tokenize(body["prompt"])
        top = body.get("logprobs")
    sampling = {} if top is None else {"logprobs": top}
    choices = []
    for _ in range(body.get("n", 1)):
        text, lps, finish = await _sim_run(engine, ids, body["max_tokens"], sampling)
        if top is not None and path == CHAT:
            lps = [(t.token, t.logprob, list(t.top[:top])) for t in lps]
        elif top is not None:
            lps = [(t.token, t.logprob, sorted(dict(t.top).items())) for t in lps]
        echo = body["prompt"] if body.get("echo") else ""
        choices.append({"text": echo + text, "finish": finish, "logprobs": lps})
    completion = body["max_tokens"] * len(choices)
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": completion,
        "total_tokens": len(ids) + completion,
    }
    return {"choices": choices, "usage": usage}


async def _sim_run(engine: SimEngine, ids: list[int], max_tokens: int, sampling: dict[str, Any]) -> Any:
    text, lps, finish = "", [], None
    async for delta in engine.stream(EngineJob("direct", ids, max_tokens, sampling)):
        text += delta.text
        lps += delta.logprobs or []
        finish = delta.finish_reason or finish
    return text, lps, finish


async def test_worker_answers_as_the_sim_engine_does_directly() -> None:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "scheduling": {"batch": {"min": 1, "max": 2, "initial": 2}},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    engine = worker.engines["m"]
    assert isinstance(engine, SimEngine)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            for name, path, body in cases("m"):
                got = normalize(path, await c.post(path, json=body))
                assert_same(got, await _sim_direct(engine, path, body), name)
    finally:
        await worker.stop()


# ---------------------------------------------------------------------------------------- real vLLM


@pytest.fixture(scope="module")
def vllm_worker(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerChild]:
    config = {
        "models": [{"name": TINY_MODEL_NAME, "url": vllm_server.url, "maxModelLen": TINY_MAX_MODEL_LEN}],
        "scheduling": {"policy": "fcfs", "batch": {"min": 1, "max": 8}},
    }
    proc = WorkerChild(config, Path(tmp_path_factory.mktemp("parity-worker")))
    yield proc
    proc.stop()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "path", "body"), cases(TINY_MODEL_NAME), ids=lambda x: x if isinstance(x, str) else ""
)
def test_worker_answers_as_vllm_does_directly(
    vllm_server: VLLMServer, vllm_worker: WorkerChild, name: str, path: str, body: dict[str, Any]
) -> None:
    got = normalize(path, httpx.post(f"{vllm_worker.url}{path}", json=body, timeout=120))
    want = normalize(path, httpx.post(f"{vllm_server.url}{path}", json=body, timeout=120))
    assert_same(got, want, name)


def hold_after(engine: VLLMEngine, tokens: int) -> asyncio.Event:
    """Make ``engine``'s next stream stop being read once ``tokens`` tokens came through, until its
    reader is cancelled (the scheduler preempting it); later streams pass through. The returned event
    is set when the hold starts.

    vLLM decodes a request on its own, however slowly the worker reads: on a loaded 2-core machine
    the test's loop and vLLM's API server stall for seconds, long enough for all of a request's
    tokens to come before a second request gets through the worker's tokenization, so a wall-clock
    trigger could find nothing left to preempt. Held, the request stays unfinished in the worker's
    view (tokens vLLM made past the hold are dropped with the stream, as any preempted stream's
    are)."""
    stream = engine.stream
    held = asyncio.Event()

    async def stream_held(job: EngineJob) -> AsyncIterator[TokenDelta]:
        read = 0
        async with contextlib.aclosing(stream(job)) as deltas:
            async for delta in deltas:
                yield delta
                read += len(delta.token_ids)
                if not held.is_set() and read >= tokens and delta.finish_reason is None:
                    held.set()
                    await asyncio.Event().wait()  # until the preemption cancels this stream

    engine.stream = stream_held
    return held


@pytest.mark.integration
async def test_logprobs_of_a_preempted_request_are_vllms_own_uninterrupted_ones(
    vllm_server: VLLMServer,
) -> None:
    config = {
        "models": [{"name": TINY_MODEL_NAME, "url": vllm_server.url, "maxModelLen": TINY_MAX_MODEL_LEN}],
        "scheduling": {"policy": "srtf-oracle", "benchHints": True, "batch": {"min": 1, "max": 1}},
    }
    worker = Worker(parse_config(config))
    app = create_app(worker, manage_worker=False)
    await worker.start()
    sched = worker.scheduler
    assert isinstance(worker.engines[TINY_MODEL_NAME], VLLMEngine)
    # The long request's stream is held after 10 tokens, so the short one always finds it running.
    held = hold_after(worker.engines[TINY_MODEL_NAME], 10)
    # Long enough that its first tokens reach the worker as several deltas, not one that ends it.
    body = {"model": TINY_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}  # fmt: skip
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=120
        ) as c:
            long = asyncio.create_task(c.post(COMPLETIONS, json=body, headers={TRUE_LENGTH: "600"}))
            holding = asyncio.create_task(held.wait())
            await asyncio.wait((long, holding), timeout=60, return_when=asyncio.FIRST_COMPLETED)
            holding.cancel()
            # The long request must be running: if it ended (or failed) first, fail here, not hang.
            assert not long.done(), normalize(COMPLETIONS, long.result())
            assert held.is_set(), "the long request never reached 10 tokens"
            assert [job.req.generated >= 10 for job in sched.inflight] == [True]
            short = {"model": TINY_MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
            # Held, the long request ends only by a preemption: without one the short never runs (and
            # the ASGI transport applies no client timeout).
            async with asyncio.timeout(60):
                answer = await c.post(COMPLETIONS, json=short, headers={TRUE_LENGTH: "2"})
            assert answer.status_code == 200
            got = normalize(COMPLETIONS, await long)
            preempted = (await c.get("/metrics")).text
    finally:
        await worker.stop()
    counted = [line for line in preempted.splitlines() if line.startswith("tessera_preemptions_total")]
    assert 'tessera_preemptions_total{class="default",model="tiny"} 1.0' in counted, counted
    async with httpx.AsyncClient(timeout=120) as direct:
        want = normalize(COMPLETIONS, await direct.post(f"{vllm_server.url}{COMPLETIONS}", json=body))
    assert_same(got, want, "preempted")


@pytest.mark.integration
def test_a_named_tool_call_is_what_vllm_generates_under_the_same_schema(
    vllm_server: VLLMServer, vllm_worker: WorkerChild
) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    body = {"model": TINY_MODEL_NAME, "max_tokens": 16, "temperature": 0, "tools": tools,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}  # fmt: skip
    forced = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    got = httpx.post(f"{vllm_worker.url}{CHAT}", json=forced, timeout=120).json()["choices"][0]
    # vLLM's own named tool_choice needs a tool parser (--enable-auto-tool-choice); the same grammar
    # through response_format, with the tools rendered (tool_choice none), is what the worker sends.
    fmt = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": params}}
    plain = {**body, "tool_choice": "none", "response_format": fmt}
    want = httpx.post(f"{vllm_server.url}{CHAT}", json=plain, timeout=120).json()["choices"][0]
    call = got["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": want["message"]["content"]}
    assert got["finish_reason"] == want["finish_reason"]
