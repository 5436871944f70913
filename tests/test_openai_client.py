"""What real clients send, through the router to sim workers, with the official `openai` client:
content parts, developer and tool messages, n > 1, logprobs, echo, JSON mode and forced tool calls are
served; what this worker does not serve (tool_choice auto for a model without a tool parser) is refused
with a 400 that names the field and the reason (never dropped silently)."""

from __future__ import annotations

from pathlib import Path

import pytest
from router_harness import CLASS_HEADER, MODEL, serve_router, start_workers

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration


async def test_openai_client_request_shapes_through_the_router(tmp_path: Path) -> None:
    supervisor = start_workers(tmp_path, 1)
    try:
        async with serve_router(supervisor.workers) as router:
            client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused",
                                        default_headers={CLASS_HEADER: "chat"}, max_retries=0)  # fmt: skip
            models = [m async for m in client.models.list()]
            assert models[0].id == MODEL and models[0].model_extra["max_model_len"] > 0
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model="nope", prompt="x", max_tokens=1)
            assert missing.value.body["type"] == "not_found_error" and missing.value.body["param"] == "model"
            parts = await client.chat.completions.create(
                model=MODEL, max_tokens=3,
                messages=[{"role": "developer", "content": "Answer briefly."},
                          {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": "there"}]}],
            )  # fmt: skip
            assert parts.choices[0].message.content and parts.usage.completion_tokens == 3
            tool_turn = await client.chat.completions.create(
                model=MODEL, max_tokens=2,
                messages=[{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": "Calling the tool."},
                          {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}],
            )  # fmt: skip
            assert tool_turn.choices[0].finish_reason == "length"
            stream = await client.chat.completions.create(
                model=MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            )  # fmt: skip
            chunks = [c async for c in stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
            served = await client.chat.completions.create(
                model=MODEL, max_tokens=3, n=2, logprobs=True, top_logprobs=2, seed=1,
                response_format={"type": "json_object"}, messages=[{"role": "user", "content": "x"}],
            )  # fmt: skip
            assert [c.index for c in served.choices] == [0, 1] and served.usage.completion_tokens == 6
            first = served.choices[0].logprobs.content[0]
            assert len(first.top_logprobs) == 2 and first.top_logprobs[0].token == first.token
            streamed = await client.chat.completions.create(
                model=MODEL, max_tokens=2, n=2, logprobs=True, stream=True,
                messages=[{"role": "user", "content": "x"}],
            )  # fmt: skip
            indexes = {c.index async for chunk in streamed for c in chunk.choices if c.logprobs}
            assert indexes == {0, 1}
            completion = await client.completions.create(model=MODEL, prompt="Say", max_tokens=2, echo=True)
            assert completion.choices[0].text.startswith("Say")
            with_lp = await client.completions.create(model=MODEL, prompt="Say", max_tokens=2, logprobs=1)
            assert len(with_lp.choices[0].logprobs.tokens) == 2
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            called = await client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}], tools=tools,
                tool_choice={"type": "function", "function": {"name": "f"}},
            )  # fmt: skip
            assert called.choices[0].message.tool_calls[0].function.name == "f"
            with pytest.raises(openai.BadRequestError, match="tool_choice 'auto'"):
                await client.chat.completions.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}], tools=tools
                )
            with pytest.raises(openai.BadRequestError, match="text only"):
                await client.chat.completions.create(
                    model=MODEL, max_tokens=2,
                    messages=[{"role": "user", "content": [{"type": "image_url",
                                                            "image_url": {"url": "http://x/y.png"}}]}],
                )  # fmt: skip
    finally:
        supervisor.stop_all()
