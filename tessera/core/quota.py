"""Per-tenant quotas: sliding one-minute windows of requests and tokens, and concurrent requests.

The arithmetic of one admission, with no store and no clock of its own: the router runs it against
Redis (``tessera.router.quota``: the same steps as a Lua script, so every replica shares the counts)
and, while Redis is unreachable, against these in-process windows with each replica's share of the
limits (``share``).

A window counts what was taken in each whole second of the last ``WINDOW_S`` seconds: the sum over
any ``WINDOW_S`` consecutive whole seconds never exceeds the limit. An admission takes from every
limited dimension at once or from none (``admit``): a request refused for its tokens takes no
request either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

WINDOW_S = 60
Dimension = Literal["requests", "tokens", "concurrency"]


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; None: that dimension is not limited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None

    def share(self, replicas: int) -> Limits:
        """What each of ``replicas`` replicas enforces alone: every limit divided by the replicas,
        rounded down, at least 1 (so together they admit at most the limit, or one per replica where a
        limit is below the replicas)."""

        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, limit // replicas)

        return Limits(part(self.requests_per_minute), part(self.tokens_per_minute),
                      part(self.concurrent_requests))  # fmt: skip

    @property
    def any(self) -> bool:
        """Whether any dimension is limited."""
        return (self.requests_per_minute, self.tokens_per_minute, self.concurrent_requests) != (None,) * 3


@dataclass(frozen=True, slots=True)
class Budget:
    """One windowed dimension after an admission: its limit, what is left, and seconds until the window
    holds nothing (OpenAI's ``x-ratelimit-reset-*``)."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one admission.

    ``refused``: the first dimension that refused (None: admitted); ``retry_after_s``: when the same
    request would fit (0 when admitted; for concurrency, unknown: a short wait). ``second``: the whole
    second the tokens were counted in (a later correction goes to the same second)."""

    refused: Dimension | None
    requests: Budget | None
    tokens: Budget | None
    retry_after_s: float
    second: int


CONCURRENCY_RETRY_S = 1.0  # a concurrency refusal's Retry-After: a slot frees when any request ends


class Window:
    """Amounts taken per whole second over the last ``WINDOW_S`` seconds (in process)."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}

    def _expire(self, second: int) -> None:
        for old in [s for s in self.buckets if s <= second - WINDOW_S]:
            del self.buckets[old]

    def used(self, second: int) -> int:
        """What the window holds at ``second``."""
        self._expire(second)
        return sum(self.buckets.values())

    def retry_after(self, now: float, amount: int, limit: int) -> float:
        """Seconds until ``amount`` more fits under ``limit`` (inf when it never can: above the limit)."""
        if amount > limit:
            return math.inf
        left = self.used(math.floor(now))
        if left + amount <= limit:
            return 0.0
        for s in sorted(self.buckets):  # the oldest seconds leave the window first
            left -= self.buckets[s]
            if left + amount <= limit:
                return max(0.0, s + WINDOW_S - now)
        return math.inf  # not reached: an empty window takes any amount within the limit

    def reset(self, now: float) -> float:
        """Seconds until the window holds nothing."""
        self._expire(math.floor(now))
        return max(0.0, max(self.buckets) + WINDOW_S - now) if self.buckets else 0.0

    def add(self, second: int, amount: int) -> None:
        """Count ``amount`` in ``second`` (negative: a correction of an estimate counted there)."""
        self.buckets[second] = self.buckets.get(second, 0) + amount


@dataclass(slots=True)
class TenantWindows:
    """One tenant's in-process counts."""

    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)
    in_flight: int = 0


def admit(windows: TenantWindows, limits: Limits, now: float, tokens: int) -> Verdict:
    """Admit one request estimated at ``tokens`` tokens at time ``now`` (seconds) under ``limits``:
    counted in every dimension when it fits all of them, in none otherwise (the concurrency slot is
    held until ``release``)."""
    second = math.floor(now)
    checks: list[tuple[Dimension, Window, int, int]] = []
    if limits.requests_per_minute is not None:
        checks.append(("requests", windows.requests, 1, limits.requests_per_minute))
    if limits.tokens_per_minute is not None:
        checks.append(("tokens", windows.tokens, tokens, limits.tokens_per_minute))
    refused: Dimension | None = None
    retry = 0.0
    for name, window, amount, limit in checks:
        if window.used(second) + amount > limit:
            refused, retry = name, window.retry_after(now, amount, limit)
            break
    concurrent = limits.concurrent_requests
    if refused is None and concurrent is not None and windows.in_flight >= concurrent:
        refused, retry = "concurrency", CONCURRENCY_RETRY_S
    if refused is None:
        for _, window, amount, _ in checks:
            window.add(second, amount)
        windows.in_flight += 1

    def budget(window: Window, limit: int | None) -> Budget | None:
        if limit is None:
            return None
        return Budget(limit, max(0, limit - window.used(second)), window.reset(now))

    return Verdict(refused, budget(windows.requests, limits.requests_per_minute),
                   budget(windows.tokens, limits.tokens_per_minute), retry, second)  # fmt: skip


def release(windows: TenantWindows) -> None:
    """A request admitted by ``admit`` ended: its concurrency slot frees."""
    windows.in_flight = max(0, windows.in_flight - 1)
