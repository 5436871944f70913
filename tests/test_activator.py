"""The activator: the pure idle and hold decisions, then the router holding requests for a sleeping model
(one real sim worker behind the real router, a scripted actuator): served once awake, 429 when the hold
queue is full, 503 with Retry-After at the deadline, a failing wake-up retried with backoff then 503
naming the reason, and the model listed by /v1/models all along."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from router_harness import CLASS_HEADER, MODEL, RouterUnderTest, serve_router, start_workers

from tessera.core.activation import (
    DEFAULT_HOLD_S,
    Backoff,
    HoldQueue,
    IdlePolicy,
    UnitState,
    hold_deadline,
    retry_after_s,
    should_sleep,
    unit_idle_after,
)
from tessera.router.activator import Activator
from tessera.router.app import RouterState

# -- pure decisions ---------------------------------------------------------------------------------


def test_a_unit_sleeps_only_when_every_model_may_after_the_longest_idle_time() -> None:
    assert unit_idle_after([IdlePolicy(30), IdlePolicy(300)]) == 300
    assert unit_idle_after([IdlePolicy(30), None]) is None
    assert unit_idle_after([]) is None


def test_should_sleep_needs_ready_idle_long_enough_and_nothing_in_flight_or_held() -> None:
    ready = UnitState.READY
    assert should_sleep(ready, last_activity=0, outstanding=0, held=0, after_s=10, now=10)
    assert not should_sleep(ready, last_activity=0, outstanding=0, held=0, after_s=10, now=9.9)
    assert not should_sleep(ready, last_activity=0, outstanding=1, held=0, after_s=10, now=100)
    assert not should_sleep(ready, last_activity=0, outstanding=0, held=1, after_s=10, now=100)
    assert not should_sleep(ready, last_activity=0, outstanding=0, held=0, after_s=None, now=100)
    for state in (UnitState.SLEEPING, UnitState.COLD, UnitState.WAKING):
        assert not should_sleep(state, last_activity=0, outstanding=0, held=0, after_s=10, now=100)


def test_hold_deadline_and_retry_after() -> None:
    assert hold_deadline(5.0, 3.0, 2.0) == 8.0  # the policy's holdSeconds first
    assert hold_deadline(5.0, None, 2.0) == 7.0  # then the class's TTFT SLO
    assert hold_deadline(5.0, None, None) == 5.0 + DEFAULT_HOLD_S
    assert retry_after_s(10.0, None, None) == 1
    assert retry_after_s(10.0, wake_started=8.0, expected_wake_s=6.5) == 5  # ceil(6.5 - 2)
    assert retry_after_s(10.0, wake_started=0.0, expected_wake_s=3.0) == 1  # overdue: at least 1


def test_backoff_grows_is_capped_and_gives_up() -> None:
    b = Backoff(base_s=1.0, factor=2.0, max_s=3.0, attempts=4)
    assert [b.delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, None]
    with pytest.raises(ValueError, match="attempts >= 1"):
        Backoff(attempts=0)


def test_hold_queue_is_bounded_and_releases_by_priority_then_arrival() -> None:
    q: HoldQueue[str] = HoldQueue(3)
    assert q.admit("late-low", 0, 2.0) and q.admit("early-low", 0, 1.0) and q.admit("high", 10, 3.0)
    assert not q.admit("fourth", 100, 0.0) and len(q) == 3
    q.remove("early-low")
    assert q.admit("again", 0, 4.0)
    assert q.release() == ["high", "late-low", "again"]
    assert len(q) == 0 and q.release() == []


# -- through the router -----------------------------------------------------------------------------


class ScriptedActuator:
    """An actuator whose wake-ups fail ``failures`` times, then wait for ``gate``; records every call."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.gate = asyncio.Event()
        self.calls: list[tuple[str, float]] = []

    async def sleep(self, unit: str) -> None:
        self.calls.append(("sleep", time.monotonic()))

    async def wake(self, unit: str) -> None:
        self.calls.append(("wake", time.monotonic()))
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("worker exited with code 1 while starting")
        await self.gate.wait()


@asynccontextmanager
async def _router(
    tmp_path: Path, actuator: ScriptedActuator, policy: IdlePolicy, backoff: Backoff | None = None
) -> AsyncIterator[tuple[RouterUnderTest, Activator]]:
    supervisor = await asyncio.to_thread(start_workers, tmp_path, 1)
    made: list[Activator] = []

    def build(state: RouterState) -> Activator:
        made.append(Activator({"g": (MODEL,)}, {MODEL: policy}, actuator, lambda _: 0, backoff=backoff,
                              tick_s=0.05))  # fmt: skip
        return made[0]

    try:
        async with serve_router(supervisor.workers, activator=build) as router:
            yield router, made[0]
    finally:
        await asyncio.to_thread(supervisor.stop_all)


async def _until_state(activator: Activator, state: UnitState, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while activator.state_of(MODEL) is not state:
        assert time.monotonic() < deadline, f"still {activator.state_of(MODEL)}, expected {state}"
        await asyncio.sleep(0.02)


def _client(router: RouterUnderTest) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=router.url, timeout=60.0)


def _body(tokens: int = 3) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": tokens}


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_held_requests_wake_the_model_and_are_served_and_models_stay_listed(tmp_path: Path) -> None:
    actuator = ScriptedActuator()
    policy = IdlePolicy(after_s=1.0, hold_s=30.0)
    async with _router(tmp_path, actuator, policy) as (router, activator), _client(router) as client:
        assert (await client.post("/v1/completions", json=_body())).status_code == 200  # Ready
        await _until_state(activator, UnitState.COLD)  # idle for 1 s: put to sleep
        assert [c for c, _ in actuator.calls] == ["sleep"]
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        status = (await client.get("/router/status")).json()["activation"]["g"]
        assert status["state"] == "Cold" and status["sleeps"] == 1
        # Three requests arrive while it is cold: one wake-up, all held, then all served.
        sent = [
            asyncio.create_task(client.post("/v1/completions", json=_body(), headers={CLASS_HEADER: c}))
            for c in ("batch", "chat", "batch")
        ]
        await _until_state(activator, UnitState.WAKING)
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in sent)
        assert (await client.get("/router/status")).json()["activation"]["g"]["held"] == {MODEL: 3}
        assert await router.metric("tessera_router_held_requests", model=MODEL) == 3
        assert await router.metric("tessera_router_unit_state", unit="g", state="Waking") == 1
        assert await router.metric("tessera_router_unit_state", unit="g", state="Cold") == 0
        actuator.gate.set()
        answers = await asyncio.gather(*sent)
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert [c for c, _ in actuator.calls] == ["sleep", "wake"]
        status = (await client.get("/router/status")).json()["activation"]["g"]
        assert status["state"] == "Ready" and status["wakes"] == 1 and status["lastWakeSeconds"] >= 0.3
        assert await router.metric("tessera_router_held_requests", model=MODEL) == 0
        assert await router.metric("tessera_router_unit_wakes_total", unit="g") == 1
        assert await router.metric("tessera_router_unit_sleeps_total", unit="g") == 1


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_full_hold_queue_answers_429_and_the_deadline_503_with_retry_after(tmp_path: Path) -> None:
    actuator = ScriptedActuator()
    policy = IdlePolicy(after_s=1.0, hold_s=1.5, max_held=2)
    async with _router(tmp_path, actuator, policy) as (router, activator):
        await _until_state(activator, UnitState.COLD)
        async with httpx.AsyncClient(base_url=router.url, timeout=60.0) as client:
            held = [asyncio.create_task(client.post("/v1/completions", json=_body())) for _ in range(2)]
            await _until_state(activator, UnitState.WAKING)
            while sum(activator.status()["g"]["held"].values()) < 2:
                await asyncio.sleep(0.02)
            full = await client.post("/v1/completions", json=_body())
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "activator_queue_full" and "Retry-After" in full.headers
            start = time.monotonic()
            late = await asyncio.gather(*held)  # the wake-up never ends here: both reach the deadline
            assert 1.0 <= time.monotonic() - start <= 6.0  # 1.5 s, with room for a loaded machine
            for answer in late:
                assert answer.status_code == 503
                error = answer.json()["error"]
                assert error["code"] == "model_waking" and "waking" in error["message"]
                assert int(answer.headers["Retry-After"]) >= 1
            # The wake-up went on; once it ends the next request is served.
            actuator.gate.set()
            await _until_state(activator, UnitState.READY)
            assert (await client.post("/v1/completions", json=_body())).status_code == 200
            assert [c for c, _ in actuator.calls] == ["sleep", "wake"]


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_failing_wake_up_is_retried_with_backoff_then_503_names_the_reason(tmp_path: Path) -> None:
    actuator = ScriptedActuator(failures=3)
    backoff = Backoff(base_s=0.2, factor=2.0, max_s=5.0, attempts=3)
    async with _router(tmp_path, actuator, IdlePolicy(after_s=1.0, hold_s=30.0), backoff) as (router, act):
        await _until_state(act, UnitState.COLD)
        async with httpx.AsyncClient(base_url=router.url, timeout=60.0) as client:
            answer = await client.post("/v1/completions", json=_body())
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["code"] == "wake_failed"
            assert "failed 3 times" in error["message"] and "worker exited with code 1" in error["message"]
            assert "Retry-After" in answer.headers
            wakes = [t for c, t in actuator.calls if c == "wake"]
            gaps = [b - a for a, b in itertools.pairwise(wakes)]
            assert len(wakes) == 3 and gaps[0] >= 0.2 and gaps[1] >= 0.4  # 0.2 s, then 0.4 s
            assert act.state_of(MODEL) is UnitState.COLD
            assert act.status()["g"]["lastError"] == "RuntimeError: worker exited with code 1 while starting"
            # The next request tries again, and this time the wake-up succeeds.
            actuator.gate.set()
            assert (await client.post("/v1/completions", json=_body())).status_code == 200
            assert act.state_of(MODEL) is UnitState.READY


async def test_retry_after_counts_the_whole_wake_up_while_the_unit_is_not_waking_yet() -> None:
    from tessera.api.openai_errors import ApiError

    activator = Activator({"g": ("m",)}, {"m": IdlePolicy(after_s=1.0, max_held=1)}, ScriptedActuator(),
                          lambda _: 0)  # fmt: skip
    unit = activator.units["g"]
    unit.state, unit.last_wake_s, unit.wake_started = UnitState.SLEEPING, 12.3, 0.0  # woke long ago
    first = asyncio.create_task(activator.admit("m", 30.0, 0))
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as full:
        await activator.admit("m", 30.0, 0)
    assert full.value.status == 429 and full.value.headers == {"Retry-After": "13"}
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(activator.queues["m"]) == 0  # a client that leaves is no longer held
