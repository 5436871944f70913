"""A tenant's share of a queue bound that several tenants share.

A pod's queue bounds (a model's ``scheduling.maxQueued``, a class's ``queue.maxQueued``) are split
between the tenants waiting there in proportion to their weights (``Request.tenant_weight``), so
one tenant's flood fills its own share and never the others': a tenant may hold at most
``floor(bound * weight / (weight + the other waiting tenants' weights))`` waiting requests, and at
least one. A tenant alone holds the whole bound. Nothing accepted is ever dropped, so a tenant that
arrives at a queue another has filled still gets its share: the queue then holds more than the bound
until the first tenant drains to its own share, and no tenant ever holds more than the bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def tenant_queue_share(bound: int, weight: float, others: Iterable[float]) -> int:
    """Most waiting requests a tenant of ``weight`` may hold of a queue bounded at ``bound`` while
    tenants of weights ``others`` also wait there (module docstring)."""
    rest = list(others)
    if bound < 1 or not weight > 0 or any(not w > 0 for w in rest):
        raise ValueError(f"a queue share needs bound >= 1 and weights > 0; got {bound}, {weight}, {rest}")
    return max(1, math.floor(bound * weight / (weight + sum(rest)) + 1e-9))
