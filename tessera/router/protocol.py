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
"""

from __future__ import annotations

import asyncio
import http
import json
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tessera.api.openai_errors import ApiError
from tessera.router.limits import RouterLimits

LINGER_S = 2.0


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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

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

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._answered and not self.transport.is_closing() and not self.pipeline:
            self._reading_head, self._head_bytes = True, 0
            self._arm_head_timer()

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


def router_server_config(app: FastAPI, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration that serves a router app (``create_router_app``) with its limits: the
    guarded protocol, and the keep-alive timeout."""
    limits: RouterLimits = app.state.limits
    protocol = type("RouterHttpProtocol", (GuardedHttpToolsProtocol,),
                    {"limits": limits, "on_reject": staticmethod(app.state.metrics.rejected)})  # fmt: skip
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, ws="none",
                          timeout_keep_alive=limits.keep_alive_s)  # fmt: skip
