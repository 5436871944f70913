"""Sending one request to a worker instance and relaying its answer, through every failure.

- An instance that refuses the connection leaves the rotation and the request goes to the next best
  one (nothing was sent, so nothing is lost); only a refused connection or a failed poll takes an
  instance out of the rotation, never what a client sent.
- An instance that breaks off before its answer (killed, reset) is tried once more on another
  instance: the client has seen nothing yet. A second break answers 502.
- A client that leaves while the router waits for the answer or relays a stream closes the upstream
  request (``ClientWatch`` cancels the task), so the worker cancels it.
- A stream the instance breaks off mid-way ends with an OpenAI-style SSE error event and
  ``data: [DONE]``, and counts as 502 in the router's metrics.

Every answer of a known class is judged against its class's SLO as the client saw it
(``record_delivery``): from its arrival at the router to the token chunks relayed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx
from starlette.types import Receive, Send

from tessera.api.openai_errors import ApiError
from tessera.core.request import ServiceClass
from tessera.core.routing import InstanceLoad, NoInstance
from tessera.core.slo import delivered_slo_met
from tessera.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from tessera.core.policies.qlm.estimator import TokenStats
    from tessera.router.backends import Backend


class Picked(Protocol):
    """A routing decision as relaying reads it: the instance and the prompt tokens it will prefill."""

    @property
    def load(self) -> InstanceLoad: ...

    @property
    def prefill_tokens(self) -> int: ...


class RelayState(Protocol):
    """What relaying uses of the router's state (``tessera.router.app.RouterState``, which imports this
    module: named here as a protocol so that the two do not import each other)."""

    @property
    def backends(self) -> Mapping[str, Backend]: ...

    @property
    def stats(self) -> Mapping[str, TokenStats]: ...

    def pick(self, model: str, kind: str, exclude: set[str], prompt_text: str = "",
             ttft_slo_s: float | None = None, session: str = "", prompt_token_ids: Sequence[int] = (),
             only: str = "") -> Picked:  # fmt: skip
        """The instance for a request, not one of ``exclude``."""
        ...

    def set_health(self, backend: str, healthy: bool) -> None:
        """Take an instance in or out of the rotation."""
        ...

    def ended(self, load: InstanceLoad, kind: str) -> None:
        """A request of ``kind`` sent to ``load`` has ended."""
        ...


_DONE = "data: [DONE]"
_TOKEN_MARK = b'"finish_reason": null'
_DONE_MARK = _DONE.encode()
_ERROR_MARK = b'data: {"error"'
# Shorter than every marker, so a marker is never counted in two windows.
_TAIL_BYTES = min(len(_TOKEN_MARK), len(_DONE_MARK), len(_ERROR_MARK)) - 1


@dataclass(frozen=True, slots=True)
class Upstream:
    """A client's request as the router sends it to an instance."""

    path: str
    content: bytes
    headers: list[tuple[str, str]]
    model: str
    kind: str
    stream: bool
    prompt_text: str = ""
    ttft_slo_s: float | None = None  # the request class's TTFT SLO
    session: str = ""  # the session key (the session header, else the body's user)
    prompt_token_ids: tuple[int, ...] = ()  # the prompt as token ids (as sent, or as the worker tokenizes it)
    instance: str = ""  # the instance Chiron's dispatch placed it on (else the route chooses)


@dataclass(frozen=True, slots=True)
class Answer:
    """An instance's answer: read whole, or a stream of events left open for ``relay_events``."""

    load: InstanceLoad
    response: httpx.Response
    streaming: bool
    prefill_tokens: int = 0  # counted in the instance's PrefillQueue until the stream's first token


class ClientWatch:
    """Cancels the task that answers a request when its client disconnects, for as long as the watch
    runs; ``left`` then says why it was cancelled. Started once the body has been read (the next
    message can only be the disconnect). One watch covers waiting for the answer and relaying a
    stream, where a task per phase (and Starlette's task group around a streamed response) cost the
    router more CPU than the relaying."""

    def __init__(self, receive: Receive) -> None:
        self.left = False
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._until_gone(receive))

    async def _until_gone(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        """Stop watching (the answer has ended)."""
        self._watch.cancel()


@functools.lru_cache(maxsize=1024)
def _url(text: str) -> httpx.URL:
    """An instance's endpoint, parsed once (the URLs are few: each instance's two endpoints)."""
    return httpx.URL(text)


async def send(
    state: RelayState, metrics: RouterMetrics, transport: httpx.AsyncBaseTransport, up: Upstream
) -> Answer:
    """Send ``up`` to the best instance and wait for its answer: the whole answer unless it is a
    stream of events, which is returned open with the instance counting it outstanding (the relay
    closes it). ApiError 503 when no instance is left, 502 when two instances broke off."""
    tried: set[str] = set()
    broken: str | None = None
    while True:
        try:
            picked = state.pick(up.model, up.kind, tried, up.prompt_text, up.ttft_slo_s, up.session,
                                up.prompt_token_ids, up.instance)  # fmt: skip
        except NoInstance as exc:
            if broken is None:
                raise ApiError(503, f"{exc}; retry when an instance is ready", code="no_instance") from None
            raise ApiError(502, f"the instance {broken} broke off while answering and no other instance is "
                           f"ready ({exc}); retry the request", code="upstream_failed") from None  # fmt: skip
        load, prefill = picked.load, picked.prefill_tokens
        tried.add(load.instance)
        url = f"{state.backends[load.instance].url}{up.path}"
        # Straight to the transport, not through an httpx client: its cookies, redirects, auth and
        # default headers have no use here and cost as much CPU per request as the transport.
        request = httpx.Request("POST", _url(url), content=up.content, headers=up.headers)
        load.outstanding += 1
        load.interactive += up.kind == "interactive"
        load.prefill.sent(prefill, time.monotonic(), load.profile)
        response: httpx.Response | None = None
        kept_open = False
        try:
            response = await transport.handle_async_request(request)  # its body not read yet
            events = response.headers.get("content-type", "").startswith("text/event-stream")
            if up.stream and response.status_code == 200 and events:
                kept_open = True
                return Answer(load, response, streaming=True, prefill_tokens=prefill)
            await response.aread()  # an answer in one piece (errors included) is relayed in one piece
            if response.status_code == 503 and _draining(response):
                # A pod being replaced finishes its requests but takes no new one: another instance
                # does (the next readiness poll would take the pod out of the rotation too).
                state.set_health(load.instance, False)
                continue
        except (httpx.ConnectError, httpx.ConnectTimeout):
            state.set_health(load.instance, False)  # not reachable: out until a poll sees it ready
            metrics.upstream_failures.labels(load.instance).inc()
            continue
        except httpx.HTTPError as exc:
            metrics.upstream_failures.labels(load.instance).inc()
            if broken is not None:
                message = (
                    f"the instances {broken} and {load.instance} both broke off while answering ({exc!r})"
                )
                raise ApiError(502, f"{message}; retry the request", code="upstream_failed") from None
            broken = load.instance
            continue
        finally:
            if not kept_open:
                # Its prefill first: the end may release held work, which must not count it as waiting.
                load.prefill.first_token(prefill)
                state.ended(load, up.kind)
                if response is not None:
                    await response.aclose()
        return Answer(load, response, streaming=False)


def record_delivery(
    metrics: RouterMetrics,
    model: str,
    kind: str,
    service_class: ServiceClass | None,
    *,
    status: int,
    arrival: float,
    finished: float,
    first_token: float | None = None,
    last_token: float | None = None,
    tokens: int = 0,
    tenant: str = "",
) -> None:
    """Record an answer's client-side TTFT (when a token reached the client), its mean ITL (a
    successful stream of two token chunks or more) and its SLO verdict; nothing before the class is
    known (``service_class`` None)."""
    if service_class is None:
        return
    met = delivered_slo_met(service_class, status=status, arrival=arrival, finished=finished,
                            first_token=first_token, last_token=last_token, tokens=tokens)  # fmt: skip
    ttft = itl = None
    if first_token is not None:
        ttft = first_token - arrival
        if 200 <= status < 300 and tokens > 1 and last_token is not None:
            itl = (last_token - first_token) / (tokens - 1)
    metrics.delivered(model, kind, service_class.name, met, ttft, itl, tenant)


def _draining(response: httpx.Response) -> bool:
    """Whether a worker's answer says it is shutting down (its error code ``draining``)."""
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("code") == "draining"


async def relay_stream(
    send: Send,
    state: RelayState,
    metrics: RouterMetrics,
    answer: Answer,
    headers: list[tuple[bytes, bytes]],
    *,
    model: str,
    kind: str,
    start: float,
    service_class: ServiceClass | None = None,
    tenant: str = "",
) -> int:
    """Relay the instance's server-sent events to the client (ASGI ``send``) as they come; an error
    event and ``[DONE]`` if the instance breaks off. Counts the answer when it ends: 200, 502 when it
    broke off or the worker ended it with an error event of its own, 499 when the client left (the
    task is cancelled: ``ClientWatch``); and records what it delivered against ``service_class``'s
    SLO (``record_delivery``), for ``tenant`` too; returns the token chunks relayed."""
    load, response, prefill_tokens = answer.load, answer.response, answer.prefill_tokens
    tokens = 0
    first_at = last_at = None  # when the first and the latest token chunks were relayed
    code = 499  # unless the stream reaches its end: the task is cancelled when the client leaves
    # The body as the transport gives it, not through httpx's decoding layers (three generators per
    # chunk): the router asks for no content encoding, and the workers' events come unencoded.
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    try:
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        done = failed = False
        tail = b""  # the end of the previous chunk: a marker may straddle two chunks
        try:
            # Chunks are relayed as they arrive, not split into lines: one write per chunk keeps the
            # router's cost per stream low; the markers it reads are found in the bytes.
            async for chunk in stream:
                window = tail + chunk
                # Token chunks are the ones whose choice is not finished (an estimate for stats).
                found = window.count(_TOKEN_MARK)
                if found:
                    last_at = time.perf_counter()
                    if not tokens:
                        first_at = last_at
                        # Its prefill is done: no longer ahead of the next request's first token.
                        load.prefill.first_token(prefill_tokens)
                        prefill_tokens = 0
                    tokens += found
                done = done or _DONE_MARK in window
                failed = failed or _ERROR_MARK in window
                tail = window[-_TAIL_BYTES:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            reason = "it ended the stream without [DONE]"
        except httpx.HTTPError as exc:
            reason = f"{exc!r}"
        end = b""
        if done:
            code = 502 if failed else 200
        else:
            code = 502
            metrics.upstream_failures.labels(load.instance).inc()
            error = ApiError(502, f"the instance {load.instance} broke off this stream ({reason}); the "
                             "answer is incomplete: retry the request", code="upstream_failed")  # fmt: skip
            end = f"\ndata: {json.dumps(error.body())}\n\n{_DONE}\n\n".encode()
        await send({"type": "http.response.body", "body": end, "more_body": False})
        return tokens
    finally:
        await response.aclose()
        load.prefill.first_token(prefill_tokens)
        state.ended(load, kind)
        finished = time.perf_counter()
        metrics.answered(model, kind, code, finished - start, tenant)
        record_delivery(metrics, model, kind, service_class, status=code, arrival=start, finished=finished,
                        first_token=first_at, last_token=last_at, tokens=tokens, tenant=tenant)  # fmt: skip
        if tokens:
            state.stats[model].observe_output(tokens)
