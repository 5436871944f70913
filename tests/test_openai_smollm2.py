"""The OpenAI suite on the real instruct model (SmolLM2-135M-Instruct, float32, greedy): JSON mode and tool
calling through a Tessera worker, and through the router in front of it, with the official ``openai``
client, give the answers vLLM's own OpenAI server gives to the same requests (parity), streamed and not.

One vLLM server for the module, started as a deployment with tool calling starts it:
``--enable-auto-tool-choice --tool-call-parser hermes`` and a tools-aware ``--chat-template``. The model's
own chat template ignores ``tools`` (it renders role and content only), and the 135M model does not
call tools from a description alone (measured greedy: it answers "The weather in Paris is quite
unique...", or writes Python); ``TOOLS_TEMPLATE`` is a hermes-format ChatML template that lists the tools
in the system turn and renders an assistant's calls as ``<tool_call>`` blocks, and one earlier turn that
called the tool (``SHOT``) is what makes the model call it again in that format. Tool-free chats
render exactly as under the model's own template (checked below), so the JSON cases are the model's
own. The worker is given the same template through ``models[].tokenizer`` (a tokenizer folder holding
it) and ``toolParser: hermes``.

What the answers show: JSON mode parses (``json_object``) and follows the schema (``json_schema``);
tool_choice auto calls ``get_weather`` for the weather and answers a plain question as content;
'required' and named choices on ``strict`` tools call it with arguments that follow its schema (vLLM's
hermes parser generates them in the model's own ``<tool_call>`` format under an xgrammar structural
tag; without ``strict`` the tag constrains the envelope only, and the 135M model writes the schema
instead of a city until max_tokens). Ids and ``created`` differ; everything else compared is equal.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from router_harness import serve_router

from tessera.api.worker_config import parse_config
from tessera.bench.harness import WorkerChild
from tessera.router.backends import Backend
from tessera.worker.engines.vllm_process import VLLMServer

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2"
MAX_TOKENS = 40  # every answer below ends by itself within it (a hermes call: 35 tokens, measured)

# SmolLM2's own template with a hermes tool block (the format vLLM's hermes parser reads) in the system
# turn when tools are given, an assistant's calls as <tool_call> blocks, tool results as a user turn.
TOOLS_TEMPLATE = r"""{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
{{- '\n\nYou may call one or more functions to assist with the user query. You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in rest -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{- '<|im_start|>assistant\n' + (message['content'] or '') -}}
{%- for call in message['tool_calls'] %}{{ '\n<tool_call>\n{"name": "' + call['function']['name'] + '", "arguments": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}{% endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""  # noqa: E501

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "parameters": CITY}
TOOLS = [{"type": "function", "function": WEATHER}]
STRICT_TOOLS = [{"type": "function", "function": {**WEATHER, "strict": True}}]
SHOT = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call-1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
]  # fmt: skip
PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# name -> the request (without model, greedy settings, stream)
CASES: dict[str, dict[str, Any]] = {
    "json-object": {
        "messages": _user("What is the capital of France? Answer in JSON with keys city and country."),
        "response_format": {"type": "json_object"},
    },
    # unconstrained (json_object) the model answers this one with other keys and runs past max_tokens
    "json-schema": {
        "messages": _user("Give the capital of France as JSON."),
        "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
    },
    "auto-call": {"messages": SHOT + _user("Weather in Paris?"), "tools": TOOLS},
    "auto-answer": {"messages": SHOT + _user("What is the capital of France?"), "tools": TOOLS},
    "required": {"messages": _user("Weather in Paris?"), "tools": STRICT_TOOLS, "tool_choice": "required"},
    "named": {
        "messages": _user("Weather in Paris?"),
        "tools": STRICT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
}


@dataclass(frozen=True)
class _Instance:
    """The worker as the router's harness takes it (``backend()``)."""

    url: str
    config: dict[str, Any]

    def backend(self) -> Backend:
        return Backend(name="smollm2-0", url=self.url, config=parse_config(self.config))


@pytest.fixture(scope="module")
def tools_tokenizer(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer files with ``TOOLS_TEMPLATE`` as its chat template."""
    folder = tmp_path_factory.mktemp("smollm2-tools-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def smollm2_vllm(
    smollm2_model_dir: Path, tools_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    server = VLLMServer(
        smollm2_model_dir,
        served_model_name=MODEL,
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_gib=1,
        dtype="float32",  # bfloat16 degrades its greedy answers (tessera.models.registry)
        extra_args=[
            "--enforce-eager",
            *("--chat-template", str(tools_tokenizer / "chat_template.jinja")),
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        ],
        log_path=tmp_path_factory.mktemp("smollm2-vllm") / "vllm.log",
    )
    with server:
        yield server


@pytest.fixture(scope="module")
def smollm2_worker(
    smollm2_vllm: VLLMServer, tools_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Instance]:
    model = {"name": MODEL, "url": smollm2_vllm.url, "maxModelLen": 2048, "tokenizer": str(tools_tokenizer),
             "toolParser": "hermes"}  # fmt: skip
    config = {"models": [model], "scheduling": {"policy": "fcfs", "batch": {"min": 1, "max": 8}}}
    # the worker imports vLLM for its tool parser: seconds more than a plain start
    proc = WorkerChild(config, Path(tmp_path_factory.mktemp("smollm2-worker")), ready_timeout_s=300)
    try:
        yield _Instance(proc.url, config)
    finally:
        proc.stop()


async def _answer(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The answer's content, tool calls (name, arguments), finish reason and token counts; a stream's
    deltas joined (call fragments by their index)."""
    if not body.get("stream"):
        done = await client.chat.completions.create(**body)
        (choice,) = done.choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason,
                "usage": (done.usage.prompt_tokens, done.usage.completion_tokens)}  # fmt: skip
    content, parts, finish, usage = "", {}, None, None
    async for chunk in await client.chat.completions.create(**body):
        usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) if chunk.usage else usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, args = parts.get(call.index, ("", ""))
                if call.function is not None:
                    name, args = name + (call.function.name or ""), args + (call.function.arguments or "")
                parts[call.index] = (name, args)
            finish = choice.finish_reason or finish
    return {"content": content, "calls": [parts[i] for i in sorted(parts)], "finish": finish, "usage": usage}


def _client(url: str) -> Any:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _check_meaning(name: str, answer: dict[str, Any]) -> None:
    """What the case's answer must say, so that the parity below compares answers that did the thing."""
    calls = [(n, json.loads(a)) for n, a in answer["calls"]]
    if name == "json-object":
        assert isinstance(json.loads(answer["content"]), dict) and answer["finish"] == "stop"
    elif name == "json-schema":
        jsonschema.validate(json.loads(answer["content"]), PLACE)
        assert answer["finish"] == "stop"
    elif name == "auto-answer":
        assert calls == [] and "Paris" in answer["content"] and answer["finish"] == "stop"
    else:  # a call of get_weather with arguments that follow its schema
        assert [n for n, _ in calls] == ["get_weather"], answer
        jsonschema.validate(calls[0][1], CITY)
        assert answer["finish"] == ("stop" if name == "named" else "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(CASES))
async def test_the_worker_and_the_router_answer_as_vllm_does(
    smollm2_vllm: VLLMServer, smollm2_worker: _Instance, name: str, stream: bool
) -> None:
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **CASES[name]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    want = await _answer(_client(smollm2_vllm.url), body)
    _check_meaning(name, want)
    assert await _answer(_client(smollm2_worker.url), body) == want
    async with serve_router([smollm2_worker]) as router:
        assert await _answer(_client(router.url), body) == want


def test_the_tools_template_renders_tool_free_chats_as_the_models_own(
    smollm2_model_dir: Path, tools_tokenizer: Path
) -> None:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(smollm2_model_dir)
    tools = AutoTokenizer.from_pretrained(tools_tokenizer)
    chats = [
        _user("Hi"),
        [{"role": "system", "content": "Answer briefly."}, *_user("Hi")],
        [*_user("Hi"), {"role": "assistant", "content": "Hello!"}, *_user("Bye")],
    ]
    for chat in chats:
        want = own.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tools.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == want
    with_tools = tools.apply_chat_template(_user("Hi"), tools=TOOLS, add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in with_tools
