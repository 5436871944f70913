"""Worker logic without vLLM: Chiron's local autoscaler, the configuration, the scheduling loop
on the simulated engine, and the HTTP layer in process."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from scheduler_harness import one_model_scheduler

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ConfigError, ProfileSpec, parse_config
from tessera.core.chiron import ChironLocal
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.worker.engines.sim_realtime import SimEngine, next_token
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.runtime import Worker
from tessera.worker.scheduler import InstanceScheduler, Job
from tessera.worker.server.app import create_app


def _window(c: ChironLocal, now: float, itl: float, tokens: int = 100, running: int = 1000) -> int:
    c.observe(now, tokens=tokens, gap_sum=itl * tokens, gaps=tokens, iterations=50, running=running)
    return c.update(now, 0.2)


def test_chiron_grows_under_low_itl_and_halves_over_the_slo() -> None:
    c = ChironLocal(1, 8192, 256)
    assert c.update(0.0, 0.2) == 256  # first level seen: start value
    assert _window(c, 1.0, itl=0.05) == 640  # BP = 0.25 -> x2.5
    # the throughput after the increase is higher: TBP < 1, ITL at the SLO: halve
    assert _window(c, 2.0, itl=0.2, tokens=300) == 320


def test_chiron_does_not_collapse_after_a_halving() -> None:
    c = ChironLocal(1, 8192, 256)
    c.update(0.0, 0.2)
    assert _window(c, 1.0, itl=0.3) == 128
    # lower throughput after a decrease is no backpressure (spec fix): ITL fine, so it grows
    assert _window(c, 2.0, itl=0.1, tokens=10) > 128


def test_chiron_needs_a_full_window_and_a_saturated_batch_to_grow() -> None:
    c = ChironLocal(1, 64, 32, min_iterations=20, min_interval_s=0.5)
    c.update(0.0, 0.2)
    c.observe(0.2, tokens=100, gap_sum=1.0, gaps=100, iterations=50, running=5)
    assert c.update(0.2, 0.2) == 32  # window shorter than 0.5 s
    assert _window(c, 1.0, itl=0.01, running=5) == 32  # load-limited all window long: no increase
    assert _window(c, 2.0, itl=0.01, running=32) == 64  # bounded by max


def test_chiron_keeps_one_batch_size_per_itl_level() -> None:
    c = ChironLocal(1, 8192, 256)
    c.update(0.0, 2.0)
    c.observe(1.0, tokens=100, gap_sum=10.0, gaps=100, iterations=50, running=1000)
    grown = c.update(1.0, 2.0)
    assert grown > 256
    assert c.update(1.1, 0.2) == 256  # interactive request arrived: its own level at once
    assert c.update(1.2, 2.0) == grown


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"models\.0.*url or launch"):
        parse_config({"models": [{"name": "m"}]})
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        parse_config({"models": [{"name": "m", "engine": "sim"}], "scheduling": {"policy": "nope"}})
    with pytest.raises(ConfigError, match="defaultClass 'x'"):
        parse_config({"models": [{"name": "m", "engine": "sim", "defaultClass": "x"}]})
    with pytest.raises(ConfigError, match=r"batch\.min 9 is above batch\.max 2"):
        parse_config(
            {"models": [{"name": "m", "engine": "sim"}], "scheduling": {"batch": {"min": 9, "max": 2}}}
        )


def _scheduler(engine: SimEngine, policy: str, batch: int) -> InstanceScheduler:
    return one_model_scheduler(
        engine,
        make_policy(policy),
        profile=engine.profile,
        batch=BatchBounds(max=batch),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        class_limits={},
        metrics=WorkerMetrics(),
    )


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


async def test_preemptive_policy_resumes_requests_exactly_on_the_sim_engine() -> None:
    profile = ProfileSpec(decode_c0=0.002, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0).to_profile(
        "m", 10**6
    )
    engine = SimEngine("m", profile, 4096)
    await engine.start()
    sched = _scheduler(engine, "srtf-oracle", batch=1)
    await sched.start()
    long = Job(Request("long", 0.0, 3, 60, true_output_tokens=60, model="m"), [1, 2, 3], {})
    sched.submit(long)
    while long.req.generated < 10:
        await asyncio.sleep(0.002)
    short = Job(Request("short", 0.0, 2, 5, true_output_tokens=5, model="m"), [7, 8], {})
    sched.submit(short)  # shorter remaining work: takes the only slot
    await asyncio.wait_for(asyncio.gather(long.done.wait(), short.done.wait()), 10)
    await sched.stop()
    await engine.close()
    assert long.req.preemptions >= 1 and long.streams >= 2
    assert short.req.finished_at < long.req.finished_at
    assert long.output_ids == _expected([1, 2, 3], 60)
    assert short.output_ids == _expected([7, 8], 5)


def _sim_app(**scheduling: object) -> tuple[Worker, object]:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 256}],
            "classes": {
                "chat": {"slo": {"ttftSeconds": 1}},
                "bulk": {"kind": "batch", "slo": {"deadlineSeconds": 60}, "queue": {"maxQueued": 1}},
            },
            "scheduling": {"batch": {"max": 1}, **scheduling},
        }
    )
    worker = Worker(config)
    return worker, create_app(worker, manage_worker=False)


async def test_http_layer_on_the_sim_engine() -> None:
    worker, app = _sim_app()
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            ok = await c.post(
                "/v1/completions",
                json={"model": "m", "prompt": [5], "max_tokens": 4, "return_token_ids": True},
            )
            assert ok.json()["choices"][0]["token_ids"] == _expected([5], 4)
            bad = await c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
            none = await c.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 0})
            assert none.status_code == 400 and none.json()["error"]["param"] == "n"
            surrogate = b'{"model": "m", "prompt": "\\ud800"}'
            r = await c.post(
                "/v1/completions", content=surrogate, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400
            body = {"model": "m", "prompt": [1], "max_tokens": 30}
            burst = await asyncio.gather(
                *(c.post("/v1/completions", json=body, headers={"x-tessera-class": "bulk"}) for _ in range(4))
            )
            codes = sorted(r.status_code for r in burst)
            assert codes[0] == 200 and codes[-1] == 429
            assert all(r.json()["usage"]["completion_tokens"] == 30 for r in burst if r.status_code == 200)
            schema = (await c.get("/openapi.json")).json()
            assert {"/v1/completions", "/v1/chat/completions", "/admin/reload"} <= set(schema["paths"])
    finally:
        await worker.stop()


async def test_pacing_releases_tokens_at_reading_speed() -> None:
    worker, app = _sim_app(pacing=True)
    worker.classes["m"]["chat"] = ServiceClass("chat", ttft_slo_s=1, reading_speed_tps=20.0)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            body = {"model": "m", "prompt": [1], "max_tokens": 6, "stream": True}
            start = time.monotonic()
            resp = await c.post("/v1/completions", json=body)  # the ASGI transport buffers the stream
            elapsed = time.monotonic() - start
        chunks = [ln for ln in resp.text.splitlines() if ln.startswith("data: {")]
        assert sum(bool(json.loads(ln[6:])["choices"][0]["text"]) for ln in chunks) == 6
        # the sim engine makes 6 tokens in ~25 ms; paced at 20 tokens/s the last leaves >= 5/20 s later
        assert elapsed >= 5 / 20 - 0.01
    finally:
        await worker.stop()


async def test_true_length_hint_is_benchmark_only_and_feeds_the_oracle() -> None:
    hdr = "X-Tessera-True-Output-Tokens"
    base = {
        "models": [{"name": "m", "engine": "sim", "maxModelLen": 256}],
        "classes": {"c": {"slo": {"ttftSeconds": 1}}},
    }
    with pytest.raises(ConfigError, match="benchHints"):
        parse_config({**base, "scheduling": {"policy": "srtf-oracle"}})
    worker = Worker(parse_config(base))
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": [1]}, headers={hdr: "5"})
            assert r.status_code == 400 and "benchmark-only" in r.json()["error"]["message"]
    finally:
        await worker.stop()
    oracle = {**base, "scheduling": {"policy": "srtf-oracle", "benchHints": True, "batch": {"max": 1}}}
    worker = Worker(parse_config(oracle))
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": [1]})
            assert r.status_code == 400 and hdr in r.json()["error"]["message"]
            bad = await c.post("/v1/completions", json={"model": "m", "prompt": [1]}, headers={hdr: "-2"})
            assert bad.status_code == 400 and "whole number" in bad.json()["error"]["message"]

            async def one(n: int, delay: float) -> float:
                await asyncio.sleep(delay)
                body = {"model": "m", "prompt": [1], "max_tokens": n}
                resp = await c.post("/v1/completions", json=body, headers={hdr: str(n)})
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == n
                return time.monotonic()

            # the long one is admitted first; the short one, shorter by its true length, overtakes it
            long_done, short_done = await asyncio.gather(one(200, 0.0), one(3, 0.05))
            assert short_done < long_done
    finally:
        await worker.stop()


async def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """A multi-megabyte prompt must not stall the worker's other streams while it is tokenized: the
    event loop's longest gap while the engine tokenizes stays well under its gap when the same text
    is tokenized on the loop (measured the same way, in the same test)."""
    import time
    from collections.abc import Awaitable, Callable

    from tessera.worker.engines.sim_realtime import SimEngine, _byte_tokens

    text = "x" * 4_000_000
    engine = SimEngine("m", ProfileSpec().to_profile("m", 10**6), 4096)

    async def longest_gap(work: Callable[[], Awaitable[object]]) -> float:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        await work()
        await asyncio.sleep(0.005)  # the ticker wakes once more: a stall shows as its last gap
        ticker.cancel()
        return max(gaps)

    async def on_loop() -> list[int]:
        return _byte_tokens(text)

    assert len(await engine.tokenize(text)) == len(text) + 1
    control = await longest_gap(on_loop)
    threaded = await longest_gap(lambda: engine.tokenize(text))
    assert threaded < 0.5 * control, (threaded, control)
