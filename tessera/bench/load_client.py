"""The HTTP client a bench's load generator sends many concurrent streams with.

A bench's client is the instrument, and with httpx's own connection pool it was the slowest part of
``tessera bench router`` at 1,000 streams: one 1,000-stream wave cost the client 8-13 CPU-seconds
against 1.3-1.5 for each worker (measured from /proc on this 2-core machine), the pool's work per
request start and end growing with the connections it holds to one origin. Sent through the router
(one origin) the wave took 17 s against 11.5 s straight to two workers, so the router/direct ratio
measured the client's pool, not the router; a single-process client on a 16-core machine gave the
same ratio. On the router's own upstream transport (``tessera.router.upstream``: llhttp parsing, a
constant-time idle stack per host) the same waves took 5.6 s and 5.3 s, the client 1.2-2.2 CPU-s.

That transport has no read timeout (an instance's stream lasts as long as its generation): a caller
bounds each request itself, so that a hang is counted, never a stuck bench.
"""

from __future__ import annotations

import httpx

from tessera.router.upstream import UpstreamTransport


def load_client(connect_timeout_s: float = 30.0) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` over the router's upstream transport, for plain ``http://`` targets;
    connection errors and broken-off answers raise httpx's ConnectError / ConnectTimeout and
    RemoteProtocolError as usual."""
    return httpx.AsyncClient(transport=UpstreamTransport(connect_timeout_s))
