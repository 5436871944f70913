"""Per-tenant quotas shared by every router replica through Redis, with a bounded fallback.

Each admission runs one Lua script on Redis (atomic: no two replicas interleave inside it), the
steps of ``tessera.core.quota.admit`` over Redis hashes of per-second counts (requests, tokens) and a
sorted set of concurrency leases, with Redis's own clock (``TIME``), so every replica counts against
the same windows. A token estimate taken at admission is corrected to the answer's usage in the same
second's count (``correct``). A concurrency lease names the replica and the request; the replica
renews its leases every poll round (``renew``), so the slots of a replica that died free within
``LEASE_S``.

Redis unreachable (refused, timed out, any Redis error): the replica admits against its own
in-process windows with its share of every limit (``Limits.share``: the limit divided by the
replicas), logs it once and shows it in ``tessera_router_quota_store_up`` (0) and
``tessera_router_quota_fallback_admissions_total``; it tries Redis again after ``RETRY_S``. The
documented bound while Redis is down: the replicas together admit at most the limit per window
(one per replica where a limit is below the replicas), plus what Redis had counted in the minute
before it went away; never nothing, never everything.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from tessera.api.openai_errors import ApiError
from tessera.core.quota import (
    CONCURRENCY_RETRY_S,
    WINDOW_S,
    Budget,
    Dimension,
    Limits,
    TenantWindows,
    Verdict,
    admit,
    release,
)

log = logging.getLogger(__name__)
RETRY_S = 5.0  # after a failure, Redis is tried again this much later (admissions meanwhile: local)
LEASE_S = 30.0  # a concurrency slot outlives its replica by at most this much
TIMEOUT_S = 1.0  # each Redis call; past it the admission falls back to the local share (a stalled event
# loop on a loaded machine took more than 0.25 s: a false outage)
_DIMENSIONS: tuple[Dimension | None, ...] = (None, "requests", "tokens", "concurrency")

# KEYS: requests hash, tokens hash, concurrency sorted set. ARGV: requests/minute, tokens/minute,
# concurrent requests (-1: unlimited), the request's token estimate, its lease member, lease ms.
# Returns {refused (0 none, 1 requests, 2 tokens, 3 concurrency), retry ms (-1 never), requests left,
# requests reset ms, tokens left, tokens reset ms, the second counted in}.
_ADMIT = """
local t = redis.call('TIME')
local second = tonumber(t[1])
local now = second + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[7])
local function entries(key)
  local flat = redis.call('HGETALL', key)
  local out, old = {}, {}
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    if s <= second - window then
      table.insert(old, flat[i])
    else
      table.insert(out, {s, tonumber(flat[i + 1])})
    end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end
local function total(list)
  local sum = 0
  for _, e in ipairs(list) do sum = sum + e[2] end
  return sum
end
local function retry_ms(list, amount, limit)
  if amount > limit then return -1 end
  local left = total(list)
  for _, e in ipairs(list) do
    left = left - e[2]
    if left + amount <= limit then return math.max(0, math.ceil((e[1] + window - now) * 1000)) end
  end
  return -1
end
local function reset_ms(list)
  if #list == 0 then return 0 end
  return math.max(0, math.ceil((list[#list][1] + window - now) * 1000))
end
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local amounts = {1, tonumber(ARGV[4])}
local lists = {entries(KEYS[1]), entries(KEYS[2])}
local refused, retry = 0, 0
for i = 1, 2 do
  if refused == 0 and limits[i] >= 0 and total(lists[i]) + amounts[i] > limits[i] then
    refused, retry = i, retry_ms(lists[i], amounts[i], limits[i])
  end
end
local conc = tonumber(ARGV[3])
local now_ms = math.floor(now * 1000)
if refused == 0 and conc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[3]) >= conc then refused, retry = 3, -2 end
end
if refused == 0 then
  for i = 1, 2 do
    if limits[i] >= 0 then
      redis.call('HINCRBY', KEYS[i], second, amounts[i])
      redis.call('PEXPIRE', KEYS[i], (window + 1) * 1000)
      lists[i] = entries(KEYS[i])
    end
  end
  if conc >= 0 then
    redis.call('ZADD', KEYS[3], now_ms + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]) * 2)
  end
end
return {refused, retry, limits[1] - total(lists[1]), reset_ms(lists[1]), limits[2] - total(lists[2]),
        reset_ms(lists[2]), second}
"""
# KEYS: tokens hash. ARGV: the second counted in, the correction, the window. A second already out
# of the window is left alone (nothing counts it any more).
_CORRECT = """
local second = tonumber(redis.call('TIME')[1])
if tonumber(ARGV[1]) > second - tonumber(ARGV[3]) and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
end
return 0
"""


def _keys(tenant: str) -> list[str]:
    # One hash tag per tenant: a Redis Cluster keeps a tenant's three keys on one shard (a script's
    # keys must share one).
    return [f"tessera:quota:{{{tenant}}}:{part}" for part in ("requests", "tokens", "concurrency")]


@dataclass(slots=True)
class Ticket:
    """An admitted request's claim on its tenant's quota (to correct and release)."""

    tenant: str
    verdict: Verdict
    estimate: int
    shared: bool  # counted in Redis (else in this replica's windows)
    member: str  # its concurrency lease in Redis


class QuotaStore:
    """Admissions against Redis at ``url`` (None: this replica's windows alone, with all of every limit),
    falling back to ``1/replicas`` of every limit per replica while Redis is unreachable."""

    def __init__(self, url: str | None, replicas: int = 1) -> None:
        if replicas < 1:
            raise ValueError(f"--quota-replicas must be >= 1, got {replicas}")
        self.url, self.replicas = url, replicas
        self.client = (
            aioredis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
            if url
            else None
        )
        self._admit = self.client.register_script(_ADMIT) if self.client is not None else None
        self._correct = self.client.register_script(_CORRECT) if self.client is not None else None
        self.replica = uuid.uuid4().hex[:12]
        self.local: dict[str, TenantWindows] = {}
        self.store_up = self.client is not None
        self.fallback_admissions = 0
        self._retry_at = 0.0
        self._leases: dict[str, tuple[str, Limits]] = {}  # member -> (tenant, limits) held in Redis

    async def admit(self, tenant: str, limits: Limits, tokens: int) -> Ticket:
        """Admit one request of ``tenant`` estimated at ``tokens`` tokens (its verdict may refuse it)."""
        if self._admit is not None and time.monotonic() >= self._retry_at:
            member = f"{self.replica}:{uuid.uuid4().hex[:16]}"
            try:
                raw = await self._admit(keys=_keys(tenant), args=[
                    _arg(limits.requests_per_minute), _arg(limits.tokens_per_minute),
                    _arg(limits.concurrent_requests), tokens, member, int(LEASE_S * 1000), WINDOW_S,
                ])  # fmt: skip
            except (RedisError, OSError) as exc:
                self._down(exc)
            else:
                self._up()
                verdict = _verdict(raw, limits)
                if verdict.refused is None and limits.concurrent_requests is not None:
                    self._leases[member] = (tenant, limits)
                return Ticket(tenant, verdict, tokens, True, member)
        self.fallback_admissions += self.client is not None
        share = limits.share(self.replicas) if self.client is not None else limits
        verdict = admit(self.local.setdefault(tenant, TenantWindows()), share, time.time(), tokens)
        return Ticket(tenant, verdict, tokens, False, "")

    async def correct(self, ticket: Ticket, tokens: int) -> None:
        """The admitted request used ``tokens`` tokens in all: its estimate is corrected in its second."""
        delta = tokens - ticket.estimate
        if not delta or ticket.verdict.tokens is None:
            return
        if not ticket.shared:
            self.local[ticket.tenant].tokens.add(ticket.verdict.second, delta)
            return
        assert self._correct is not None
        try:
            await self._correct(keys=[_keys(ticket.tenant)[1]], args=[ticket.verdict.second, delta, WINDOW_S])
        except (RedisError, OSError) as exc:
            self._down(exc)

    async def release(self, ticket: Ticket) -> None:
        """The admitted request ended: its concurrency slot frees."""
        if not ticket.shared:
            release(self.local[ticket.tenant])
            return
        if self._leases.pop(ticket.member, None) is None or self.client is None:
            return
        try:
            await self.client.zrem(_keys(ticket.tenant)[2], ticket.member)
        except (RedisError, OSError) as exc:
            self._down(exc)  # the lease expires by itself within LEASE_S

    async def renew(self) -> None:
        """Extend this replica's concurrency leases (every poll round)."""
        if self.client is None or not self._leases or time.monotonic() < self._retry_at:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                until = (time.time() + LEASE_S) * 1000  # the replicas' clocks agree within seconds
                for member, (tenant, _) in self._leases.items():
                    pipe.zadd(_keys(tenant)[2], {member: until}, xx=True)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._down(exc)

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self.client is not None:
            await self.client.aclose()

    def _down(self, exc: BaseException) -> None:
        if self.store_up:
            log.warning("quota store %s unreachable (%s): each router replica enforces 1/%d of every "
                        "tenant limit until it answers again", self.url, exc, self.replicas)  # fmt: skip
        self.store_up = False
        self._retry_at = time.monotonic() + RETRY_S

    def _up(self) -> None:
        if not self.store_up:
            log.warning("quota store %s answers again: tenant limits are shared again", self.url)
        self.store_up = True


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


def _verdict(raw: list[int], limits: Limits) -> Verdict:
    refused, retry_ms, req_left, req_reset, tok_left, tok_reset, second = (int(x) for x in raw)
    retry = CONCURRENCY_RETRY_S if retry_ms == -2 else math.inf if retry_ms < 0 else retry_ms / 1000
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    return Verdict(
        _DIMENSIONS[refused],
        Budget(rpm, max(0, req_left), req_reset / 1000) if rpm is not None else None,
        Budget(tpm, max(0, tok_left), tok_reset / 1000) if tpm is not None else None,
        retry if refused else 0.0,
        second,
    )


def _duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``1m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limit_headers(verdict: Verdict) -> dict[str, str]:
    """OpenAI's rate-limit headers of the limited windows (after this request when admitted)."""
    headers: dict[str, str] = {}
    for name, budget in (("requests", verdict.requests), ("tokens", verdict.tokens)):
        if budget is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(budget.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(budget.remaining)
            headers[f"x-ratelimit-reset-{name}"] = _duration(budget.reset_s)
    return headers


def refusal(tenant: str, limits: Limits, verdict: Verdict, tokens: int) -> ApiError:
    """The 429 of a refused admission: which limit, when to retry (``Retry-After`` in whole seconds and
    ``retry-after-ms``, which the official clients read), and the rate-limit headers."""
    assert verdict.refused is not None
    headers = rate_limit_headers(verdict)
    limit = {"requests": f"{limits.requests_per_minute} requests per minute",
             "tokens": f"{limits.tokens_per_minute} tokens per minute",
             "concurrency": f"{limits.concurrent_requests} concurrent requests"}[verdict.refused]  # fmt: skip
    if math.isinf(verdict.retry_after_s):
        return ApiError(429, f"this request, estimated at {tokens} tokens (prompt and max_tokens), exceeds "
                        f"tenant {tenant!r}'s limit of {limit}: it can never be admitted; lower max_tokens "
                        "or shorten the prompt", code="request_too_large", headers=headers)  # fmt: skip
    wait = verdict.retry_after_s
    headers["retry-after"] = str(max(1, math.ceil(wait)))
    headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
    return ApiError(429, f"rate limit reached for tenant {tenant!r}: {limit}; retry after {wait:.2f} s",
                    code=f"rate_limit_{verdict.refused}", headers=headers)  # fmt: skip


class QuotaCollector(Collector):
    """``tessera_router_quota_store_up`` (1 while Redis answers; 0: each replica enforces its share) and
    ``tessera_router_quota_fallback_admissions_total`` (admissions counted locally instead)."""

    def __init__(self, store: QuotaStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            "tessera_router_quota_store_up",
            "1 while the shared quota store (Redis) answers; 0 while each router replica enforces "
            "1/replicas of every tenant limit alone.",
        )
        up.add_metric([], 1.0 if self.store.store_up else 0.0)
        fallback = CounterMetricFamily(
            "tessera_router_quota_fallback_admissions",
            "Quota admissions this replica counted in its own windows because the store was unreachable.",
        )
        fallback.add_metric([], float(self.store.fallback_admissions))
        yield from (up, fallback)
