"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol with limits on each request head.

uvicorn bounds neither the size of a request head nor the time it may take to arrive (its
keep-alive timeout only starts after an answer), so one client can hold a connection open for ever
or make the router buffer a header of any size. This protocol answers 431 when the request line and
headers exceed ``RouterLimits.max_header_bytes`` (counted as they arrive, so a single endless header
is cut off too) and 408 when they are not complete within ``header_timeout_s`` of the connection
opening or of the previous answer; a connection that sent nothing by then is closed. A request
httptools cannot parse gets a 400 that says why, and so does a protocol upgrade (the router serves
HTTP/1.1 only, and httptools would drop an upgrade request's body). Each answer is an OpenAI-style
JSON body; then the router stops sending and, for ``LINGER_S``, reads and discards what the client
still sends before it closes: closing at once would reset the connection under a client that is
still writing, and the reset can destroy the answer before the client reads it.

A graceful shutdown (SIGTERM: a restart) answers the requests clients send on the connections they
already have. uvicorn closes a connection idle between two requests at once, so a request the client
had just sent on it was reset unanswered, and the client cannot tell whether it ran (``tessera bench
router --set streams=300 --set rounds=1``, router restarted under 300 clients: 35 of 653 accepted
requests lost so). Here each open connection stays open for ``SHUTDOWN_IDLE_S`` after the shutdown
begins or after its answer in flight ends: a request arriving meanwhile is answered with
``connection: close``, and a connection still idle then is closed (a request sent at that very
instant is still cut off). New connections are refused from the start of the shutdown (uvicorn closes
the listening socket); ``RouterServer`` first takes the connections the kernel had already accepted
on it, which closing it would reset unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import os
import socket
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import httptools
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tessera.api.openai_errors import ApiError
from tessera.router.limits import RouterLimits

LINGER_S = 2.0
SHUTDOWN_IDLE_S = 1.0  # how long a connection waits for a client's next request once shutdown began
# The servers (their shared uvicorn state) whose shutdown began: a connection made after that (uvloop
# may still deliver one it had accepted) is served as shutting down too, or its keep-alive would hold
# the shutdown open for as long as its client keeps sending.
_STOPPING: weakref.WeakSet[ServerState] = weakref.WeakSet()


class _HeadRejected(Exception):
    """Raised from a parser callback to stop parsing a head that is already answered."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a size and a time limit on every request head."""

    limits: ClassVar[RouterLimits] = RouterLimits()
    on_reject: ClassVar[Callable[[int], None] | None] = None  # told the status of every answer it gives

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # bytes received since the current request head began
        self._reading_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._rejection: ApiError | None = None
        self._answered = False  # by this protocol: nothing more is read or answered
        self._shutting_down = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()
        if self.server_state in _STOPPING:
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:  # what follows is discarded
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.limits.max_header_bytes:
            self._answer(self._head_too_large())

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._rejection = self._head_too_large()
        elif self.parser.should_upgrade():  # httptools would drop the body of such a request
            upgrade = next((v for n, v in self.headers if n == b"upgrade"), b"").decode("latin-1")
            self._rejection = ApiError(400, f"protocol upgrades are not supported (Upgrade: {upgrade[:64]}); "
                                       "send the request without 'Connection: upgrade'", param="Upgrade",
                                       code="upgrade_not_supported")  # fmt: skip
        if self._rejection is not None:
            raise _HeadRejected  # httptools stops; uvicorn answers through send_400_response
        super().on_headers_complete()
        if self._shutting_down and self.cycle is not None:
            self.cycle.keep_alive = False  # answered with 'connection: close', then closed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._answered and not self.transport.is_closing() and not self.pipeline:
            self._reading_head, self._head_bytes = True, 0
            self._arm_head_timer()
            if self._shutting_down:  # its answer promised keep-alive: the client may send one more
                self.loop.call_later(SHUTDOWN_IDLE_S, self._close_if_idle)

    def shutdown(self) -> None:
        """Begin a graceful shutdown (uvicorn calls it on SIGTERM): see the module docstring."""
        _STOPPING.add(self.server_state)
        self._shutting_down = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.loop.call_later(SHUTDOWN_IDLE_S, self._close_if_idle)
        elif not cycle.response_started:
            cycle.keep_alive = False  # its answer says 'connection: close'
        # An answer under way announced keep-alive: the connection waits after it (on_response_complete).

    def _close_if_idle(self) -> None:
        """Close the connection unless a request is arriving or being answered."""
        if self.transport.is_closing() or self._head_bytes > 0:
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Answer a head that failed to parse (or that a callback rejected) in OpenAI format."""
        error, self._rejection = self._rejection, None
        if error is None:
            cause = sys.exc_info()[1]  # uvicorn calls this while handling the parser's error
            detail = str(cause) if isinstance(cause, httptools.HttpParserError) and str(cause) else msg
            error = ApiError(400, f"malformed HTTP request: {detail}", code="invalid_http_request")
        self._answer(error)

    def _head_too_large(self) -> ApiError:
        return ApiError(431, f"the request line and headers are larger than {self.limits.max_header_bytes} "
                        "bytes, the most this router accepts (setting --max-header-bytes); send fewer or "
                        "shorter headers", code="request_header_fields_too_large")  # fmt: skip

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._answered or self.transport.is_closing():
            return
        if self._head_bytes == 0:  # an idle connection: nothing to answer
            self.transport.close()
            return
        self._answer(ApiError(408, f"the request line and headers did not arrive within "
                              f"{self.limits.header_timeout_s:g} s (setting --header-timeout); send them "
                              "at once", code="request_timeout"))  # fmt: skip

    def _answer(self, error: ApiError) -> None:
        """Write ``error`` (unless an answer has started) and close the connection."""
        self._cancel_head_timer()
        if self._answered or self.transport.is_closing():
            return
        self._answered = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # an answer is under way: it cannot be replaced
                self.transport.close()
                return
            # A body that broke the parser: the application sees the client gone.
            cycle.disconnected = True
            cycle.message_event.set()
        body = json.dumps(error.body()).encode()
        head = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}".encode()]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
        if self.on_reject is not None:
            self.on_reject(error.status)


class RouterServer(uvicorn.Server):
    """uvicorn's server for the router. Closing a listening socket resets the connections the kernel
    had accepted on it that the event loop had not taken yet, and a client that connected and sent its
    request just then loses it: a router busy with 300 streams left such connections for up to 0.2 s,
    and up to 49 of about 800 requests were lost so when it restarted (``tessera bench router
    --set streams=300 --set rounds=1``). At shutdown this server takes the connections waiting there,
    at once (a client told to reconnect must not find the socket still open), closes the socket, and
    serves them as every open connection is at shutdown (see the module docstring)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        _STOPPING.add(self.server_state)
        servers = getattr(self, "servers", [])
        waiting: list[socket.socket] = []
        for server in servers:
            for listener in server.sockets:
                with socket.socket(fileno=os.dup(listener.fileno())) as taker:
                    taker.setblocking(False)
                    while True:  # no await in between: the loop accepts nothing new meanwhile
                        try:
                            waiting.append(taker.accept()[0])
                        except (BlockingIOError, InterruptedError):
                            break
        for server in servers:
            server.close()  # uvicorn's shutdown closes it again, which does nothing
        config = self.config

        def factory() -> asyncio.Protocol:  # the protocol uvicorn serves each connection with
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        loop = asyncio.get_running_loop()
        for conn in waiting:
            conn.setblocking(False)
            await loop.connect_accepted_socket(factory, conn)
        await super().shutdown(sockets)


def router_server_config(app: FastAPI, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration that serves a router app (``create_router_app``) with its limits: the
    guarded protocol, and the keep-alive timeout."""
    limits: RouterLimits = app.state.limits
    protocol = type("RouterHttpProtocol", (GuardedHttpToolsProtocol,),
                    {"limits": limits, "on_reject": staticmethod(app.state.metrics.rejected)})  # fmt: skip
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, ws="none",
                          timeout_keep_alive=limits.keep_alive_s)  # fmt: skip


class SideServer(uvicorn.Server):
    """A second listener of the router's process (``tessera router --metrics-port``): the process's
    signals stay with the main server, whose end stops this one (``run_beside``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def side_server_config(app: FastAPI, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """The configuration of the metrics port: the router app's ``app.state.ops`` under the same guarded
    protocol and limits, without a lifespan (the router app's polls run in its own)."""
    config = router_server_config(app, host=host, port=port, log_level=log_level)
    config.app, config.lifespan = app.state.ops, "off"
    return config


def run_beside(main: uvicorn.Server, side: SideServer) -> None:
    """Serve ``main`` and ``side`` in one event loop until ``main`` stops (SIGTERM/SIGINT), then stop
    ``side``."""

    async def both() -> None:
        task = asyncio.create_task(side.serve(), name="metrics-port")
        try:
            await main.serve()
        finally:
            side.should_exit = True
            await task

    asyncio.run(both())
