"""Tenant quotas on the user's path: API keys with quotas, two router replicas sharing a real Redis
(``redis-server`` on loopback, data in a temporary folder), real sim workers behind them.

- The sum each tenant is admitted in a minute, over both replicas, stays within its quota; each
  refusal is a 429 with ``Retry-After`` and OpenAI's rate-limit headers; admitted answers carry the
  remaining budget.
- Redis stopped mid-run: both replicas keep serving, each admitting its share (limit / replicas),
  and say so in their metrics.
- The official ``openai`` client reads the 429 and its own retry succeeds after ``Retry-After``.
- A Batch API job's lines, sent by the batch component's feeder, count against the job's tenant.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis_harness import RedisServer
from router_harness import CLASS_HEADER, MODEL, serve_router, start_workers

from tessera.api.batch_link import TENANT_HEADER, TOKEN_HEADER
from tessera.core.quota import Limits, TenantWindows, Window, admit
from tessera.router.auth import ApiKeys, ApiKeysError
from tessera.router.batch_proxy import BatchLink
from tessera.router.quota import QuotaStore

openai = pytest.importorskip("openai")

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-0123456789"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Redis server for the session's quota tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


def _keys(tmp_path: Path, quota_a: dict, quota_b: dict) -> ApiKeys:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"key": KEY_A, "tenant": "team-a", "quota": quota_a},
        {"key": KEY_B, "tenant": "team-b", "quota": quota_b},
    ]}))  # fmt: skip
    return ApiKeys(path)


async def _send(client: httpx.AsyncClient, url: str, key: str, max_tokens: int = 2) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}",
                             CLASS_HEADER: "chat"}, json={"model": MODEL, "prompt": "hello",
                             "max_tokens": max_tokens})  # fmt: skip


def test_a_window_counts_whole_seconds_and_says_when_a_refused_request_fits() -> None:
    windows, limits = TenantWindows(), Limits(requests_per_minute=2, tokens_per_minute=100)
    assert admit(windows, limits, 10.2, 40).refused is None
    assert admit(windows, limits, 30.5, 40).refused is None
    refused = admit(windows, limits, 31.0, 10)
    assert refused.refused == "requests" and refused.retry_after_s == pytest.approx(10 + 60 - 31.0)
    assert refused.requests is not None and refused.requests.remaining == 0
    assert admit(windows, limits, 70.0, 10).refused is None  # second 10 left the window at 70
    too_many = admit(windows, Limits(tokens_per_minute=100), 71.0, 70)
    assert too_many.refused == "tokens" and too_many.retry_after_s == pytest.approx(30 + 60 - 71.0)
    assert admit(TenantWindows(), Limits(tokens_per_minute=10), 0.0, 11).retry_after_s == float("inf")
    window = Window()
    window.add(5, 3)
    assert window.reset(20.0) == pytest.approx(45.0) and window.used(64) == 3 and window.used(65) == 0


def test_a_tenant_gets_one_quota_whatever_key_it_uses(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"key": KEY_A, "tenant": "team-a", "quota": {"requestsPerMinute": 5}},
        {"key": KEY_B, "tenant": "team-a", "quota": {"requestsPerMinute": 6}},
    ]}))  # fmt: skip
    with pytest.raises(ApiKeysError, match=r"keys.1.quota differs from keys.0.quota"):
        ApiKeys(path)
    path.write_text(json.dumps({"keys": [{"key": KEY_A, "tenant": "a", "quota": {"tokensPerMinute": 0}}]}))
    with pytest.raises(ApiKeysError, match=r"keys.0.quota.tokensPerMinute"):
        ApiKeys(path)


async def test_replicas_sharing_redis_admit_each_tenant_its_quota_atomically(redis_url: str) -> None:
    first, second = QuotaStore(redis_url, 2), QuotaStore(redis_url, 2)
    try:
        limits = Limits(requests_per_minute=7, tokens_per_minute=1000, concurrent_requests=5)
        tickets = await asyncio.gather(*(s.admit("atomic", limits, 10) for s in [first, second] * 10))
        admitted = [t for t in tickets if t.verdict.refused is None]
        assert len(admitted) == 5 and all(t.shared for t in tickets)  # concurrency 5 binds first
        assert {t.verdict.refused for t in tickets} == {None, "concurrency"}
        for ticket in admitted[:3]:
            await (first if ticket.member.startswith(first.replica) else second).release(ticket)
        more = [await second.admit("atomic", limits, 10) for _ in range(4)]
        assert [t.verdict.refused for t in more] == [None, None, "requests", "requests"]  # 7 a minute
        assert more[2].verdict.requests is not None and more[2].verdict.requests.remaining == 0
        assert 0 < more[2].verdict.retry_after_s <= 60
        tokens = Limits(tokens_per_minute=100)
        assert (await first.admit("tok", tokens, 60)).verdict.refused is None
        late = await second.admit("tok", tokens, 60)
        assert late.verdict.refused == "tokens" and late.verdict.tokens.remaining == 40
        ticket = await first.admit("tok", tokens, 40)
        await first.correct(ticket, 10)  # it used 10 of the 40 estimated: 30 come back
        assert (await second.admit("tok", tokens, 30)).verdict.refused is None
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.integration
async def test_two_routers_sharing_redis_keep_each_tenant_within_its_quota(
    tmp_path: Path, redis_url: str
) -> None:
    keys = _keys(tmp_path, {"requestsPerMinute": 6}, {"requestsPerMinute": 4, "tokensPerMinute": 500})
    supervisor = start_workers(tmp_path, 1)
    try:
        async with (
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(redis_url, 2)) as one,
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(redis_url, 2)) as two,
            httpx.AsyncClient(timeout=30) as client,
        ):
            answers = {KEY_A: [], KEY_B: []}
            for n in range(24):
                key = KEY_A if n % 2 else KEY_B
                answers[key].append(await _send(client, (one, two)[n // 2 % 2].url, key))
            for key, limit in ((KEY_A, 6), (KEY_B, 4)):
                codes = [r.status_code for r in answers[key]]
                assert codes.count(200) == limit and codes.count(429) == 12 - limit, codes
            ok = answers[KEY_B][0]
            assert ok.headers["x-ratelimit-limit-requests"] == "4"
            assert ok.headers["x-ratelimit-remaining-requests"] == "3"
            assert ok.headers["x-ratelimit-limit-tokens"] == "500"
            assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 500
            refused = answers[KEY_B][-1]
            assert refused.json()["error"]["code"] == "rate_limit_requests"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-reset-tokens" in refused.headers
            name, labels = "tessera_router_tenant_refused_total", {"tenant": "team-b", "reason": "requests"}
            assert await one.metric(name, **labels) + await two.metric(name, **labels) == 8
            assert await one.metric("tessera_router_quota_store_up") == 1
    finally:
        supervisor.stop_all()


@pytest.mark.integration
async def test_with_redis_stopped_each_router_serves_and_enforces_its_share(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    keys = _keys(tmp_path, {"requestsPerMinute": 10}, {"requestsPerMinute": 10})
    supervisor = start_workers(tmp_path / "workers", 1)
    try:
        async with (
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(server.url, 2)) as one,
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(server.url, 2)) as two,
            httpx.AsyncClient(timeout=30) as client,
        ):
            before = [await _send(client, router.url, KEY_A) for router in (one, two, one)]
            assert [r.status_code for r in before] == [200, 200, 200]
            server.stop()
            during = {one.url: [], two.url: []}
            for n in range(16):
                router = (one, two)[n % 2]
                during[router.url].append((await _send(client, router.url, KEY_A)).status_code)
            # Each replica alone admits 10 // 2 a minute: never nothing, never everything.
            assert [codes.count(200) for codes in during.values()] == [5, 5], during
            assert all(set(codes) == {200, 429} for codes in during.values())
            for router in (one, two):
                assert await router.metric("tessera_router_quota_store_up") == 0
                assert await router.metric("tessera_router_quota_fallback_admissions_total") == 8
            assert (await _send(client, one.url, KEY_B)).status_code == 200  # the other tenant: its own share
    finally:
        server.stop()
        supervisor.stop_all()


@pytest.mark.integration
async def test_the_openai_client_reads_the_429_and_its_retry_succeeds_after_retry_after(
    tmp_path: Path, redis_url: str
) -> None:
    quota = {"requestsPerMinute": 100, "concurrentRequests": 1}
    keys = _keys(tmp_path, quota, quota)
    supervisor = start_workers(tmp_path, 1)
    try:
        async with (
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(redis_url, 2)) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            # A long answer holds tenant a's one slot for about two seconds.
            holding = asyncio.create_task(_send(client, router.url, KEY_A, max_tokens=400))
            await asyncio.sleep(0.3)
            impatient = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key=KEY_A, max_retries=0,
                                           default_headers={CLASS_HEADER: "chat"})  # fmt: skip
            with pytest.raises(openai.RateLimitError) as refused:
                await impatient.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            headers = refused.value.response.headers
            assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "1000"
            assert headers["x-ratelimit-limit-requests"] == "100"
            assert refused.value.body["code"] == "rate_limit_concurrency"
            patient = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key=KEY_A, max_retries=6,
                                         default_headers={CLASS_HEADER: "chat"})  # fmt: skip
            raw = await patient.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
            assert raw.parse().usage.completion_tokens == 2
            assert int(raw.headers["x-ratelimit-remaining-requests"]) < 100
            assert (await holding).status_code == 200
            assert await router.metric("tessera_router_tenant_refused_total", reason="concurrency") >= 2
            assert await router.metric("tessera_router_tenant_tokens_total", tenant="team-a") > 0
    finally:
        supervisor.stop_all()


@pytest.mark.integration
async def test_a_batch_jobs_lines_count_against_its_tenants_quota(tmp_path: Path) -> None:
    keys = _keys(tmp_path, {"requestsPerMinute": 50}, {"requestsPerMinute": 2})
    link = BatchLink("http://127.0.0.1:9", "batch-token-0123456789")
    supervisor = start_workers(tmp_path, 1)

    async def line(client: httpx.AsyncClient, url: str, tenant: str) -> httpx.Response:
        headers = {TOKEN_HEADER: link.token, TENANT_HEADER: tenant, CLASS_HEADER: "chat"}
        return await client.post(f"{url}/v1/completions", headers=headers,
                                 json={"model": MODEL, "prompt": "hello", "max_tokens": 2})  # fmt: skip

    try:
        async with (
            serve_router(supervisor.workers, api_keys=keys, quota=QuotaStore(None), batch=link) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            lines = [await line(client, router.url, "team-b") for _ in range(3)]
            assert [r.status_code for r in lines] == [200, 200, 429]
            assert (
                lines[2].json()["error"]["code"] == "rate_limit_requests"
                and "retry-after" in lines[2].headers
            )
            # the tenant's own key shares the budget its job's lines used up; the other tenant's is apart
            assert (await _send(client, router.url, KEY_B)).status_code == 429
            assert (await _send(client, router.url, KEY_A)).status_code == 200
            gone = await line(client, router.url, "team-gone")
            assert gone.status_code == 403 and gone.json()["error"]["code"] == "tenant_unknown"
    finally:
        supervisor.stop_all()
