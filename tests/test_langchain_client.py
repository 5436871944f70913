"""A second widely used client library against the router: LangChain's ``ChatOpenAI`` (which drives the
official ``openai`` client) pointed at the router's ``/v1``, with sim workers of the quickstart plan behind
it. Chat answers invoked, streamed and batched, sync and async; forced tool calls whose arguments LangChain
parses; structured output under a JSON schema read back into a pydantic model; the router's errors raised
as the ``openai`` exceptions with the OpenAI error body.

The sim engine's text is a deterministic function of the prompt (so a streamed answer equals the same
request answered whole), and a last user message ``/reply X`` scripts the answer X: that is how the tool
arguments and the structured answer are valid JSON here. The sim engine does not shape its text by the
schema, so what is tested is the wire (request accepted, answer read back), not constrained decoding."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from router_harness import CLASS_HEADER, MODEL, serve_router, start_workers

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

pytestmark = pytest.mark.integration

ChatFactory = Callable[..., Any]


@asynccontextmanager
async def _chat_models(tmp_path: Path, sent: list[dict[str, Any]]) -> AsyncIterator[ChatFactory]:
    """One sim worker behind the router; yields a factory of ``ChatOpenAI`` on the router whose async
    requests' JSON bodies are appended to ``sent`` (what LangChain put on the wire)."""

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    supervisor = start_workers(tmp_path, 1)
    try:
        async with serve_router(supervisor.workers) as router:
            hooked = httpx.AsyncClient(event_hooks={"request": [record]})

            def chat(**overrides: Any) -> Any:
                settings: dict[str, Any] = {
                    "base_url": f"{router.url}/v1", "api_key": "unused", "model": MODEL, "max_tokens": 4,
                    "temperature": 0, "max_retries": 0, "default_headers": {CLASS_HEADER: "chat"},
                    "http_async_client": hooked,
                }  # fmt: skip
                return langchain_openai.ChatOpenAI(**(settings | overrides))

            try:
                yield chat
            finally:
                await hooked.aclose()
    finally:
        supervisor.stop_all()


class City(BaseModel):
    name: str
    population: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def test_chat_answers_invoked_streamed_and_batched(tmp_path: Path) -> None:
    async with _chat_models(tmp_path, []) as chat:
        llm = chat()
        answer = await llm.ainvoke("Hello")
        assert answer.content.strip() and answer.usage_metadata["output_tokens"] == 4
        assert answer.response_metadata["finish_reason"] == "length"
        assert answer.response_metadata["model_name"] == MODEL
        # The sync client blocks its thread; the router runs in this test's event loop, so sync calls
        # go to a worker thread.
        assert (await asyncio.to_thread(llm.invoke, "Hello")).content == answer.content
        pieces = [c.content async for c in llm.astream("Hello") if c.content]
        assert len(pieces) == 4 and "".join(pieces) == answer.content  # token by token, same text
        synced = await asyncio.to_thread(lambda: [c.content for c in llm.stream("Hello")])
        assert "".join(synced) == answer.content
        usage = [c.usage_metadata async for c in llm.astream("Hello", stream_usage=True) if c.usage_metadata]
        assert [u["output_tokens"] for u in usage] == [4]
        # Two different prompts, so answers swapped between them would show.
        batched = await asyncio.to_thread(llm.batch, ["Hello", "/reply Bye."])
        assert [m.content for m in batched] == [answer.content, "Bye."]
        assert [m.content for m in await llm.abatch(["/reply Bye.", "Hello"])] == ["Bye.", answer.content]
        conversation = [
            messages.SystemMessage("Answer briefly."),
            messages.HumanMessage("Hi"),
            messages.AIMessage("Hello! How can I help?"),
            messages.HumanMessage("/reply Fine, thanks."),
        ]
        scripted = await chat(max_tokens=50).ainvoke(conversation)
        assert scripted.content == "Fine, thanks." and scripted.response_metadata["finish_reason"] == "stop"


async def test_forced_tool_calls_come_back_as_parsed_calls(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []
    async with _chat_models(tmp_path, sent) as chat:
        llm = chat(max_tokens=100)
        named = llm.bind_tools([get_weather], tool_choice="get_weather")
        called = await named.ainvoke('/reply {"city": "Paris"}')
        assert sent[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert sent[-1]["tools"][0]["function"]["parameters"]["required"] == ["city"]
        (call,) = called.tool_calls
        assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
        assert call["id"].startswith("chatcmpl-tool-") and not called.invalid_tool_calls
        assert get_weather(**call["args"]) == "sunny in Paris"  # the arguments call the tool as they are
        chunks = [c async for c in named.astream('/reply {"city": "Paris"}')]
        assert sum(1 for c in chunks if c.tool_call_chunks) > 1  # the arguments arrive in pieces
        joined = chunks[0]
        for chunk in chunks[1:]:
            joined += chunk
        assert [(c["name"], c["args"]) for c in joined.tool_calls] == [("get_weather", {"city": "Paris"})]
        # tool_choice "any" is OpenAI's "required": the answer is a JSON array of calls
        required = llm.bind_tools([get_weather], tool_choice="any")
        rome = await required.ainvoke('/reply [{"name": "get_weather", "parameters": {"city": "Rome"}}]')
        assert sent[-1]["tool_choice"] == "required"
        assert [(c["name"], c["args"]) for c in rome.tool_calls] == [("get_weather", {"city": "Rome"})]
        assert rome.response_metadata["finish_reason"] == "tool_calls"


async def test_structured_output_under_a_json_schema_is_read_into_the_model(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []
    async with _chat_models(tmp_path, sent) as chat:
        structured = chat(max_tokens=100).with_structured_output(City, method="json_schema")
        city = await structured.ainvoke('/reply {"name": "Paris", "population": 2100000}')
        assert city == City(name="Paris", population=2100000)
        fmt = sent[-1]["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "City"
        assert fmt["json_schema"]["strict"] is True
        assert fmt["json_schema"]["schema"]["required"] == ["name", "population"]


async def test_router_errors_are_raised_as_the_openai_exceptions(tmp_path: Path) -> None:
    async with _chat_models(tmp_path, []) as chat:
        with pytest.raises(openai.NotFoundError) as missing:
            await chat(model="nope").ainvoke("x")
        assert missing.value.status_code == 404
        assert missing.value.body["type"] == "not_found_error" and missing.value.body["param"] == "model"
        assert "nope" in missing.value.body["message"]
        # tools without tool_choice mean 'auto', which a model without a tool parser is not served
        with pytest.raises(openai.BadRequestError, match="tool_choice 'auto'"):
            await chat().bind_tools([get_weather]).ainvoke("x")
