"""The one definition of "SLO met" (``tessera.core.slo.slo_met``): its edge cases, and the worker's
``tessera_slo_met`` / ``tessera_slo_missed`` counters judging by it."""

from __future__ import annotations

import asyncio

import pytest
from scheduler_harness import one_model_scheduler

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec
from tessera.core.registry import make_policy
from tessera.core.request import Phase, Request, ServiceClass
from tessera.core.slo import SLO_TOLERANCE_S, slo_met
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import Job

CHAT = ServiceClass("chat", ttft_slo_s=1.0, itl_slo_s=0.1)
TTFT_ONLY = ServiceClass("ttft", ttft_slo_s=1.0)
ITL_ONLY = ServiceClass("itl", itl_slo_s=0.1)
NONE = ServiceClass("none")
BATCH = ServiceClass("bulk", kind="batch", deadline_s=10.0)
BATCH_NO_DEADLINE = ServiceClass("bulk-open", kind="batch", ttft_slo_s=0.001, itl_slo_s=0.001)


def _done(cls: ServiceClass, token_times: list[float], finished_at: float | None = None) -> Request:
    """A finished request that arrived at 0 and got tokens at ``token_times``."""
    req = Request("r", 0.0, 10, max(1, len(token_times)), service_class=cls)
    for t in token_times:
        req.tokens.append(t)
    req.generated = len(token_times)
    req.phase = Phase.FINISHED
    req.finished_at = finished_at if finished_at is not None else (token_times[-1] if token_times else 0.0)
    return req


def test_a_class_without_an_slo_is_left_out() -> None:
    assert slo_met(_done(NONE, [5.0, 9.0])) is None


def test_batch_is_judged_by_its_deadline_alone_and_has_no_slo_without_one() -> None:
    slow_tokens = [5.0, 9.0]  # TTFT and ITL far above BATCH_NO_DEADLINE's bounds
    assert slo_met(_done(BATCH, slow_tokens, finished_at=10.0)) is True
    assert slo_met(_done(BATCH, slow_tokens, finished_at=10.5)) is False
    assert slo_met(_done(BATCH_NO_DEADLINE, slow_tokens)) is None


def test_interactive_with_ttft_only_or_itl_only() -> None:
    assert slo_met(_done(TTFT_ONLY, [0.9, 50.0])) is True  # any ITL
    assert slo_met(_done(TTFT_ONLY, [1.1, 1.2])) is False
    assert slo_met(_done(ITL_ONLY, [30.0, 30.1, 30.2])) is True  # any TTFT
    assert slo_met(_done(ITL_ONLY, [0.1, 0.3])) is False
    assert slo_met(_done(ITL_ONLY, [30.0])) is True  # one token: no gap to bound
    assert slo_met(_done(CHAT, [0.5, 0.6, 0.7])) is True
    assert slo_met(_done(CHAT, [0.5, 0.9])) is False  # TTFT met, ITL missed
    assert slo_met(_done(CHAT, [1.5, 1.6])) is False  # ITL met, TTFT missed


def test_itl_runs_from_the_first_to_the_last_token_not_to_the_finish() -> None:
    # The worker ends a stream after its last token; the time until then is no inter-token gap.
    assert slo_met(_done(ITL_ONLY, [0.1, 0.2, 0.3], finished_at=5.0)) is True


def test_without_a_token_a_ttft_bound_is_missed_and_an_itl_bound_is_not() -> None:
    assert slo_met(_done(TTFT_ONLY, [], finished_at=0.5)) is False
    assert slo_met(_done(ITL_ONLY, [], finished_at=0.5)) is True


@pytest.mark.parametrize("over", [0.0, SLO_TOLERANCE_S / 2])
def test_a_request_on_its_bound_meets_it(over: float) -> None:
    assert slo_met(_done(TTFT_ONLY, [1.0 + over])) is True
    assert slo_met(_done(ITL_ONLY, [0.0, 0.1 + over])) is True
    assert slo_met(_done(BATCH, [1.0], finished_at=10.0 + over)) is True


def test_beyond_the_tolerance_a_bound_is_missed() -> None:
    over = 10 * SLO_TOLERANCE_S
    assert slo_met(_done(TTFT_ONLY, [1.0 + over])) is False
    assert slo_met(_done(BATCH, [1.0], finished_at=10.0 + over)) is False


def _count(metrics: WorkerMetrics, name: str, cls: str) -> float:
    value = metrics.registry.get_sample_value(f"{name}_total", {"model": "m", "class": cls})
    return value or 0.0


async def test_worker_counters_follow_slo_met() -> None:
    """Met and missed by class, as ``slo_met`` judges; classes without an SLO count in neither."""
    profile = ProfileSpec(decode_c0=0.001, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0).to_profile(
        "m", 10**6
    )
    engine = SimEngine("m", profile, 4096)
    metrics = WorkerMetrics()
    sched = one_model_scheduler(engine, make_policy("fcfs"), profile=profile, batch=BatchBounds(max=8),
                           autoscale=AutoscaleSpec(), max_queued=100, class_limits={},
                           metrics=metrics)  # fmt: skip
    await engine.start()
    await sched.start()
    strict = ServiceClass("strict", ttft_slo_s=1e-6)
    jobs = [
        Job(Request(f"{c.name}-{i}", 0.0, 4, 5, service_class=c, model="m"), [1, 2, 3, 4], {})
        for c in (TTFT_ONLY, strict, NONE, BATCH_NO_DEADLINE)
        for i in range(2)
    ]
    for job in jobs:
        sched.submit(job)
    await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in jobs)), 10)
    await sched.stop()
    await engine.close()
    for job in jobs:
        met = slo_met(job.req)
        name = job.class_name
        assert _count(metrics, "tessera_slo_met", name) == (2 if met else 0)
        assert _count(metrics, "tessera_slo_missed", name) == (2 if met is False else 0)
    assert slo_met(jobs[0].req) is True and slo_met(jobs[2].req) is False
