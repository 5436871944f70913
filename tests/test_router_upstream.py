"""The router's upstream transport (tessera.router.upstream) against a raw asyncio server that answers
exactly what each test needs: keep-alive reuse, a worker that breaks off, a client that leaves, a
consumer that does not read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from tessera.router import upstream
from tessera.router.upstream import UpstreamTransport
from tessera.worker.engines.vllm_process import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and its Content-Length body; b"" once the client closed."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
    return head + await reader.readexactly(length) if head else b""


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on loopback; yields its URL and a one-item list counting the connections made."""
    connections = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    port = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


async def _post(transport: UpstreamTransport, url: str, body: bytes = b"{}") -> httpx.Response:
    return await transport.handle_async_request(httpx.Request("POST", f"{url}/v1/completions", content=body))


async def test_answers_are_read_whole_and_streamed_on_one_kept_alive_connection() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while request := await _read_request(reader):
            seen.append(request)
            writer.write(CHUNKED_HEAD + _chunk(b"data: 1\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async with _server(handler) as (url, connections):
        transport = UpstreamTransport(5.0)
        for body in (b'{"a": 1}', b'{"b": 2}'):
            response = await _post(transport, url, body)
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert b"".join([part async for part in response.aiter_bytes()]) == b"data: 1\n\ndata: [DONE]\n\n"
            await response.aclose()
        await transport.aclose()
    assert connections[0] == 1
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n") and seen[0].endswith(b'\r\n\r\n{"a": 1}')
    assert b"content-length: 8" in seen[1].lower() and seen[1].endswith(b'{"b": 2}')


async def test_an_idle_connection_past_its_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "KEEPALIVE_S", 0.0)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await _read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

    async with _server(handler) as (url, connections):
        transport = UpstreamTransport(5.0)
        for _ in range(2):
            response = await _post(transport, url)
            assert await response.aread() == b"{}"
        await transport.aclose()
    assert connections[0] == 2


async def test_an_idle_connection_the_worker_closes_leaves_the_pool() -> None:
    expire = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await expire.wait()  # then closes, as on keep-alive expiry

    async with _server(handler) as (url, _):
        transport = UpstreamTransport(5.0)
        response = await _post(transport, url)
        assert await response.aread() == b"{}"
        assert [len(stack) for stack in transport._idle.values()] == [1]
        expire.set()
        for _ in range(50):
            if not transport._idle:
                break
            await asyncio.sleep(0.05)
        assert transport._idle == {}


async def test_a_stream_closed_before_its_end_closes_the_connection_for_the_worker_to_see() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD + _chunk(b"data: 1\n\n"))
        if await reader.read(1) == b"":  # the router closed its side
            gone.set()

    async with _server(handler) as (url, _):
        transport = UpstreamTransport(5.0)
        response = await _post(transport, url)
        async for _part in response.aiter_bytes():
            break
        await response.aclose()
        await asyncio.wait_for(gone.wait(), 5.0)
        await transport.aclose()


async def test_a_request_cancelled_before_its_answer_closes_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if await reader.read(1) == b"":  # never answered: the client gave up
            gone.set()

    async with _server(handler) as (url, _):
        transport = UpstreamTransport(5.0)
        task = asyncio.create_task(_post(transport, url))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), 5.0)


async def test_a_worker_that_breaks_off_raises_a_protocol_error_before_and_during_the_body() -> None:
    async def no_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)

    async def half_a_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(CHUNKED_HEAD + _chunk(b"data: 1\n\n"))
        await writer.drain()

    async with _server(no_answer) as (url, _):
        with pytest.raises(httpx.RemoteProtocolError, match="before an answer ended"):
            await _post(UpstreamTransport(5.0), url)
    async with _server(half_a_stream) as (url, _):
        response = await _post(UpstreamTransport(5.0), url)
        parts: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError, match="before its answer's body ended"):
            async for part in response.aiter_bytes():
                parts.append(part)
        assert parts == [b"data: 1\n\n"]  # what came before the break is relayed


async def test_an_answer_that_is_not_http_raises_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await reader.read(1)

    async with _server(garbage) as (url, _):
        with pytest.raises(httpx.RemoteProtocolError, match="not valid HTTP"):
            await _post(UpstreamTransport(5.0), url)


async def test_an_instance_that_refuses_the_connection_raises_connect_error() -> None:
    with pytest.raises(httpx.ConnectError):
        await _post(UpstreamTransport(5.0), f"http://127.0.0.1:{free_port()}")


async def test_a_consumer_that_does_not_read_stops_the_socket_reads_then_gets_every_byte() -> None:
    body = bytes(range(256)) * 32 * 1024  # 8 MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async with _server(handler) as (url, _):
        response = await _post(UpstreamTransport(5.0), url)
        await asyncio.sleep(0.5)  # the server has written all it could; nothing was read
        held = response.stream.conn.buffered  # type: ignore[attr-defined]
        assert 0 < held < 1024 * 1024  # the high water mark and one socket read at most
        assert await response.aread() == body
