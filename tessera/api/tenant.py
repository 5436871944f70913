"""The tenant of a request as the router hands it to the worker.

The router authenticates a request's API key (``tessera.router.auth``) and sends its tenant and the
tenant's fair-share weight to the worker in these headers; a client-sent copy is dropped by the router
whatever its settings (``tessera.router.headers``). The worker reads them as the router's word: its
port takes connections only from the router's pods (``manifests/network``), so a client cannot
reach it with headers of its own.
"""

from __future__ import annotations

TENANT_HEADER = "x-tessera-tenant"
TENANT_WEIGHT_HEADER = "x-tessera-tenant-weight"
TENANT_HEADERS = frozenset({TENANT_HEADER, TENANT_WEIGHT_HEADER})
MAX_WEIGHT = 1000.0


def parse_weight(value: str | None) -> float:
    """A weight header's value: a number in (0, ``MAX_WEIGHT``]; absent or unreadable: 1 (a request
    without a weight gets the default share, never an error: the router sets it)."""
    if value is None:
        return 1.0
    try:
        weight = float(value)
    except ValueError:
        return 1.0
    return weight if 0 < weight <= MAX_WEIGHT else 1.0
