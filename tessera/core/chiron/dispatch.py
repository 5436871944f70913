"""Chiron's dispatch of an interactive request to an instance (the paper's routing, zero queuing).

An interactive request goes, in this order, to

1. an interactive instance with room, the most loaded first (first-fit packing keeps the others
   free for the autoscaler to retire);
2. a mixed instance with room, preferring those already running interactive work (packing keeps
   the interactive backpressure meaningful), then the most loaded;
3. a mixed instance holding batch work that the request can evict (its prefill still fits);

or nowhere: it waits at the head of the global queue, which also triggers a global evaluation.

"Room" is the paper's zero-queuing capacity: below the batch size, the KV admission test passes for
the prompt, and the prompt's prefill starts with the next iteration or within ``backlog_s`` of the
prefill work already waiting there. The KV and prefill tests count the interactive requests routed
there that have not started: without that, a burst arriving before the next iteration passed the
test on the same free KV again and again, and most-loaded-first packing piled hundreds of prompts
on one instance.

Pure: the caller passes the instances that are serving (ready, not draining) as ``DispatchTarget``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from tessera.core.chiron.local import ChironPolicy
from tessera.core.request import Request

# Seconds of prefill work already waiting on an instance below which it still takes an interactive
# request: 10% of a 10 s TTFT SLO, so that a burst packs onto few instances.
PREFILL_BACKLOG_S = 1.0


class DispatchTarget(Protocol):
    """What Chiron's dispatch reads of one serving instance."""

    @property
    def role(self) -> str:
        """``interactive``, ``mixed`` or ``batch``."""
        ...

    @property
    def outstanding(self) -> int:
        """Requests routed there and not finished (queued or running)."""
        ...

    @property
    def queue(self) -> ChironPolicy:
        """The instance's policy (its class counters and batch size)."""
        ...

    @property
    def admissible_kv_tokens(self) -> int:
        """Free KV tokens above the engine's admission watermark."""
        ...

    @property
    def prefill_budget_tokens(self) -> int:
        """Prompt tokens one iteration prefills."""
        ...

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt tokens."""
        ...


T = TypeVar("T", bound=DispatchTarget)


def prefill_fits(target: DispatchTarget, req: Request, waiting: int, backlog_s: float) -> bool:
    """The prompt's prefill starts within ``backlog_s`` of the ``waiting`` prefill tokens already there,
    or with the next iteration (its token budget); a lone prompt always fits."""
    if waiting == 0 or waiting + req.prompt_tokens <= target.prefill_budget_tokens:
        return True
    return target.prefill_s(waiting + req.prompt_tokens) <= backlog_s


def has_room(target: DispatchTarget, req: Request, backlog_s: float) -> bool:
    """Zero-queuing capacity for ``req``: below the batch size, its prefill fits, its prompt fits the
    KV left by the requests running there and by the interactive ones waiting to start."""
    queue = target.queue
    if target.outstanding >= queue.batch_size():
        return False
    waiting = queue.waiting_interactive_tokens()
    if not prefill_fits(target, req, waiting, backlog_s):
        return False
    return target.admissible_kv_tokens - waiting > req.prompt_tokens


def chiron_pick(req: Request, targets: Sequence[T], backlog_s: float = PREFILL_BACKLOG_S) -> T | None:
    """The instance for interactive request ``req`` among the serving ``targets``, or None (hold it)."""
    own = [t for t in targets if t.role == "interactive"]
    mixed = [t for t in targets if t.role == "mixed"]
    fits = [t for t in own if has_room(t, req, backlog_s)]
    if fits:
        return max(fits, key=lambda t: t.outstanding)
    fits = [t for t in mixed if has_room(t, req, backlog_s)]
    if fits:
        return max(fits, key=lambda t: (t.queue.interactive > 0, t.outstanding))
    evictable = [
        t
        for t in mixed
        if t.queue.batch > 0 and prefill_fits(t, req, t.queue.waiting_interactive_tokens(), backlog_s)
    ]
    if evictable:
        return max(evictable, key=lambda t: (t.queue.batch, -t.queue.interactive))
    return None
