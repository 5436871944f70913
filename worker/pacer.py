"""Token pacer (Andes §5, Fig. 10; docs/papers.md, "Andes: token pacer").

A pacer takes a request's tokens as they are generated (delivery times ``D_i``)
and releases token i at its consumption time ``A_i = max(D_i, A_{i-1} + 1/r)``
(``A_1 = D_1``): never faster than the user reads. Tokens generated ahead of
the reader wait in the buffer, which is what lets the scheduler pause a
request without the user noticing. ``TokenPacer`` is the pure state (time is
passed in); ``pace`` wraps an async token stream with it for the worker's SSE
streaming, with the clock and sleep injected so tests run on virtual time.
The client-side pacer is described in docs/pacer.md.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from tessera.core.qoe import QoEParams, qoe_params
from tessera.core.request import Request

T = TypeVar("T")


class TokenPacer:
    """Release schedule of one request's tokens at its reader's pace (pure; times are arguments)."""

    __slots__ = ("_delivered_last", "_release", "params")

    def __init__(self, params: QoEParams) -> None:
        self.params = params
        self._release: list[float] = []  # A_i of every token pushed, non-decreasing
        self._delivered_last = float("-inf")

    @classmethod
    def for_request(cls, req: Request) -> TokenPacer:
        """A pacer with the request's T* and reading speed (from its service class)."""
        return cls(qoe_params(req))

    @property
    def delivered(self) -> int:
        """Tokens pushed so far (n)."""
        return len(self._release)

    def push(self, t: float) -> float:
        """A token was generated at ``t``; returns the time it may be released (its ``A_i``)."""
        if t < self._delivered_last:
            raise ValueError(f"token delivered at {t} before the previous one at {self._delivered_last}")
        self._delivered_last = t
        release = t if not self._release else max(t, self._release[-1] + 1.0 / self.params.reading_speed_tps)
        self._release.append(release)
        return release

    def released_by(self, t: float) -> int:
        """How many tokens may have been released by time ``t``."""
        return bisect.bisect_right(self._release, t)

    def buffered(self, t: float) -> int:
        """Tokens generated but held back at time ``t``."""
        return self.delivered - self.released_by(t)

    def next_release_at(self, t: float) -> float | None:
        """When the next held-back token is due after ``t`` (None: nothing buffered)."""
        i = self.released_by(t)
        return self._release[i] if i < len(self._release) else None

    def slack(self, t: float) -> float:
        """Seconds the server may stop generating at ``t`` before the user stalls (CHOICE):
        ``max(A_n + 1/r, I_{n+1}) - t``; ``arrival + T* - t`` before the first token."""
        n = self.delivered
        due = self.params.ideal_time(n + 1)
        if n:
            due = max(due, self._release[-1] + 1.0 / self.params.reading_speed_tps)
        return due - t


async def pace(
    stream: AsyncIterable[T],
    pacer: TokenPacer,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncIterator[T]:
    """Yield ``stream``'s tokens no faster than ``pacer`` allows, reading ahead into a buffer.

    Each token is stamped with ``clock()`` when it arrives and released at its
    consumption time. The stream is read concurrently with the waiting, so
    generation is never held up by the pacing. Errors of the stream surface
    after the tokens that came before them.
    """
    source = aiter(stream)
    buffer: deque[tuple[float, T]] = deque()
    pending: asyncio.Future[T] | None = None
    exhausted = False
    error: BaseException | None = None
    try:
        while True:
            while buffer and buffer[0][0] <= clock():
                yield buffer.popleft()[1]
            if exhausted and not buffer:
                if error is not None:
                    raise error
                return
            if pending is None and not exhausted:
                pending = asyncio.ensure_future(anext(source))
            waits: set[asyncio.Future] = {pending} if pending is not None else set()
            timer = asyncio.ensure_future(sleep(buffer[0][0] - clock())) if buffer else None
            if timer is not None:
                waits.add(timer)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if timer is not None and not timer.done():
                timer.cancel()
            if pending is not None and pending.done():
                done, pending = pending, None
                try:
                    item = done.result()
                except StopAsyncIteration:
                    exhausted = True
                except Exception as exc:  # delivered after the tokens already buffered
                    exhausted, error = True, exc
                else:
                    buffer.append((pacer.push(clock()), item))
    finally:
        if pending is not None:
            pending.cancel()
