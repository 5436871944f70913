"""The transport the router's requests to worker instances go through: HTTP/1.1 on asyncio, parsed
by httptools (llhttp, the parser the router's own server runs), behind ``httpx.AsyncClient``.

Why not httpx's own transport: profiled at 100 concurrent streams (``tessera bench router``, py-spy
on the router), httpcore's connection pool and its layers took over half the router's CPU. The pool
scans every connection it holds (and asks each socket whether it is readable) whenever a request
starts or a response closes, 26% of the samples; reading the events went through anyio, h11 and
five nested async generators per chunk, another 30%. Here a connection is an ``asyncio.Protocol``:
llhttp parses what arrives as it arrives, a response body is handed over as whatever bytes have
arrived since the consumer last asked (one relay write for a burst of events), and the idle
connections of each instance wait on a stack, taken and returned in constant time.

What the router relies on is kept: ``httpx.ConnectError`` / ``ConnectTimeout`` when an instance
cannot be reached, an ``httpx.RemoteProtocolError`` when it closes the connection before its answer
is complete (or answers what llhttp cannot parse), and closing a response before its end closes the
connection, which is how the worker learns that the client left and cancels the request. A body is
complete only as framed by ``Content-Length`` or chunked encoding, which the workers' server
(uvicorn) always sends; one that ends only with the connection counts as broken off.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
import httpx

# An idle connection is not reused after this long: the workers' server (uvicorn) closes one idle for
# 5 s, and a request sent as it closes would be lost with it.
KEEPALIVE_S = 4.0
# Body bytes a connection holds for a consumer that does not read (a slow client downstream) before it
# stops reading from the socket, so that the instance's writes wait instead of the router's memory.
HIGH_WATER_BYTES = 256 * 1024


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to an instance, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.head: asyncio.Future[None] | None = None  # set once the response head is parsed
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False  # the response body has ended
        self.error: httpx.TransportError | None = None
        self.waiter: asyncio.Future[None] | None = None  # a consumer waiting for body bytes
        self.paused = False
        # Set while idle on its transport's stack: takes it off when the instance closes it, so the
        # stacks of instances that went away (pods replaced) do not keep dead connections for ever.
        self.on_lost: Callable[[], None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self.head is None or self.complete:  # nothing asked: an instance does not speak first
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"the instance's answer is not valid HTTP/1.1 ({exc})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_lost is not None:
            self.on_lost()
        if self.head is not None and not self.complete:
            what = "its answer's body" if self.head.done() else "an answer"
            self._fail(httpx.RemoteProtocolError(f"the instance closed the connection before {what} ended"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()
        self._wake()

    # used by UpstreamTransport and _Body

    def start(self, head: bytes, body: bytes) -> None:
        """Send a request; its answer's head is awaited on ``self.head``."""
        assert self.transport is not None
        self.head = asyncio.get_running_loop().create_future()
        self.status, self.headers, self.chunks, self.buffered = 0, [], [], 0
        self.complete, self.error = False, None
        self.transport.write(head + body)  # one write: the worker reads the request in one piece

    def take(self) -> bytes:
        """The body bytes that arrived since the last call (b"" when none)."""
        data = b"".join(self.chunks)
        self.chunks, self.buffered = [], 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self) -> None:
        """Until body bytes arrive, the body ends or the connection fails."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: httpx.TransportError) -> None:
        self.error = error
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; the connection goes back to its stack once the body has ended,
    and is closed when the body is closed before that."""

    def __init__(self, conn: _Connection, transport: UpstreamTransport, key: tuple[str, int]) -> None:
        self.conn = conn
        self.transport = transport
        self.key = key
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while not self.done:
            data = conn.take()
            if data:
                yield data
            elif conn.complete:
                self.done = True
                self.transport.release(self.key, conn)
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait()

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.conn.close()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to instances (plain ``http://``), keeping idle connections per host and port.

    ``connect_timeout_s`` bounds opening a connection; an answer may take as long as it takes (a stream
    lasts as long as its generation), as with the router's former ``httpx.Timeout(None, connect=5)``.
    """

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the router reaches instances over http://, not {request.url}")
        key = (request.url.host, request.url.port or 80)
        head = _request_head(request)
        body = await request.aread()
        conn = self._reuse(key) or await self._connect(key, request)
        conn.start(head, body)
        try:
            await conn.head  # type: ignore[misc]  # set by start()
        except BaseException:  # failed, or cancelled (the client left): the worker sees the close
            conn.close()
            raise
        return httpx.Response(conn.status, headers=conn.headers, stream=_Body(conn, self, key),
                              extensions={"http_version": b"HTTP/1.1"})  # fmt: skip

    def _reuse(self, key: tuple[str, int]) -> _Connection | None:
        """The most recently idle open connection to ``key``; expired ones are closed on the way."""
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            conn.on_lost = None
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int], request: httpx.Request) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(_Connection, *key)
        except TimeoutError:
            message = f"no connection to {key[0]}:{key[1]} within {self.connect_timeout_s:g} s"
            raise httpx.ConnectTimeout(message, request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}", request=request) from None
        conn.transport = transport  # uvloop calls connection_made only after this returns
        return conn

    def release(self, key: tuple[str, int], conn: _Connection) -> None:
        """Put a connection whose answer has ended back on its stack; drop the expired ones below it
        (the stack is used from the top, so those at the bottom are the ones idle longest)."""
        if conn.closed:
            return
        now = time.monotonic()
        conn.idle_since = now
        stack = self._idle.setdefault(key, deque())
        while stack and (stack[0].closed or now - stack[0].idle_since >= KEEPALIVE_S):
            expired = stack.popleft()
            expired.on_lost = None
            expired.close()
        stack.append(conn)
        conn.on_lost = functools.partial(self._forget, key, conn)

    def _forget(self, key: tuple[str, int], conn: _Connection) -> None:
        """Take an idle connection the instance closed off its stack (and the stack once empty)."""
        conn.on_lost = None
        stack = self._idle.get(key)
        if stack is not None:
            stack.remove(conn)
            if not stack:
                del self._idle[key]

    async def aclose(self) -> None:
        stacks, self._idle = self._idle, {}
        for stack in stacks.values():
            for conn in stack:
                conn.on_lost = None
                conn.close()


def _request_head(request: httpx.Request) -> bytes:
    """The request line and headers (httpx has added host and content-length); LocalProtocolError
    for a name or value that would break the framing."""
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if b"\r" in name or b"\n" in name or b":" in name or b"\r" in value or b"\n" in value:
            raise httpx.LocalProtocolError(f"invalid header {name!r}", request=request)
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    return b"".join(lines)
