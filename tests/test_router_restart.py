"""A router restarting (SIGTERM) answers every request a client sent on a connection it already had,
refuses new connections, and then exits: real sim worker behind the real router served by its server
(``RouterServer``, the router's protocol) on loopback. uvicorn alone closed a connection idle between
two requests at the start of its shutdown, and reset the connections the kernel had accepted that the
event loop had not taken yet, so requests sent on them just then were lost."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import uvicorn
from router_harness import CLASS_HEADER, MODEL, start_workers

from tessera.local.supervisor import WorkerProcess
from tessera.router.app import RouterState, create_router_app
from tessera.router.protocol import SHUTDOWN_IDLE_S, RouterServer, router_server_config
from tessera.worker.engines.vllm_process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    supervisor = start_workers(tmp_path_factory.mktemp("router-restart"), 1)
    try:
        yield supervisor.workers[0]
    finally:
        supervisor.stop_all()


@asynccontextmanager
async def _router(worker: WorkerProcess) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    app = create_router_app(RouterState([worker.backend()]), poll_interval_s=0.5)
    port = free_port()
    server = RouterServer(router_server_config(app, host="127.0.0.1", port=port))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the router did not start"
        await asyncio.sleep(0.02)
    try:
        yield server, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15.0)


def _request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"{CLASS_HEADER}: chat\r\nContent-Length: {len(data)}\r\n\r\n")  # fmt: skip
    return head.encode() + data


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer read off a kept-alive connection: status, headers, body (chunked or sized)."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20.0)).decode("latin-1")
    lines = head.split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding") == "chunked":
        body = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20.0)
    else:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 20.0)
    return int(lines[0].split()[1]), headers, body


async def _shutdown_begins(server: uvicorn.Server, port: int) -> None:
    """Start the graceful shutdown (what SIGTERM does) and wait until it refuses new connections."""
    server.should_exit = True
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            return
        writer.close()
        await asyncio.sleep(0.02)
    raise AssertionError("the router still accepted connections after the shutdown began")


async def test_a_request_on_an_idle_kept_alive_connection_is_answered_during_shutdown(
    worker: WorkerProcess,
) -> None:
    async with _router(worker) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        writer.write(_request(body))
        status, headers, _ = await _answer(reader)
        assert status == 200 and headers.get("connection") != "close"  # kept alive
        await _shutdown_begins(server, port)
        # The client reuses its connection, as pooled clients do: the request is answered, and the
        # answer tells it the connection closes.
        writer.write(_request(body))
        status, headers, data = await _answer(reader)
        assert status == 200 and headers["connection"] == "close" and json.loads(data)["choices"]
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # then closed
        writer.close()


async def test_after_a_stream_in_flight_at_shutdown_the_next_request_is_answered(
    worker: WorkerProcess,
) -> None:
    async with _router(worker) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        writer.write(_request({"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": True}))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20.0)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        await _shutdown_begins(server, port)  # the stream is still under way
        rest = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 30.0)
        assert b"data: [DONE]" in rest and b'"error"' not in rest  # finished whole
        writer.write(_request({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
        status, headers, _ = await _answer(reader)
        assert status == 200 and headers["connection"] == "close"
        writer.close()


async def test_a_connection_left_idle_during_shutdown_is_closed_after_the_wait(worker: WorkerProcess) -> None:
    async with _router(worker) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        writer.write(_request({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
        assert (await _answer(reader))[0] == 200
        loop = asyncio.get_running_loop()
        began = loop.time()
        await _shutdown_begins(server, port)
        assert await asyncio.wait_for(reader.read(), 10.0) == b""  # closed cleanly, no answer pending
        assert loop.time() - began >= SHUTDOWN_IDLE_S * 0.9
        writer.close()


async def test_a_connection_the_loop_had_not_taken_yet_is_answered_during_shutdown(
    worker: WorkerProcess,
) -> None:
    async with _router(worker) as (server, port):
        # A loop too busy to accept: the kernel completes the handshake and holds the request.
        loop = asyncio.get_running_loop()
        for listening in server.servers:
            for sock in listening.sockets:
                loop.remove_reader(sock.fileno())
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        writer.write(_request({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
        await writer.drain()
        server.should_exit = True
        status, headers, _ = await _answer(reader)
        assert status == 200 and headers["connection"] == "close"
        writer.close()
