"""OpenAI request features through the worker's HTTP layer on the sim engine: log probabilities (chat
and completions, continuous across a preemption), n > 1 (fanned out as scheduled requests, joined),
echo, structured outputs (forwarded; such a request is never preempted), and the named refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from test_worker_request_matrix import _expected, _tokens

from tessera.api.worker_config import BENCH_TRUE_LENGTH_HEADER, parse_config
from tessera.worker.engines.sim_realtime import token_logprob
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

TRUE = BENCH_TRUE_LENGTH_HEADER


@asynccontextmanager
async def _worker(
    queue: dict[str, Any] | None = None, **scheduling: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Worker]]:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "classes": {"chat": {"slo": {"ttftSeconds": 5}, **({"queue": queue} if queue else {})}},
            "scheduling": {"batch": {"min": 1, "max": 1, "initial": 1}, **scheduling},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            yield c, worker
    finally:
        await worker.stop()


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


async def test_logprobs_in_the_openai_shapes_streamed_or_not() -> None:
    chat_ids = _tokens("user: Hi\nassistant:")
    want = [token_logprob(t, 2) for t in _expected(chat_ids, 4)]
    async with _worker() as (c, _):
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        chat = (
            await c.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2})
        ).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert [(x["token"], x["logprob"]) for x in content] == [(w.token, w.logprob) for w in want]
        assert content[0]["bytes"] == list(want[0].token.encode())
        assert [[(y["token"], y["logprob"]) for y in x["top_logprobs"]] for x in content] == [
            list(w.top[:2]) for w in want
        ]
        plain = (await c.post("/v1/chat/completions", json={**body, "logprobs": True})).json()
        assert all(x["top_logprobs"] == [] for x in plain["choices"][0]["logprobs"]["content"])
        assert (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"] is None
        streamed_body = {**body, "logprobs": True, "top_logprobs": 2, "stream": True}
        streamed = _events(await c.post("/v1/chat/completions", json=streamed_body))
        got = [
            x
            for e in streamed
            for ch in e["choices"]
            if ch.get("logprobs")
            for x in ch["logprobs"]["content"]
        ]
        assert got == content

        prompt = {"model": "m", "max_tokens": 3, "prompt": "ab", "logprobs": 1}
        comp = (await c.post("/v1/completions", json=prompt)).json()["choices"][0]
        want = [token_logprob(t, 1) for t in _expected(_tokens("ab"), 3)]
        lp = comp["logprobs"]
        assert lp["tokens"] == [w.token for w in want] and comp["text"] == "".join(lp["tokens"])
        assert lp["token_logprobs"] == [w.logprob for w in want]
        assert lp["top_logprobs"] == [dict(w.top) for w in want]
        assert lp["text_offset"] == [0, len(want[0].token), len(want[0].token) + len(want[1].token)]
        chunks = _events(await c.post("/v1/completions", json={**prompt, "stream": True}))
        offsets = [
            o for e in chunks for ch in e["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]
        ]
        assert offsets == lp["text_offset"]


async def test_logprobs_of_a_preempted_request_continue_where_it_stopped() -> None:
    async with _worker(policy="srtf-oracle", benchHints=True) as (c, worker):
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 40, "logprobs": 0, "return_token_ids": True}
        long = asyncio.create_task(c.post("/v1/completions", json=body, headers={TRUE: "40"}))
        sched = worker.scheduler
        while not sched.inflight or next(iter(sched.inflight)).req.generated < 5:
            await asyncio.sleep(0.002)
        short = {"model": "m", "prompt": [8, 9], "max_tokens": 3}
        assert (await c.post("/v1/completions", json=short, headers={TRUE: "3"})).status_code == 200
        answer = (await long).json()["choices"][0]
        metrics = (await c.get("/metrics")).text
    assert 'tessera_preemptions_total{class="chat",model="m"} 1.0' in metrics
    ids = _expected([5, 6, 7], 40)
    assert answer["token_ids"] == ids
    assert answer["logprobs"]["tokens"] == [token_logprob(t, 0).token for t in ids]
    assert answer["logprobs"]["token_logprobs"] == [token_logprob(t, 0).logprob for t in ids]


async def test_structured_output_requests_are_never_preempted() -> None:
    async with _worker(policy="srtf-oracle", benchHints=True) as (c, worker):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 30, "response_format": fmt}
        long = asyncio.create_task(c.post("/v1/completions", json=body, headers={TRUE: "30"}))
        sched = worker.scheduler
        while not sched.inflight:
            await asyncio.sleep(0.002)
        job = next(iter(sched.inflight))
        assert job.pinned and job.sampling["response_format"] == fmt
        short = {"model": "m", "prompt": [8, 9], "max_tokens": 3}
        short_task = asyncio.create_task(c.post("/v1/completions", json=short, headers={TRUE: "3"}))
        await asyncio.sleep(0.05)
        assert job in sched.inflight and job.streams == 1  # the shorter one waits for it
        assert (await long).status_code == 200 and (await short_task).status_code == 200
        assert job.req.preemptions == 0 and job.req.finished_at is not None


async def test_n_choices_are_scheduled_requests_of_one_arrival_joined_into_one_answer() -> None:
    chat_ids = _tokens("user: Hi\nassistant:")
    async with _worker() as (c, worker):
        body = {"model": "m", "max_tokens": 3, "n": 3, "return_token_ids": True,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        seen: list[Any] = []
        sched = worker.scheduler
        submit = sched.submit
        sched.submit = lambda *jobs: (seen.extend(jobs), submit(*jobs))[1]  # type: ignore[method-assign]
        answer = (await c.post("/v1/chat/completions", json={**body, "seed": 7})).json()
        assert [ch["index"] for ch in answer["choices"]] == [0, 1, 2]
        assert all(ch["token_ids"] == _expected(chat_ids, 3) for ch in answer["choices"])
        assert answer["usage"] == {"prompt_tokens": len(chat_ids), "completion_tokens": 9,
                                   "total_tokens": len(chat_ids) + 9}  # fmt: skip
        assert len({j.req.arrival for j in seen}) == 1 and len({j.class_name for j in seen}) == 1
        assert [j.sampling["seed"] for j in seen] == [7, 8, 9]
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        events = _events(await c.post("/v1/chat/completions", json={**body, **usage}))
        ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finish = {}
        for e in events:
            for ch in e["choices"]:
                ids[ch["index"]] += ch.get("token_ids") or []
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
        assert ids == {i: _expected(chat_ids, 3) for i in range(3)}
        assert finish == {0: "length", 1: "length", 2: "length"}
        assert events[-1]["usage"]["completion_tokens"] == 9
        comp = (
            await c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2, "n": 2})
        ).json()
        assert [ch["index"] for ch in comp["choices"]] == [0, 1]


async def test_more_choices_than_the_class_may_queue_are_refused_naming_n() -> None:
    async with _worker(queue={"maxQueued": 2}) as (c, _):
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        assert (await c.post("/v1/completions", json={**body, "n": 2})).status_code == 200
        resp = await c.post("/v1/completions", json={**body, "n": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    assert "at most 2" in resp.json()["error"]["message"]


async def test_echo_prepends_the_prompt_text() -> None:
    async with _worker() as (c, _):
        body = {"model": "m", "prompt": "Say:", "max_tokens": 2}
        plain = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        echoed = (await c.post("/v1/completions", json={**body, "echo": True})).json()["choices"][0]["text"]
        assert echoed == "Say:" + plain
        events = _events(await c.post("/v1/completions", json={**body, "echo": True, "stream": True}))
        assert "".join(ch["text"] for e in events for ch in e["choices"]) == echoed


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


async def test_forced_tool_calls_are_generated_under_their_schema_and_returned_as_calls() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": PARIS}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And Rome?"},
    ]  # fmt: skip
    body = {"model": "m", "max_tokens": 4, "messages": history, "tools": TOOLS}
    async with _worker() as (c, worker):
        sched = worker.scheduler
        named = asyncio.create_task(
            c.post("/v1/chat/completions", json={**body, "tool_choice": _named("get_weather")})
        )
        while not sched.inflight:
            await asyncio.sleep(0.002)
        job = next(iter(sched.inflight))
        schema = TOOLS[0]["function"]["parameters"]
        assert job.pinned and job.sampling["response_format"]["json_schema"]["schema"] == schema
        answer = (await named).json()
        forced = {**body, "tool_choice": _named("get_weather")}
        streamed = _events(await c.post("/v1/chat/completions", json={**forced, "stream": True}))
        required = (await c.post("/v1/chat/completions", json={**body, "tool_choice": "required"})).json()
        none = (await c.post("/v1/chat/completions", json={**body, "tool_choice": "none"})).json()
    prompt = _tokens(
        "tools: get_weather\nuser: Weather in Paris?\nassistant: \ntool: sunny\nuser: And Rome?\nassistant:"
    )
    assert answer["usage"]["prompt_tokens"] == len(prompt)  # the tools were rendered with the conversation
    choice = answer["choices"][0]
    call = choice["message"]["tool_calls"][0]
    text = "".join(f" t{t}" for t in _expected(prompt, 4))  # the sim model's text: the call's arguments
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": text}
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    deltas = [
        ch["delta"]["tool_calls"][0] for e in streamed for ch in e["choices"] if ch["delta"].get("tool_calls")
    ]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("chatcmpl-tool-")
    assert "".join(d["function"]["arguments"] for d in deltas) == text
    # 'required' reads a JSON array of calls; the sim model's text is none, so there are no calls
    assert required["choices"][0]["message"]["tool_calls"] == []
    assert (
        none["choices"][0]["message"]["content"] == text and "tool_calls" not in none["choices"][0]["message"]
    )


def test_required_tool_calls_are_read_as_vllm_reads_them() -> None:
    from tessera.worker.server.app import _Render
    from tessera.worker.server.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
         "tool_choice": "required", "parallel_tool_calls": False}
    )  # fmt: skip
    schema = body.tool_schema()
    assert (
        schema is not None
        and schema["maxItems"] == 1
        and schema["items"]["anyOf"][0]["required"]
        == [
            "name",
            "parameters",
        ]
    )
    render = _Render(True, body, "")
    render.texts[0] = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert [c["function"] for c in render.calls(0)] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]
    assert render.finish(0, "stop") == "tool_calls" and render.finish(0, "length") == "length"


@pytest.mark.parametrize(
    ("path", "extra", "named"),
    [
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "'auto'"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "auto"}, "tool parser"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice needs tools"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": _named("nope")}, "'nope', which is not in"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "send tools and tool_choice"),
        ("/v1/completions", {"tools": TOOLS}, "served on /v1/chat/completions"),
        ("/v1/chat/completions", {"echo": True}, "echo is served on /v1/completions only"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "echo with logprobs"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ("/v1/completions", {"response_format": {"type": "regex"}}, "response_format.type"),
    ],
)
async def test_what_is_not_served_is_refused_by_name(path: str, extra: dict[str, Any], named: str) -> None:
    async with _worker() as (c, _):
        base: dict[str, Any] = {"model": "m", "max_tokens": 2}
        base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
        resp = await c.post(path, json={**base, **extra})
    assert resp.status_code == 400
    assert named in resp.json()["error"]["message"]
