"""tool_choice auto (the default when a request gives tools): the worker generates freely, then reads
the calls back from the text with vLLM's tool parser named by the model's toolParser, as vLLM's server
answers: tool_calls and finish_reason tool_calls, or plain content when there are none; streamed, as
the parser releases them. The sim engine's ``/reply`` answers in hermes' format. Without
a tool parser such requests are refused naming spec.model.toolParser; a bad parser name is refused by
the spec; the names the spec takes are vLLM's."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from router_harness import EXAMPLES, serve_router
from test_openai_features import TOOLS, _events
from test_worker_field_table import SERVICE

from tessera.api import LLMService, load_documents
from tessera.api.crd_check import server_side_problems
from tessera.api.worker_config import BENCH_TRUE_LENGTH_HEADER, TOOL_PARSERS, ConfigError, parse_config
from tessera.local.control_plane import LocalEngine, plan_local
from tessera.local.supervisor import Supervisor
from tessera.worker.engines.base import EngineJob
from tessera.worker.engines.sim_realtime import SimEngine, _byte_tokens
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

pytest.importorskip("vllm", reason="the tool parsers are vLLM's")

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ROME = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@asynccontextmanager
async def _worker(tool_parser: str | None = "hermes", **scheduling: Any) -> AsyncIterator[
    tuple[httpx.AsyncClient, Worker]
]:  # fmt: skip
    model: dict[str, Any] = {"name": "m", "engine": "sim", "maxModelLen": 1024}
    if tool_parser is not None:
        model["toolParser"] = tool_parser
    config = parse_config(
        {
            "models": [model],
            "classes": {"chat": {"slo": {"ttftSeconds": 5}}},
            "scheduling": {"batch": {"min": 1, "max": 1, "initial": 1}, **scheduling},
        }
    )
    worker = Worker(config)
    await worker.start()
    try:
        app = create_app(worker, manage_worker=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            yield c, worker
    finally:
        await worker.stop()


def _chat(reply: str, **extra: Any) -> dict[str, Any]:
    """A chat with tools whose answer the sim engine scripts (``/reply``)."""
    return {"model": "m", "max_tokens": 200, "tools": TOOLS,
            "messages": [{"role": "user", "content": f"/reply {reply}"}], **extra}  # fmt: skip


async def test_calls_in_the_models_format_come_back_as_tool_calls() -> None:
    async with _worker() as (c, _):
        answer = (await c.post("/v1/chat/completions", json=_chat(f"Let me look. {CALL}"))).json()
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me look. "
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert answer["usage"]["completion_tokens"] == len(f"Let me look. {CALL}")
        # tool_choice "auto" said, and two calls: both, unless parallel_tool_calls is false
        both = (await c.post("/v1/chat/completions", json=_chat(CALL + ROME, tool_choice="auto"))).json()
        assert [tc["function"]["arguments"] for tc in both["choices"][0]["message"]["tool_calls"]] == [
            '{"city": "Paris"}', '{"city": "Rome"}'
        ]  # fmt: skip
        assert both["choices"][0]["message"]["content"] is None
        one = (
            await c.post("/v1/chat/completions", json=_chat(CALL + ROME, parallel_tool_calls=False))
        ).json()
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1
        plain = (await c.post("/v1/chat/completions", json=_chat("It is sunny."))).json()["choices"][0]
        assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
        assert plain["message"]["content"] == "It is sunny."
        # n > 1: each choice read on its own
        two = (await c.post("/v1/chat/completions", json=_chat(CALL, n=2))).json()["choices"]
        assert [ch["finish_reason"] for ch in two] == ["tool_calls", "tool_calls"]
        assert two[0]["message"]["tool_calls"][0]["id"] != two[1]["message"]["tool_calls"][0]["id"]


def _streamed(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], list[str]]:
    """A streamed chat's content, call fragments and finish reasons."""
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    return "".join(d.get("content") or "" for d in deltas), calls, finishes


def _arguments(fragments: list[dict[str, Any]]) -> Any:
    return json.loads("".join(tc["function"].get("arguments", "") for tc in fragments))


async def test_streamed_the_parser_releases_content_and_calls_as_they_come() -> None:
    async with _worker() as (c, _):
        body = _chat(f"Let me look. {CALL}", stream=True, stream_options={"include_usage": True})
        events = _events(await c.post("/v1/chat/completions", json=body))
        content, calls, finishes = _streamed(events)
        assert content == "Let me look. " and finishes == ["tool_calls"]
        assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_weather"
        assert {tc["index"] for tc in calls} == {0} and _arguments(calls) == {"city": "Paris"}
        assert events[-1]["usage"]["completion_tokens"] == len(f"Let me look. {CALL}")
        # two calls, and parallel_tool_calls false: the first one's fragments only
        both = _streamed(_events(await c.post("/v1/chat/completions", json=_chat(CALL + ROME, stream=True))))
        assert {tc["index"] for tc in both[1]} == {0, 1}
        assert _arguments([tc for tc in both[1] if tc["index"] == 1]) == {"city": "Rome"}
        one = _chat(CALL + ROME, stream=True, parallel_tool_calls=False)
        assert {
            tc["index"] for tc in _streamed(_events(await c.post("/v1/chat/completions", json=one)))[1]
        } == {0}
        plain = _streamed(_events(await c.post("/v1/chat/completions", json=_chat("Sunny.", stream=True))))
        assert plain == ("Sunny.", [], ["stop"])


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_requests_are_preempted_and_resumed_and_read_whole(stream: bool) -> None:
    """Nothing shapes an auto request's text, so it is not pinned; a resumed one continues the text."""
    reply = f"Checking the weather for you now. {CALL}"
    async with _worker(policy="srtf-oracle", benchHints=True) as (c, worker):
        headers = {BENCH_TRUE_LENGTH_HEADER: str(len(reply))}
        body = _chat(reply, stream=stream)
        long = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=headers))
        sched = worker.scheduler
        while not sched.inflight or next(iter(sched.inflight)).req.generated < 5:
            await asyncio.sleep(0.002)
        job = next(iter(sched.inflight))
        assert not job.pinned and job.sampling["skip_special_tokens"] is False  # hermes asks for them
        short = {"model": "m", "prompt": [8, 9], "max_tokens": 3}
        short_headers = {BENCH_TRUE_LENGTH_HEADER: "3"}
        assert (await c.post("/v1/completions", json=short, headers=short_headers)).status_code == 200
        answer = await long
    assert job.req.preemptions == 1
    if stream:
        content, calls, finishes = _streamed(_events(answer))
        assert finishes == ["tool_calls"] and _arguments(calls) == {"city": "Paris"}
    else:
        message = answer.json()["choices"][0]["message"]
        content, calls = message["content"], message["tool_calls"]
        assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert content == "Checking the weather for you now. "


async def test_a_resumed_sim_stream_continues_its_scripted_answer() -> None:
    engine = SimEngine("m", parse_config({"models": [{"name": "m", "engine": "sim"}]}).models[0].profile
                       .to_profile("m", 65536), 1024)  # fmt: skip
    await engine.start()
    try:
        prompt = await engine.tokenize_chat([{"role": "user", "content": "/reply héllo"}])
        whole = [d async for d in engine.stream(EngineJob("a", prompt, 50))]
        assert "".join(d.text for d in whole) == "héllo" and whole[-1].finish_reason == "stop"
        ids = [t for d in whole for t in d.token_ids]
        rest = [d async for d in engine.stream(EngineJob("b", prompt + ids[:2], 50))]
        assert [t for d in rest for t in d.token_ids] == ids[2:] == _byte_tokens("héllo")[3:]
        # the preemption cut "é" in two: the resumed stream sends it whole
        assert "".join(d.text for d in whole[:2] + rest) == "héllo"
        other = await engine.tokenize_chat([{"role": "user", "content": "/reply x"},
                                            {"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "again"}])  # fmt: skip
        plain = [d async for d in engine.stream(EngineJob("c", other, 3))]
        assert plain[-1].finish_reason == "length" and plain[0].text.startswith(" t")
    finally:
        await engine.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_with_a_parser_forced_choices_are_generated_and_read_by_it(stream: bool) -> None:
    """With a tool parser, 'required' and named choices are served as vLLM's server with that parser
    serves them: hermes's structural tag (the model's own call format) goes to the engine instead of
    the worker's JSON schema, the calls are read back from the text, a named call keeps finish_reason
    stop and 'required' gets tool_calls. (The sim engine ignores the grammar; the real model's answers
    are compared with vLLM's in test_openai_smollm2.)"""
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with _worker() as (c, worker):
        engine = worker.engines["m"]
        sent: list[EngineJob] = []
        relay = engine.stream
        engine.stream = lambda job: sent.append(job) or relay(job)  # type: ignore[method-assign]
        for choice, finish in ((named, "stop"), ("required", "tool_calls")):
            answer = await c.post("/v1/chat/completions", json=_chat(CALL, tool_choice=choice, stream=stream))
            if stream:
                content, calls, finishes = _streamed(_events(answer))
                assert content == "" and calls[0]["function"]["name"] == "get_weather"
                assert _arguments(calls) == {"city": "Paris"} and finishes == [finish]
            else:
                (got,) = answer.json()["choices"]
                assert got["finish_reason"] == finish and got["message"]["content"] == ""
                (call,) = got["message"]["tool_calls"]
                assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            sampling = sent[-1].sampling
            assert "response_format" not in sampling and sampling["skip_special_tokens"] is False
            assert "<tool_call>" in sampling["structured_outputs"]["structural_tag"]


async def test_without_a_tool_parser_auto_is_refused_naming_the_setting() -> None:
    async with _worker(tool_parser=None) as (c, _):
        for body in (_chat(CALL), _chat(CALL, tool_choice="auto")):
            resp = await c.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert "spec.model.toolParser" in error["message"] and error["param"] == "tool_choice"
        forced = _chat(CALL, tool_choice="required")  # the forced calls need no parser
        assert (await c.post("/v1/chat/completions", json=forced)).status_code == 200


async def test_a_parser_the_tokenizer_cannot_serve_fails_the_start_naming_it() -> None:
    config = parse_config({"models": [{"name": "m", "engine": "sim", "toolParser": "llama3_json"}],
                           "classes": {"chat": {"slo": {"ttftSeconds": 5}}}})  # fmt: skip
    worker = Worker(config)
    with pytest.raises(ConfigError, match=r"toolParser .llama3_json..*python_tag"):
        await worker.start()
    await worker.stop()


def test_a_bad_parser_name_is_refused_by_the_spec_and_the_api_server() -> None:
    body = copy.deepcopy(SERVICE)
    body["spec"]["model"]["toolParser"] = "hermez"
    with pytest.raises(ValueError, match=r"spec.model.toolParser\n.*'hermes'"):
        LLMService.model_validate(body)
    (refused,) = server_side_problems(body)
    assert "spec.model.toolParser" in refused and "hermez" in refused
    body["spec"]["model"]["toolParser"] = "hermes"
    assert LLMService.model_validate(body).spec.model.tool_parser == "hermes"
    assert server_side_problems(body) == []
    with pytest.raises(ValueError, match="toolParser"):
        parse_config(
            {
                "models": [{"name": "m", "engine": "sim", "toolParser": "nope"}],
                "classes": {"batch": {"kind": "batch"}},
            }
        )


def test_the_names_the_spec_takes_are_vllms_tool_parsers() -> None:
    from vllm.tool_parsers import ToolParserManager

    assert list(TOOL_PARSERS) == ToolParserManager.list_registered()


@pytest.mark.integration
async def test_the_openai_client_gets_tool_calls_through_the_router(tmp_path: Path) -> None:
    """Local mode's plan of the quickstart with toolParser hermes on its service (the operator's mapping):
    a sim worker process behind the router, the official client, streamed and not."""
    openai = pytest.importorskip("openai")
    docs = list(yaml.safe_load_all((EXAMPLES / "quickstart.yaml").read_text()))
    for doc in docs:
        if doc and doc["kind"] == "LLMService":
            doc["spec"]["model"]["toolParser"] = "hermes"
    plan = plan_local(load_documents(yaml.safe_dump_all(docs)), LocalEngine(), max_instances_per_group=1)
    first = plan.instances[0]
    assert first.config.models[0].tool_parser == "hermes"
    supervisor = Supervisor(tmp_path, grace_s=2.0)
    try:
        supervisor.start_all(plan.instances[:1], 600.0)  # the worker imports vLLM for its parser
        async with serve_router(supervisor.workers) as router:
            client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                                        default_headers={first.config.class_header: "chat"})  # fmt: skip
            model = first.config.models[0].name
            messages = [{"role": "user", "content": f"/reply {CALL}"}]
            called = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            (call,) = called.choices[0].message.tool_calls
            assert called.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
                "city": "Paris"
            }
            stream = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                          tool_choice="auto", stream=True)  # fmt: skip
            chunks = [c async for c in stream]
            calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
            assert (
                calls[0].id and calls[0].function.name == "get_weather" and {tc.index for tc in calls} == {0}
            )
            assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            plain = await client.chat.completions.create(
                model=model, tools=TOOLS, messages=[{"role": "user", "content": "/reply Sunny."}]
            )
            assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls
    finally:
        supervisor.stop_all()


async def test_the_vllm_engine_gives_its_parsers_the_models_tokenizer() -> None:
    """The real instruct model's tokenizer (no server needed): hermes reads it; llama3_json, whose
    marker token it lacks, is refused at start."""
    from tessera.worker.engines.vllm import VLLMEngine
    from tessera.worker.tool_calls import ToolCallParser

    directory = Path.home() / ".cache" / "tessera" / "models" / "smollm2"
    if not (directory / "tokenizer.json").is_file():
        pytest.skip("the smollm2 model is not built (tessera models pull smollm2)")
    engine = VLLMEngine("smollm2", "http://127.0.0.1:9", 2048, sleep_mode="off", tokenizer=str(directory))
    await engine.start()
    tokenizer = await engine.parser_tokenizer()
    assert tokenizer.encode("hi", add_special_tokens=False) == await engine.tokenize("hi")
    assert ToolCallParser("hermes", "smollm2", tokenizer).name == "hermes"
    with pytest.raises(ConfigError, match="python_tag"):
        ToolCallParser("llama3_json", "smollm2", tokenizer)
