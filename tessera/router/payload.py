"""The body of a completion request as the router reads it: within the size and time limits, then as
a JSON object with ``model`` and ``stream``. Every other field is the worker's to check (it answers
400 naming the field).

The body is parsed as JSON whatever ``Content-Type`` says, as vLLM's server does: curl's ``-d`` sends
``application/x-www-form-urlencoded`` by default, and refusing a valid JSON body over its label helps
no one. A body that is not JSON gets a 400 that says how to send one.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest

from tessera.api.openai_errors import ApiError
from tessera.router.limits import RouterLimits

_HOW = "send a JSON object, e.g. curl -H 'Content-Type: application/json' -d '{\"model\": \"...\", ...}'"


@dataclass(frozen=True, slots=True)
class Payload:
    """What the router needs from a request body."""

    model: str
    stream: bool
    prompt_text: str = ""  # the prompt as text, for the prefix index ("" when there is none to read)
    # a session key for sticky routing: OpenAI's prompt_cache_key (what it is for), else its end-user id
    session: str = ""
    prompt_token_ids: tuple[int, ...] = ()  # a completion's prompt given as token ids (the engine's own)
    # A chat's messages and tools as sent (None when absent), for ``tessera.router.prompt_tokens`` to
    # render as the worker does; unchecked here, like every field but model and stream.
    messages: Any = None
    tools: Any = None
    max_tokens: int = 0  # max_completion_tokens, else max_tokens, when a whole number (a quota's estimate)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def parse_payload(raw: bytes) -> Payload:
    """The request's model and stream flag; ApiError 400 naming what is wrong."""
    if not raw.strip():
        raise ApiError(400, f"the request body is empty; {_HOW}")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is not valid JSON: nested too deeply; {_HOW}") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise ApiError(400, f"the request body is not valid JSON ({exc}); {_HOW}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}; {_HOW}")
    model = body.get("model")
    if model is None:
        raise ApiError(400, "the field 'model' is required (see GET /v1/models)", param="model")
    if not isinstance(model, str) or not model:
        got = _kind(model) if not isinstance(model, str) else "an empty string"
        raise ApiError(400, f"the field 'model' must be a model name (a string), got {got}", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"the field 'stream' must be true or false, got {_kind(stream)}", param="stream")
    keys = (body.get("prompt_cache_key"), body.get("user"))
    session = next((k for k in keys if isinstance(k, str) and k), "")
    return Payload(model, bool(stream), prompt_text(body), session,
                   prompt_token_ids(body), body.get("messages"), body.get("tools"),
                   _max_tokens(body))  # fmt: skip


def _max_tokens(body: dict[str, Any]) -> int:
    """The output cap the client asked for (0: none, or not a whole number: the worker says so)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as text in the order the engine sees it, best effort: a completion's prompt string,
    or each chat message's role and text (a longer conversation extends a shorter one's text, so
    their prefixes match). The worker validates the fields; what is not text here counts as none."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role')}\n{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict)
        )
    return ""


def prompt_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    """A completion's prompt when it is one list of token ids (what the engine hashes its blocks
    over), else none (text is tokenized, where it can be, by ``tessera.router.prompt_tokens``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return ()


def body_too_large(limits: RouterLimits) -> ApiError:
    """The 413 answer (the connection closes: what the client still sends is not read)."""
    return ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes, the most this "
                    "router accepts (setting --max-body-bytes); send a shorter prompt",
                    code="request_too_large", headers={"connection": "close"})  # fmt: skip


async def read_body(http: HttpRequest, limits: RouterLimits) -> bytes:
    """The request body, at most ``limits.max_body_bytes``, complete within ``limits.body_timeout_s``.

    ApiError 413 when it is larger: at once when the declared length says so and the client waits
    for ``100 Continue``; otherwise after reading and discarding the rest (for at most the body
    timeout), so that a client that sends its whole body before reading gets the answer rather than a
    reset connection. ApiError 408 when it is not complete in time. Starlette's ``ClientDisconnect``
    when the client leaves."""
    declared = http.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > limits.max_body_bytes
    if over and http.headers.get("expect", "").lower() == "100-continue":
        raise body_too_large(limits)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in http.stream():
                if not over:
                    body += chunk
                    over = len(body) > limits.max_body_bytes
    except TimeoutError:
        if over:
            raise body_too_large(limits) from None
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s (setting "
                       "--body-timeout); send it at once", code="request_timeout",
                       headers={"connection": "close"}) from None  # fmt: skip
    if over:
        raise body_too_large(limits)
    return bytes(body)
