"""Bad input over HTTP: malformed requests against the real router (API keys on, tight limits) with two
real sim workers behind it. Each gets an answer in time (no hang), a 4xx status (no crash), an
OpenAI-style error body, and a message that names what is wrong (the field, header or limit). Then
the router and both workers still serve, and the router answered no 5xx.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio
from router_harness import (
    CLASS_HEADER,
    MODEL,
    RawAnswer,
    RouterUnderTest,
    raw_exchange,
    serve_router,
    start_workers,
)

from tessera.local.supervisor import WorkerProcess
from tessera.router.auth import ApiKeys
from tessera.router.limits import RouterLimits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]
LIMITS = RouterLimits(
    max_body_bytes=64 * 1024, max_header_bytes=8 * 1024, header_timeout_s=1.0, body_timeout_s=1.0
)
KEY = "sk-suite-0123456789abcdef"
KEYS = f"""
keys:
  - {{key: {KEY}, tenant: suite}}
  - {{key: sk-batch-only-0123456789, tenant: batch-only, classes: [offline]}}
  - {{key: sk-other-model-0123456789, tenant: other-model, models: [another-model]}}
"""
AUTH = {"Authorization": f"Bearer {KEY}"}
OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass(frozen=True)
class Case:
    """One malformed request and what its answer must say."""

    status: int
    names: tuple[str, ...]  # the message must contain each
    body: Any = None  # JSON-encoded (ASCII escapes) unless ``content`` is given
    content: bytes | None = None
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    raw: bytes | list[bytes] | None = None  # written on a plain socket instead
    pause_s: float = 0.0


def _with(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


def _without(data: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != name}


def _raw(head: str, body: bytes = b"", *, auth: bool = True) -> bytes:
    lines = [head, "Host: router"] + ([f"Authorization: Bearer {KEY}"] if auth else [])
    return ("\r\n".join(lines) + "\r\n").encode() + body


def _post_head(extra: str) -> bytes:
    return _raw("POST /v1/completions HTTP/1.1") + extra.encode()


CASES: dict[str, Case] = {
    # The body as JSON (the router).
    "empty_body": Case(400, ("body is empty", "Content-Type: application/json"), content=b""),
    "blank_body": Case(400, ("body is empty",), content=b"  \n\t "),
    "not_json": Case(400, ("not valid JSON",), content=b"{not json"),
    "truncated_json": Case(400, ("not valid JSON",), content=b'{"model": "x"'),
    "json_array": Case(400, ("JSON object", "array"), content=b"[]"),
    "json_string": Case(400, ("JSON object", "a string"), content=b'"hello"'),
    "json_number": Case(400, ("JSON object", "a number"), content=b"42"),
    "json_null": Case(400, ("JSON object", "null"), content=b"null"),
    "invalid_utf8": Case(400, ("not valid JSON",), content=b'{"model": "\xff\xfe"}'),
    "nested_too_deep": Case(400, ("nested too deeply",), content=b"[" * 30000),
    "integer_too_long": Case(
        400, ("not valid JSON", "digits"), content=b'{"max_tokens": 1' + b"0" * 5000 + b"}"
    ),
    "form_body": Case(
        400,
        ("not valid JSON", "Content-Type: application/json"),
        content=b"model=m&prompt=hi",
        headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
    ),
    "model_missing": Case(400, ("'model' is required",), body=_without(OK, "model")),
    "model_null": Case(400, ("'model' is required",), body=_with(model=None)),
    "model_number": Case(400, ("'model'", "a number"), body=_with(model=7)),
    "model_empty": Case(400, ("'model'", "empty string"), body=_with(model="")),
    "model_object": Case(400, ("'model'", "an object"), body=_with(model={"name": MODEL})),
    "model_list": Case(400, ("'model'", "an array"), body=_with(model=[MODEL])),
    "model_unknown": Case(404, ("model", "'no-such-model'"), body=_with(model="no-such-model")),
    "stream_string": Case(400, ("'stream'", "a string"), body=_with(stream="yes")),
    "stream_number": Case(400, ("'stream'", "a number"), body=_with(stream=1)),
    # The class header and the API key.
    "unknown_class": Case(400, (CLASS_HEADER, "'gold'"), body=OK, headers={**AUTH, CLASS_HEADER: "gold"}),
    "no_api_key": Case(401, ("Authorization: Bearer",), body=OK, headers={}),
    "wrong_api_key": Case(
        401, ("invalid API key",), body=OK, headers={"Authorization": "Bearer sk-wrong-0123456789"}
    ),
    "basic_auth": Case(401, ("Bearer",), body=OK, headers={"Authorization": "Basic c3VpdGU6eA=="}),
    "empty_bearer": Case(
        401,
        ("invalid API key",),
        raw=_raw("GET /v1/models HTTP/1.1", auth=False) + b"Authorization: Bearer \r\n\r\n",
    ),
    "key_other_model": Case(
        403,
        ("model", "another-model"),
        body=OK,
        headers={"Authorization": "Bearer sk-other-model-0123456789"},
    ),
    "key_other_model_unserved": Case(  # 403, not a 404 listing the models the key may not use
        403,
        ("'no-such-model'", "another-model"),
        body=_with(model="no-such-model"),
        headers={"Authorization": "Bearer sk-other-model-0123456789"},
    ),
    "key_other_class": Case(
        403, (CLASS_HEADER, "'chat'"), body=OK, headers={"Authorization": "Bearer sk-batch-only-0123456789"}
    ),
    # Fields the worker checks (relayed as it answers).
    "prompt_missing": Case(400, ("prompt",), body=_without(OK, "prompt")),
    "prompt_number": Case(400, ("prompt",), body=_with(prompt=3)),
    "prompt_object": Case(400, ("prompt",), body=_with(prompt={"text": "hi"})),
    "prompt_empty_ids": Case(400, ("prompt",), body=_with(prompt=[])),
    "prompt_negative_id": Case(400, ("prompt",), body=_with(prompt=[-1])),
    "prompt_lone_surrogate": Case(400, ("prompt", "UTF-8"), body=_with(prompt="a\ud800b")),
    "max_tokens_zero": Case(400, ("max_tokens",), body=_with(max_tokens=0)),
    "max_tokens_negative": Case(400, ("max_tokens",), body=_with(max_tokens=-5)),
    "max_tokens_string": Case(400, ("max_tokens",), body=_with(max_tokens="ten")),
    "max_tokens_fraction": Case(400, ("max_tokens",), body=_with(max_tokens=1.5)),
    "max_tokens_huge": Case(400, ("max_tokens",), body=_with(max_tokens=10**7)),
    "context_too_long": Case(400, ("max_tokens", "context length"), body=_with(max_tokens=9000)),
    "temperature_negative": Case(400, ("temperature",), body=_with(temperature=-1)),
    "temperature_high": Case(400, ("temperature",), body=_with(temperature=3)),
    "temperature_string": Case(400, ("temperature",), body=_with(temperature="hot")),
    "temperature_nan": Case(
        400,
        ("temperature: must be a finite number",),
        content=b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
    ),
    "top_p_zero": Case(400, ("top_p",), body=_with(top_p=0)),
    "top_p_high": Case(400, ("top_p",), body=_with(top_p=1.5)),
    "top_k_low": Case(400, ("top_k",), body=_with(top_k=-2)),
    "min_p_high": Case(400, ("min_p",), body=_with(min_p=2)),
    "seed_negative": Case(400, ("seed",), body=_with(seed=-1)),
    "stop_empty": Case(400, ("stop",), body=_with(stop="")),
    "stop_too_many": Case(400, ("stop",), body=_with(stop=[f"s{i}" for i in range(17)])),
    "stop_number": Case(400, ("stop",), body=_with(stop=5)),
    "n_zero": Case(400, ("n",), body=_with(n=0)),
    "n_huge": Case(400, ("n",), body=_with(n=1000)),
    "logprobs_too_many": Case(400, ("logprobs",), body=_with(logprobs=21)),
    "echo_with_logprobs": Case(400, ("echo with logprobs",), body=_with(echo=True, logprobs=1)),
    "unknown_field": Case(400, ("best_of",), body=_with(best_of=3)),
    "stream_options_unknown": Case(400, ("stream_options",), body=_with(stream_options={"x": 1})),
    "include_usage_string": Case(
        400, ("include_usage",), body=_with(stream_options={"include_usage": "sometimes"})
    ),
    "ignore_eos_string": Case(400, ("ignore_eos",), body=_with(ignore_eos="sometimes")),
    "presence_penalty_high": Case(400, ("presence_penalty",), body=_with(presence_penalty=5)),
    "repetition_penalty_zero": Case(400, ("repetition_penalty",), body=_with(repetition_penalty=0)),
    "min_tokens_negative": Case(400, ("min_tokens",), body=_with(min_tokens=-1)),
    "user_number": Case(400, ("user",), body=_with(user=5)),
    "chat_messages_missing": Case(
        400, ("messages",), body=_without(CHAT, "messages"), path="/v1/chat/completions"
    ),
    "chat_messages_string": Case(400, ("messages",), body=_chat(messages="hi"), path="/v1/chat/completions"),
    "chat_messages_empty": Case(400, ("messages",), body=_chat(messages=[]), path="/v1/chat/completions"),
    "chat_role_missing": Case(
        400, ("messages.0.role",), body=_chat(messages=[{"content": "hi"}]), path="/v1/chat/completions"
    ),
    "chat_role_unknown": Case(
        400,
        ("messages.0.role",),
        body=_chat(messages=[{"role": "robot", "content": "x"}]),
        path="/v1/chat/completions",
    ),
    "chat_content_number": Case(
        400,
        ("messages.0.content",),
        body=_chat(messages=[{"role": "user", "content": 1}]),
        path="/v1/chat/completions",
    ),
    "chat_message_extra": Case(
        400,
        ("messages.0.mood",),
        body=_chat(messages=[{"role": "user", "content": "x", "mood": "n"}]),
        path="/v1/chat/completions",
    ),
    "chat_max_completion_zero": Case(
        400, ("max_completion_tokens",), body=_chat(max_completion_tokens=0), path="/v1/chat/completions"
    ),
    # Paths and methods.
    "get_completions": Case(405, ("GET", "POST"), method="GET"),
    "put_chat": Case(405, ("PUT", "POST"), method="PUT", path="/v1/chat/completions", body=CHAT),
    "delete_models": Case(405, ("DELETE", "GET"), method="DELETE", path="/v1/models"),
    "unknown_path": Case(404, ("/v1/embeddings",), path="/v1/embeddings", body=OK),
    "worker_only_path": Case(404, ("/admin/reload",), path="/admin/reload", body={}),
    "path_traversal": Case(404, ("/etc/passwd",), raw=_raw("GET /../../etc/passwd HTTP/1.1") + b"\r\n"),
    # The HTTP message itself.
    "garbage_request_line": Case(400, ("malformed HTTP request",), raw=b"GARBAGE\r\n\r\n"),
    "bad_method": Case(400, ("malformed HTTP request",), raw=b"G@T /health HTTP/1.1\r\nHost: r\r\n\r\n"),
    "bad_http_version": Case(
        400, ("malformed HTTP request",), raw=b"GET /health HTTP/7.5\r\nHost: r\r\n\r\n"
    ),
    "header_without_colon": Case(
        400, ("malformed HTTP request",), raw=b"GET /health HTTP/1.1\r\nHost r\r\n\r\n"
    ),
    "header_nul_byte": Case(
        400, ("malformed HTTP request",), raw=b"GET /health HTTP/1.1\r\nX-A: a\x00b\r\n\r\n"
    ),
    "content_length_letters": Case(
        400, ("malformed HTTP request",), raw=_post_head("Content-Length: abc\r\n\r\n")
    ),
    "content_length_and_chunked": Case(
        400,
        ("malformed HTTP request",),
        raw=_post_head("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
    ),
    "content_length_twice": Case(
        400,
        ("malformed HTTP request",),
        raw=_post_head("Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello"),
    ),
    "bad_chunk_size": Case(
        400, ("malformed HTTP request",), raw=_post_head("Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n")
    ),
    "upgrade_h2c": Case(
        400, ("Upgrade: h2c",), body=OK, headers={**AUTH, "Connection": "Upgrade", "Upgrade": "h2c"}
    ),
    "upgrade_websocket": Case(
        400,
        ("Upgrade: websocket",),
        method="GET",
        path="/v1/models",
        headers={
            **AUTH,
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version": "13",
        },
    ),
    # Limits (8 KiB head, 64 KiB body, 1 s for each).
    "header_too_large": Case(431, ("--max-header-bytes",), body=OK, headers={**AUTH, "X-Big": "b" * 9000}),
    "too_many_headers": Case(
        431, ("--max-header-bytes",), body=OK, headers={**AUTH, **{f"X-H{i}": "v" for i in range(1000)}}
    ),
    "url_too_long": Case(431, ("--max-header-bytes",), path="/v1/completions?q=" + "q" * 9000, body=OK),
    "endless_header": Case(
        431,
        ("--max-header-bytes",),
        raw=[_raw("GET /health HTTP/1.1") + b"X-Endless: "] + [b"e" * 65536] * 16,
    ),
    "body_too_large": Case(413, ("--max-body-bytes",), body=_with(prompt="p" * 70_000)),
    "body_too_large_expect": Case(
        413,
        ("--max-body-bytes",),
        raw=_post_head("Content-Length: 900000000\r\nExpect: 100-continue\r\n\r\n"),
    ),
    "body_too_large_chunked": Case(
        413,
        ("--max-body-bytes",),
        raw=_post_head("Transfer-Encoding: chunked\r\n\r\n")
        + b"".join(b"8000\r\n" + b"c" * 0x8000 + b"\r\n" for _ in range(3))
        + b"0\r\n\r\n",
    ),
    "slow_head": Case(
        408,
        ("--header-timeout",),
        raw=[
            b"POST /v1/completions HTTP/1.1\r\n",
            b"Host: r\r\n",
            b"X-A: 1\r\n",
            b"X-B: 2\r\n",
            b"X-C: 3\r\n",
        ],
        pause_s=0.4,
    ),
    "stalled_body": Case(
        408, ("--body-timeout",), raw=_post_head("Content-Length: 100\r\n\r\n") + b'{"model"'
    ),
    "stalled_chunked_body": Case(
        408, ("--body-timeout",), raw=_post_head("Transfer-Encoding: chunked\r\n\r\n") + b"5\r\nhello\r\n"
    ),
}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    supervisor = start_workers(tmp_path_factory.mktemp("router-bad-input"))
    try:
        yield list(supervisor.workers)
    finally:
        supervisor.stop_all()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(
    workers: list[WorkerProcess], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RouterUnderTest]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS)
    async with serve_router(workers, limits=LIMITS, api_keys=ApiKeys(keys)) as running:
        yield running


async def _send(router: RouterUnderTest, case: Case) -> RawAnswer:
    if case.raw is not None:
        answer = await raw_exchange(router.port, case.raw, pause_s=case.pause_s)
        assert answer is not None, "the connection closed without an answer"
        return answer
    content = case.content if case.content is not None else None
    if content is None and case.body is not None:
        content = json.dumps(case.body).encode()  # ASCII escapes: a lone surrogate reaches the server
    async with httpx.AsyncClient(base_url=router.url, timeout=15.0) as client:
        r = await client.request(case.method, case.path, content=content, headers=case.headers)
    return RawAnswer(r.status_code, dict(r.headers), r.content)


@pytest.mark.parametrize("name", list(CASES))
async def test_bad_request_gets_a_4xx_naming_the_problem(router: RouterUnderTest, name: str) -> None:
    case = CASES[name]
    answer = await asyncio.wait_for(_send(router, case), 20.0)  # no hang
    assert answer.status == case.status, answer.body[:300]
    error = answer.error()
    for needle in case.names:
        assert needle in error["message"], (needle, error["message"])
    assert error["type"] in (
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
    )


async def test_after_the_bad_input_the_router_and_workers_still_serve(
    router: RouterUnderTest, workers: list[WorkerProcess]
) -> None:
    assert len(CASES) >= 60
    async with httpx.AsyncClient(base_url=router.url, timeout=30.0) as client:
        for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT)):
            ok = await client.post(path, json=body, headers=AUTH)
            assert ok.status_code == 200, ok.text
    assert all(router.healthy().values())
    assert all(w.proc is not None and w.proc.poll() is None for w in workers)
    for code in range(500, 600):
        assert await router.metric("tessera_router_requests_total", code=str(code)) == 0
