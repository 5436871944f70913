"""One scheduler over a pod's models: model swapping (Decision.load_model -> ModelSwapper -> engine
sleep / wake-up), co-resident models, policy faults, and the per-class maximum queue time, on a
fake adapter and on the simulated engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from scheduler_harness import one_model_scheduler

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec, parse_config
from tessera.core.baselines import FCFS
from tessera.core.policy import Decision, InstanceView
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.worker.engines.base import Engine, EngineJob, TokenDelta
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.runtime import Worker
from tessera.worker.scheduler import InstanceScheduler, Job, QueueTimeout
from tessera.worker.server.app import create_app
from tessera.worker.swap import ModelSwapper


class FakeEngine(Engine):
    """Records sleep / wake-up calls; a stream yields one token per 5 ms and fails if asleep."""

    def __init__(self, model: str, *, supports_sleep: bool) -> None:
        self.model = model
        self.max_model_len = 4096
        self.supports_sleep = supports_sleep
        self.asleep = False
        self.calls: list[str] = []
        self.streamed: list[str] = []

    async def healthy(self) -> bool:
        return True

    async def tokenize(self, text: str) -> list[int]:
        return [1]

    async def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [1]

    async def detokenize(self, ids: list[int]) -> str:
        return "x" * len(ids)

    async def stream(self, job: EngineJob) -> AsyncIterator[TokenDelta]:
        assert not self.asleep, f"{self.model}: stream submitted while asleep"
        self.streamed.append(job.request_id)
        for i in range(job.max_tokens):
            await asyncio.sleep(0.005)
            yield TokenDelta([7], "x", "length" if i == job.max_tokens - 1 else None)

    async def sleep(self) -> None:
        self.calls.append("sleep")
        self.asleep = True

    async def wake_up(self) -> None:
        self.calls.append("wake")
        self.asleep = False


class DrainThenLoad(FCFS):
    """QLM's swap rule in miniature: with queued work of another model than the awake one, let the
    running requests finish, then ask for a swap to the oldest waiting request's model."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def schedule(self, view: InstanceView) -> Decision:
        decision = super().schedule(view)
        other = next((r.model for r in decision.run if r.model != view.active_model), None)
        if view.active_model is None or other is None:
            return decision
        running = [r for r in decision.run if r in view.running]
        if running:
            return Decision(run=running)  # drain first
        self.asked.append(other)
        return Decision(run=[], load_model=other)


def _scheduler(engine: Engine, policy: Any, swapper: ModelSwapper | None, **kw: Any) -> InstanceScheduler:
    return one_model_scheduler(
        engine,
        policy,
        profile=ProfileSpec().to_profile(engine.model, 10**6),
        batch=BatchBounds(max=kw.pop("batch", 4)),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        metrics=swapper.metrics if swapper is not None else WorkerMetrics(),
        swapper=swapper,
        **kw,
    )


def _job(rid: str, n: int, model: str) -> Job:
    return Job(Request(rid, 0.0, 1, n, model=model), [1], {})


async def _pod(engines: dict[str, Engine], policy: Any) -> tuple[ModelSwapper, InstanceScheduler]:
    """One scheduler over every engine of a pod, as the worker builds it."""
    swapper = ModelSwapper(engines, WorkerMetrics())
    await swapper.start()
    sched = InstanceScheduler(
        engines,
        policy,
        profiles={m: ProfileSpec().to_profile(m, 10**6) for m in engines},
        batch=BatchBounds(max=4),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        metrics=swapper.metrics,
        swapper=swapper,
    )
    await sched.start()
    return swapper, sched


async def test_load_model_sleeps_the_active_model_then_wakes_the_other() -> None:
    a, b = FakeEngine("a", supports_sleep=True), FakeEngine("b", supports_sleep=True)
    policy = DrainThenLoad()
    swapper, sched = await _pod({"a": a, "b": b}, policy)
    assert sched.mode == "swapping" and swapper.active == "a" and b.calls == ["sleep"]  # one awake
    long_a = _job("a1", 40, "a")
    sched.submit(long_a)
    await asyncio.sleep(0.02)
    job_b = _job("b1", 3, "b")
    sched.submit(job_b)  # the policy lets a drain, then asks to load b
    await asyncio.wait_for(job_b.done.wait(), 5)
    assert policy.asked == ["b"]
    assert job_b.error is None and job_b.req.generated == 3
    assert long_a.done.is_set() and long_a.req.generated == 40  # drained, not cut short
    assert job_b.req.first_token_at > long_a.req.finished_at
    assert a.calls == ["sleep"] and b.calls == ["sleep", "wake"]
    assert swapper.active == "b" and swapper.swaps == 1
    assert 'tessera_swaps_total{model="b"} 1.0' in swapper.metrics.exposition().decode()
    # a job for the sleeping model waits in the queue and runs after the swap back
    job_a = _job("a2", 2, "a")
    sched.submit(job_a)
    await asyncio.wait_for(job_a.done.wait(), 5)
    assert job_a.error is None and swapper.active == "a" and a.calls == ["sleep", "wake"]
    await sched.stop()


async def test_load_model_preempts_the_awake_models_requests_as_the_simulator_does() -> None:
    class LoadOnce(FCFS):
        """Asks to load the first other model it sees, once; the shell's own rule brings a back."""

        asked = False

        def schedule(self, view: InstanceView) -> Decision:
            decision = super().schedule(view)
            other = next((r.model for r in decision.run if r.model != view.active_model), None)
            if other is None or self.asked:
                return decision
            self.asked = True
            return Decision(run=decision.run, load_model=other)

    a, b = FakeEngine("a", supports_sleep=True), FakeEngine("b", supports_sleep=True)
    _, sched = await _pod({"a": a, "b": b}, LoadOnce())
    long_a = _job("a1", 200, "a")
    sched.submit(long_a)
    await asyncio.sleep(0.03)
    job_b = _job("b1", 3, "b")
    sched.submit(job_b)
    await asyncio.wait_for(job_b.done.wait(), 5)
    assert long_a.req.preemptions == 1 and not long_a.done.is_set()  # cut, queued, not lost
    await asyncio.wait_for(long_a.done.wait(), 10)
    assert long_a.error is None and long_a.req.generated == 200 and long_a.streams == 2
    await sched.stop()


async def test_models_without_sleep_are_co_resident_and_run_at_once() -> None:
    a, b = FakeEngine("a", supports_sleep=False), FakeEngine("b", supports_sleep=False)
    swapper, sched = await _pod({"a": a, "b": b}, FCFS())
    assert swapper.swappable == frozenset() and swapper.active_for("a") is None
    assert sched.mode == "co-resident" and set(sched._view(0.0).models) == {"a", "b"}
    swapper.request("b")  # the documented fallback: a no-op
    jobs = [_job("a1", 20, "a"), _job("b1", 20, "b")]
    for job in jobs:
        sched.submit(job)
    await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in jobs)), 5)
    # both ran at the same time: each started before the other finished
    assert jobs[0].req.first_token_at < jobs[1].req.finished_at
    assert jobs[1].req.first_token_at < jobs[0].req.finished_at
    assert a.calls == [] and b.calls == [] and swapper.swaps == 0
    await sched.stop()


async def test_a_decision_naming_an_unknown_model_or_request_is_a_logged_fault() -> None:
    class Confused(FCFS):
        def schedule(self, view: InstanceView) -> Decision:
            decision = super().schedule(view)
            stranger = Request("x", 0.0, 1, 1, model="nope")
            return Decision(run=[stranger, *decision.run], load_model="nope")

    a, b = FakeEngine("a", supports_sleep=True), FakeEngine("b", supports_sleep=True)
    swapper, sched = await _pod({"a": a, "b": b}, Confused())
    job = _job("a1", 3, "a")
    sched.submit(job)
    await asyncio.wait_for(job.done.wait(), 5)
    assert job.error is None and job.req.generated == 3
    assert sched.policy_faults >= 2 and swapper.active == "a"
    assert 'tessera_policy_faults_total{model="a+b"}' in sched.metrics.exposition().decode()
    await sched.stop()


async def test_fcfs_on_sleep_capable_sim_engines_swaps_with_the_profile_load_time() -> None:
    profile = StepProfile(
        name="m", decode_c0=0.002, decode_c1=0.0, decode_c2=0.0, prefill_p0=0.001, prefill_p1=0.0,
        kv_capacity_tokens=10**6, weights_bytes=50_000_000, host_link_bytes_per_s=1e9,
    )  # fmt: skip
    engines = {m: SimEngine(m, profile, 4096, supports_sleep=True) for m in ("x", "y")}
    for e in engines.values():
        await e.start()
    swapper, sched = await _pod(engines, make_policy("fcfs"))
    job = _job("y1", 5, "y")
    sched.submit(job)  # FCFS never asks: the scheduler loads the model of the work it holds
    await asyncio.wait_for(job.done.wait(), 5)
    assert job.error is None and job.req.generated == 5
    assert engines["x"].sleep_calls == 1 and engines["y"].wake_calls == 1 and swapper.active == "y"
    assert job.req.first_token_at - job.req.arrival >= profile.model_load_time()  # 50 ms load
    await sched.stop()
    for e in engines.values():
        await e.close()


async def test_request_past_its_class_queue_time_ends_with_queue_timeout() -> None:
    engine = FakeEngine("m", supports_sleep=False)
    chat = ServiceClass("chat", ttft_slo_s=1)
    sched = _scheduler(engine, FCFS(), None, batch=1, class_queue_times={"chat": 0.05})
    await sched.start()
    first = Job(Request("r1", 0.0, 1, 40, model="m", service_class=chat), [1], {})
    waiting = Job(Request("r2", 0.0, 1, 2, model="m", service_class=chat), [1], {})
    sched.submit(first)
    sched.submit(waiting)
    await asyncio.wait_for(waiting.done.wait(), 2)
    assert isinstance(waiting.error, QueueTimeout) and "maximum queue time" in str(waiting.error)
    assert waiting.req.generated == 0 and not first.done.is_set()  # the running one is untouched
    assert waiting.req.finished_at - waiting.req.arrival < 0.1 + 0.05  # woke at the expiry, not later
    assert waiting.req not in sched.jobs and len(sched.policy) == 1
    await asyncio.wait_for(first.done.wait(), 2)
    assert first.error is None
    await sched.stop()


async def test_queue_timeout_is_a_429_with_retry_after_over_http() -> None:
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 256}],
            "classes": {"chat": {"slo": {"ttftSeconds": 1}, "queue": {"maxQueueTimeSeconds": 0.05}}},
            "scheduling": {"batch": {"max": 1}},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            body = {"model": "m", "prompt": [1], "max_tokens": 60}
            r1, r2 = await asyncio.gather(
                c.post("/v1/completions", json=body), c.post("/v1/completions", json=body)
            )
        codes = sorted([r1.status_code, r2.status_code])
        assert codes == [200, 429], (r1.text, r2.text)
        late = r1 if r1.status_code == 429 else r2
        assert late.json()["error"]["code"] == "queue_timeout" and int(late.headers["Retry-After"]) >= 1
        metrics = worker.metrics.exposition().decode()
        assert 'reason="queue_timeout"} 1.0' in metrics
    finally:
        await worker.stop()


async def test_a_failing_decision_does_not_end_the_scheduling_loop() -> None:
    class FailsOnce(FCFS):
        failed = False

        def schedule(self, view: InstanceView) -> Decision:
            if not self.failed:
                self.failed = True
                raise KeyError("predictor cache")
            return super().schedule(view)

    sched = _scheduler(FakeEngine("m", supports_sleep=False), FailsOnce(), None)
    await sched.start()
    job = _job("r", 3, "m")
    sched.submit(job)  # the first decision raises; the loop retries and serves the request
    await asyncio.wait_for(job.done.wait(), 3)
    assert job.error is None and job.req.generated == 3
    await sched.stop()


async def test_stop_string_across_a_preemption_is_matched_and_no_text_is_lost() -> None:
    from tessera.worker.engines.sim_realtime import next_token

    prompt, ctx, texts = [4, 2], [4, 2], []
    for _ in range(12):
        ctx.append(next_token(ctx))
        texts.append(f" t{ctx[-1]}")
    stop = texts[5][-2:] + texts[6][:3]  # straddles tokens 6 and 7: the cut falls between them
    expected = "".join(texts)[: "".join(texts).index(stop)]
    profile = ProfileSpec(decode_c0=0.001, decode_c1=0.0, prefill_p0=0.001, prefill_p1=0.0).to_profile(
        "m", 10**6
    )

    async def run(cut_after: int | None) -> Job:
        class CuttingEngine(SimEngine):
            async def stream(self, engine_job: EngineJob) -> AsyncIterator[TokenDelta]:
                async for delta in super().stream(engine_job):
                    yield delta
                    if cut_after is not None and job.req.generated == cut_after and job.streams == 1:
                        sched._preempt(job, sched.clock())  # as a policy's Decision would
                        sched._wake.set()

        engine = CuttingEngine("m", profile, 4096)
        await engine.start()
        sched = _scheduler(engine, FCFS(), None)
        await sched.start()
        job = Job(Request("r", 0.0, 2, 12, model="m"), list(prompt), {"stop": ["never", stop]})
        sched.submit(job)
        await asyncio.wait_for(job.done.wait(), 5)
        await sched.stop()
        await engine.close()
        return job

    for cut in (None, 6):
        job = await run(cut)
        got = []
        while not job.events.empty():
            item = job.events.get_nowait()
            if item is not None:
                got.append(item.text)
        assert "".join(got) == expected and job.finish_reason == "stop", (cut, got)
        assert job.streams == (1 if cut is None else 2)
