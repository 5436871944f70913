"""Which headers cross the router, in each direction.

Hop-by-hop headers describe one connection, not the message, and a proxy must not forward them
(RFC 9110 §7.6.1): ``Connection`` and every header it names, ``Keep-Alive``, ``Proxy-*``, ``TE``,
``Trailer``, ``Transfer-Encoding`` and ``Upgrade``. Forwarding ``Transfer-Encoding: chunked`` next to
the ``Content-Length`` of the body the router re-sends makes the request invalid to the worker.
The router also rebuilds the framing of its own upstream request: host, length and a JSON content type
(it has parsed the body as JSON whatever the client declared); it asks for no content encoding.
"""

from __future__ import annotations

from collections.abc import Iterable

from tessera.api.tenant import TENANT_HEADERS

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Set by the router's own upstream request; ``expect`` is answered by the router's server already.
_UPSTREAM_REBUILT = frozenset({"host", "content-length", "content-type", "accept-encoding", "expect"})
# Set by the router's server for its own answer; httpx has already decoded any content encoding.
_DOWNSTREAM_REBUILT = frozenset({"content-length", "content-encoding", "date", "server"})
JSON = "application/json"


def end_to_end(
    items: Iterable[tuple[str, str]], rebuilt: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """The headers of ``items`` a proxy forwards: hop-by-hop ones, those ``Connection`` names and
    ``rebuilt`` ones removed (names lower-cased, repeated headers kept in order)."""
    pairs = [(name.lower(), value) for name, value in items]
    named = {
        token.strip().lower() for name, value in pairs if name == "connection" for token in value.split(",")
    }
    return [(n, v) for n, v in pairs if n not in HOP_BY_HOP and n not in named and n not in rebuilt]


def upstream_headers(items: Iterable[tuple[str, str]], *, drop_authorization: bool) -> list[tuple[str, str]]:
    """Headers of the request the router sends a worker: the client's end-to-end headers and a JSON
    content type; the client's ``Authorization`` is dropped when the router checked it (API keys
    are the router's business, workers never see them), and so are the tenant headers a client sent
    (only the router names a tenant: ``tessera.api.tenant``)."""
    rebuilt = _UPSTREAM_REBUILT | TENANT_HEADERS
    if drop_authorization:
        rebuilt |= {"authorization"}
    return [*end_to_end(items, rebuilt), ("content-type", JSON)]


def downstream_headers(items: Iterable[tuple[str, str]], instance: str) -> dict[str, str]:
    """Headers of the answer relayed to the client, plus the instance that answered (``items`` as
    ``httpx.Headers.items()`` gives them: a repeated header already joined into one value)."""
    return {**dict(end_to_end(items, _DOWNSTREAM_REBUILT)), "x-tessera-instance": instance}
