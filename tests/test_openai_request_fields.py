"""Every field of OpenAI's chat and completion request schemas, with what this deployment does with it.

The schemas are the official ``openai`` client's own (its ``CompletionCreateParams`` types), so a field
the client gains is a failure here until the table says what happens to it. Each row: ``served`` (it
shapes generation, or the router reads it), ``ignored`` (accepted, validated, and not acted on: it does
not change what is generated; the worker's schema says why), ``only`` (served with the values that ask
for what is generated anyway, refused with the reason for the others) or ``refused`` (with the reason).
Each row's sample goes through the worker's request models, as the worker validates a body.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest
from pydantic import ValidationError

from tessera.worker.server.schemas import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    IGNORED,
    LEGACY_FUNCTIONS,
    ONLY,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)

openai = pytest.importorskip("openai")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

# field -> (what we do, a sample body fragment, for "only": a value refused)
Row = tuple[str, dict[str, Any], Any]
CHAT: dict[str, Row] = {
    "audio": ("refused", {"audio": {"voice": "alloy", "format": "wav"}}, None),
    "frequency_penalty": ("served", {"frequency_penalty": 0.5}, None),
    "function_call": ("refused", {"function_call": "auto"}, None),
    "functions": ("refused", {"functions": [{"name": "f"}]}, None),
    "logit_bias": ("refused", {"logit_bias": {"5": 1}}, None),
    "logprobs": ("served", {"logprobs": True}, None),
    "max_completion_tokens": ("served", {"max_completion_tokens": 4}, None),
    "max_tokens": ("served", {"max_tokens": 4}, None),
    "messages": ("served", {}, None),
    "metadata": ("ignored", {"metadata": {"team": "a"}}, None),
    "modalities": ("only", {"modalities": ["text"]}, ["text", "audio"]),
    "model": ("served", {}, None),
    "moderation": ("refused", {"moderation": {"model": "omni-moderation-latest"}}, None),
    "n": ("served", {"n": 2}, None),
    "parallel_tool_calls": (
        "served",
        {"parallel_tool_calls": False, "tools": TOOLS, "tool_choice": "required"},
        None,
    ),
    "prediction": ("ignored", {"prediction": {"type": "content", "content": "hi"}}, None),
    "presence_penalty": ("served", {"presence_penalty": 0.5}, None),
    "prompt_cache_key": ("ignored", {"prompt_cache_key": "session-1"}, None),  # the router's session key
    "prompt_cache_options": ("ignored", {"prompt_cache_options": {}}, None),
    "prompt_cache_retention": ("ignored", {"prompt_cache_retention": "24h"}, None),
    "reasoning_effort": ("only", {"reasoning_effort": "none"}, "high"),
    "response_format": ("served", {"response_format": {"type": "json_object"}}, None),
    "safety_identifier": ("ignored", {"safety_identifier": "u-1"}, None),
    "seed": ("served", {"seed": 1}, None),
    "service_tier": ("only", {"service_tier": "auto"}, "priority"),
    "stop": ("served", {"stop": ["\n"]}, None),
    "store": ("ignored", {"store": True}, None),
    "stream": ("served", {"stream": True}, None),
    "stream_options": ("served", {"stream": True, "stream_options": {"include_usage": True}}, None),
    "temperature": ("served", {"temperature": 0.7}, None),
    "tool_choice": ("served", {"tools": TOOLS, "tool_choice": "none"}, None),
    "tools": ("served", {"tools": TOOLS, "tool_choice": "required"}, None),
    "top_logprobs": ("served", {"logprobs": True, "top_logprobs": 2}, None),
    "top_p": ("served", {"top_p": 0.9}, None),
    "user": ("served", {"user": "end-user-1"}, None),  # the router's session key without prompt_cache_key
    "verbosity": ("only", {"verbosity": "medium"}, "high"),
    "web_search_options": ("refused", {"web_search_options": {}}, None),
}
COMPLETION: dict[str, Row] = {
    "best_of": ("refused", {"best_of": 2}, None),
    "echo": ("served", {"echo": True}, None),
    "frequency_penalty": ("served", {"frequency_penalty": 0.5}, None),
    "logit_bias": ("refused", {"logit_bias": {"5": 1}}, None),
    "logprobs": ("served", {"logprobs": 1}, None),
    "max_tokens": ("served", {"max_tokens": 4}, None),
    "model": ("served", {}, None),
    "n": ("served", {"n": 2}, None),
    "presence_penalty": ("served", {"presence_penalty": 0.5}, None),
    "prompt": ("served", {}, None),
    "seed": ("served", {"seed": 1}, None),
    "stop": ("served", {"stop": "\n"}, None),
    "stream": ("served", {"stream": True}, None),
    "stream_options": ("served", {"stream": True, "stream_options": {"include_usage": True}}, None),
    "suffix": ("refused", {"suffix": "!"}, None),
    "temperature": ("served", {"temperature": 0.7}, None),
    "top_p": ("served", {"top_p": 0.9}, None),
    "user": ("served", {"user": "end-user-1"}, None),
}
REASONS = {**UNSUPPORTED, **CHAT_UNSUPPORTED, **COMPLETION_UNSUPPORTED,
           "functions": LEGACY_FUNCTIONS, "function_call": LEGACY_FUNCTIONS}  # fmt: skip
CASES = [("chat", name) for name in CHAT] + [("completion", name) for name in COMPLETION]


def _schema_fields(module: Any) -> set[str]:
    """The fields of one of the client's request schemas, streamed or not."""
    return set(typing.get_type_hints(module.CompletionCreateParamsStreaming)) | set(
        typing.get_type_hints(module.CompletionCreateParamsNonStreaming)
    )


def test_the_table_lists_every_field_of_the_official_clients_request_schemas() -> None:
    assert set(CHAT) == _schema_fields(chat_create_params)
    assert set(COMPLETION) == _schema_fields(completion_create_params)
    # and the worker's own tables agree with it
    refused = {f for table in (CHAT, COMPLETION) for f, row in table.items() if row[0] == "refused"}
    assert refused == set(REASONS)
    assert {f for f, row in CHAT.items() if row[0] == "ignored"} == set(IGNORED)
    assert {f for f, row in CHAT.items() if row[0] == "only"} == set(ONLY)


def _validate(endpoint: str, fragment: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    if endpoint == "chat":
        return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fragment})
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fragment})


@pytest.mark.parametrize(("endpoint", "name"), CASES)
def test_each_field_is_served_ignored_or_refused_with_the_reason(endpoint: str, name: str) -> None:
    what, fragment, refused_value = (CHAT if endpoint == "chat" else COMPLETION)[name]
    if what == "refused":
        with pytest.raises(ValidationError) as caught:
            _validate(endpoint, fragment)
        assert f"{name}: {REASONS[name]}" in str(caught.value)
        return
    body = _validate(endpoint, fragment)
    if what == "ignored":  # nothing of it reaches the engine
        assert body.sampling() == _validate(endpoint, {}).sampling()
        assert name in IGNORED and IGNORED[name] in type(body).model_fields[name].description
    if what == "only":
        served, reason = ONLY[name]
        assert fragment[name] in served
        with pytest.raises(ValidationError, match=re.escape(reason)):
            _validate(endpoint, {name: refused_value})
    # null is "unset" for every field the client may send (some frameworks send nulls)
    if name not in ("model", "messages", "prompt"):
        _validate(endpoint, {name: None})
