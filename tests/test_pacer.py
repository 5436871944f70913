"""Token pacer (spec §B.8): release schedule, slack, and the async wrapper on virtual time."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tessera.core import Request, ServiceClass
from tessera.core.qoe import QoEParams, consumption_times, qoe_from_delivery
from tessera.worker.pacer import TokenPacer, pace

PARAMS = QoEParams(arrival=0.0, ttft_target_s=1.0, reading_speed_tps=5.0)


def test_release_schedule_follows_consumption_timeline() -> None:
    pacer = TokenPacer(PARAMS)
    delivery = [0.5, 0.51, 0.52, 3.0, 3.01]
    released = [pacer.push(t) for t in delivery]
    assert released == pytest.approx([0.5, 0.7, 0.9, 3.0, 3.2])
    assert released == pytest.approx(consumption_times(np.array(delivery), 5.0).tolist())
    assert pacer.released_by(0.8) == 2 and pacer.buffered(0.8) == 3
    assert pacer.next_release_at(0.8) == pytest.approx(0.9)
    assert pacer.next_release_at(10.0) is None
    with pytest.raises(ValueError, match="before the previous one"):
        pacer.push(2.0)


def test_slack() -> None:
    pacer = TokenPacer(PARAMS)
    assert pacer.slack(0.25) == pytest.approx(0.75)  # arrival + T* - t before any token
    for t in (0.5, 0.51, 0.52):
        pacer.push(t)
    # A_3 = 0.9 -> next read due at max(0.9 + 0.2, I_4 = 1.6) = 1.6
    assert pacer.slack(0.6) == pytest.approx(1.0)
    pacer.push(0.53)
    pacer.push(0.54)
    pacer.push(0.55)  # A_6 = 1.5 -> max(1.7, I_7 = 2.2)
    assert pacer.slack(1.0) == pytest.approx(1.2)


def test_pause_within_slack_costs_no_qoe_and_reading_never_exceeds_r() -> None:
    # Q12: a request paused for P <= slack accrues no extra delay; consumption never exceeds r.
    rng = np.random.default_rng(5)
    for _ in range(100):
        r = float(rng.uniform(3, 7))
        params = QoEParams(0.0, 1.0, r)
        burst = 0.2 + np.cumsum(rng.uniform(0.005, 0.05, int(rng.integers(5, 60))))
        pacer = TokenPacer(params)
        for t in burst:
            pacer.push(float(t))
        now = float(burst[-1])
        pause = pacer.slack(now) * float(rng.uniform(0, 1))
        rest = now + pause + np.arange(20) / r  # resumes within the slack, then on pace
        paused = np.concatenate([burst, rest])
        steady = np.concatenate([burst, now + np.arange(20) / r])
        assert qoe_from_delivery(paused, params) == pytest.approx(qoe_from_delivery(steady, params))
        assert np.all(np.diff(consumption_times(paused, r)) >= 1.0 / r - 1e-12)


def test_for_request_uses_class_parameters() -> None:
    req = Request("r", 2.0, 20_000, 10, service_class=ServiceClass(reading_speed_tps=3.3))
    pacer = TokenPacer.for_request(req)
    assert pacer.params.reading_speed_tps == 3.3
    assert pacer.slack(2.0) == pytest.approx(4.0)  # T* = 20000 / 5000 s


class VirtualTime:
    """A clock and a sleep on virtual time: time jumps to the next sleeper once all tasks wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(seconds, 0.0), next(self._seq), fut))
        await fut

    async def run(self, main: asyncio.Task) -> None:
        while not main.done():
            for _ in range(20):  # let every runnable task reach its next wait
                await asyncio.sleep(0)
            while self._sleepers and self._sleepers[0][2].done():  # cancelled timers
                heapq.heappop(self._sleepers)
            if not self._sleepers:
                continue
            wake, _, fut = heapq.heappop(self._sleepers)
            self.now = max(self.now, wake)
            fut.set_result(None)


async def generate(vt: VirtualTime, gaps: list[float], fail: bool = False) -> AsyncIterator[str]:
    for i, gap in enumerate(gaps):
        await vt.sleep(gap)
        yield f"t{i}"
    if fail:
        raise RuntimeError("engine died")


async def collect(vt: VirtualTime, gaps: list[float], fail: bool = False) -> list[tuple[str, float]]:
    pacer = TokenPacer(PARAMS)
    out: list[tuple[str, float]] = []

    async def consume() -> None:
        async for token in pace(generate(vt, gaps, fail), pacer, vt.clock, vt.sleep):
            out.append((token, vt.now))

    main = asyncio.ensure_future(consume())
    await vt.run(main)
    main.result()
    return out


async def test_pace_releases_a_burst_at_reading_speed_and_drains_through_a_pause() -> None:
    vt = VirtualTime()
    # 6 tokens 10 ms apart from 0.5 s, a 3 s pause (preempted), then 2 more
    gaps = [0.5] + [0.01] * 5 + [3.0, 0.01]
    out = await collect(vt, gaps)
    assert [t for t, _ in out] == [f"t{i}" for i in range(8)]
    times = [at for _, at in out]
    assert times[:6] == pytest.approx([0.5, 0.7, 0.9, 1.1, 1.3, 1.5])
    # t6 generated at 3.55 (after the buffer ran dry at 1.5), t7 at 3.56 -> released 3.55, 3.75
    assert times[6:] == pytest.approx([3.55, 3.75])


async def test_pace_surfaces_stream_errors_after_buffered_tokens() -> None:
    vt = VirtualTime()
    with pytest.raises(RuntimeError, match="engine died"):
        await collect(vt, [0.1, 0.01, 0.01], fail=True)
