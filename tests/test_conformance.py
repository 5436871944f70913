"""Conformance of the two shells that drive a core policy: the simulator (``tessera.sim``) and the
worker's scheduler (``tessera.worker.scheduler``) over the sim engine.

(a) The same queue state renders as the same ``InstanceView``, field by field.
(b) The same short trace gives the same sequence of policy decisions (starts and preemptions).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from scheduler_harness import SetClock, one_model_scheduler, replay_decisions

from tessera.api.worker_config import AutoscaleSpec, BatchBounds, ProfileSpec
from tessera.core.policy import (
    Decision,
    InstanceView,
    Policy,
    kv_capacity_whole_blocks,
    resident_kv_tokens,
)
from tessera.core.profile import StepProfile
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.engine import EngineConfig, SimInstance
from tessera.worker.engines.sim_realtime import SimEngine
from tessera.worker.metrics import WorkerMetrics
from tessera.worker.scheduler import InstanceScheduler, Job

CHAT = ServiceClass("chat", ttft_slo_s=1.0)
BULK = ServiceClass("bulk", kind="batch", deadline_s=60.0)
MODEL = "m"


def _profile(decode_c0: float = 0.001) -> StepProfile:
    spec = ProfileSpec(decode_c0=decode_c0, decode_c1=0.0, decode_c2=0.0, prefill_p0=0.001, prefill_p1=0.0)
    return spec.to_profile(MODEL, 100_000)


def _engine_config(max_batch: int) -> EngineConfig:
    """The simulated engine configured as the worker's engines are: prompts prefill inside mixed
    iterations with no per-iteration admission budget (vLLM V1's chunked prefill; the sim adapter
    prefills joining streams within an iteration) and preemption cannot swap (the worker aborts)."""
    return EngineConfig(max_batch=max_batch, chunked_prefill=True, swap_space_tokens=0)


class Recorder(Policy):
    """Wraps a policy and records what the shell showed it and what it answered."""

    name = "recorder"

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.views: list[InstanceView] = []
        self.snapshots: list[dict[str, Any]] = []  # each view as it was (its requests move on)
        self.events: list[tuple[str, Any, Any]] = []  # ("decide", running ids, run ids) | ("remove", id, _)

    def add(self, req: Request, now: float) -> None:
        """Delegated."""
        self.inner.add(req, now)

    def remove(self, req: Request, now: float) -> None:
        """Delegated, recorded."""
        self.inner.remove(req, now)
        self.events.append(("remove", req.id, None))

    def observe(self, view: InstanceView) -> None:
        """Recorded, delegated."""
        self.views.append(view)
        self.snapshots.append(_comparable(view))
        self.inner.observe(view)

    def prepare(self, view: InstanceView) -> Callable[[], None] | None:
        """Delegated."""
        return self.inner.prepare(view)

    def schedule(self, view: InstanceView) -> Decision:
        """Delegated, recorded."""
        assert self.views and self.views[-1] is view, "observe comes with the view schedule gets"
        decision = self.inner.schedule(view)
        self.events.append(("decide", [r.id for r in view.running], [r.id for r in decision.run]))
        return decision

    def __len__(self) -> int:
        return len(self.inner)


def _comparable(view: InstanceView) -> dict[str, Any]:
    """Every field of ``view``; running requests by id with their progress (the shells hold copies)."""
    out = {f.name: getattr(view, f.name) for f in dataclasses.fields(view)}
    out["running"] = [(r.id, r.generated, r.phase) for r in view.running]
    return out


def _scheduler(
    policy: Policy, profile: StepProfile, max_batch: int, clock: Callable[[], float]
) -> InstanceScheduler:
    return one_model_scheduler(
        SimEngine(MODEL, profile, 4096),
        policy,
        profile=profile,
        batch=BatchBounds(max=max_batch),
        autoscale=AutoscaleSpec(),
        max_queued=100,
        class_limits={},
        metrics=WorkerMetrics(),
        clock=clock,
    )


# (prompt tokens, output tokens, class) of each request; all arrive at 0
STATE_TRACE = [(20, 9, BULK), (33, 4, CHAT), (17, 12, BULK), (40, 6, CHAT), (25, 3, CHAT), (31, 7, BULK)]


def _requests(trace: list[tuple[int, int, ServiceClass]], arrival: float = 0.0) -> list[Request]:
    return [
        Request(f"r{i}", arrival, p, n, model=MODEL, service_class=c, true_output_tokens=n)
        for i, (p, n, c) in enumerate(trace)
    ]


@pytest.mark.parametrize("policy", ["fcfs", "edf"])
async def test_the_same_queue_state_gives_the_same_view(policy: str) -> None:
    """The simulator runs the requests to the end; at each of its decision points the worker's
    scheduler is brought to the same state (the same requests submitted, each in-flight stream fed
    one token per engine iteration, finished streams ended, the clock at the same time) and asked
    to decide. The views the policy gets are equal in every field; the KV fields are the core's
    block accounting, which the simulator keeps incrementally."""
    profile, max_batch = _profile(), 4
    sim_rec = Recorder(make_policy(policy))
    inst = SimInstance(MODEL, {MODEL: profile}, sim_rec, _engine_config(max_batch))
    for req in _requests(STATE_TRACE):
        inst.add(req, 0.0)
    while inst.seg is not None:
        inst.advance()
        if inst.seg is not None:  # the engine's own accounting is the core's
            resident = list(inst.running) + list(inst.paused_kv)
            assert inst.used_blocks * profile.block_size == resident_kv_tokens(resident, profile.block_size)
    assert len(sim_rec.views) >= 5

    clock = SetClock()
    worker_rec = Recorder(make_policy(policy))
    sched = _scheduler(worker_rec, profile, max_batch, clock)
    jobs = [Job(req, list(range(1, req.prompt_tokens + 1)), {}) for req in _requests(STATE_TRACE)]
    for job in jobs:
        sched.submit(job)
    try:
        replay_decisions(sched, sim_rec.views, sim_rec.snapshots, worker_rec.snapshots, clock)
    finally:
        await sched.stop()
    assert len(worker_rec.views) == len(sim_rec.views)
    assert sim_rec.views[0].kv_capacity_tokens == kv_capacity_whole_blocks(profile)
    assert any(v.kv_used_tokens and v.iteration for v in sim_rec.views)


def _transitions(events: list[tuple[str, Any, Any]]) -> list[tuple[str, str]]:
    """The decisions as the engine applied them, flattened: at each decision the requests it preempted
    (running before, not in ``run``; by id) then those it started (in ``run`` order: requests of ``run``
    not running before that are running at the next decision or finished before it)."""
    decisions = [(i, running, run) for i, (kind, running, run) in enumerate(events) if kind == "decide"]
    out: list[tuple[str, str]] = []
    for n, (i, running, run) in enumerate(decisions):
        end = decisions[n + 1][0] if n + 1 < len(decisions) else len(events)
        later = set(decisions[n + 1][1]) if n + 1 < len(decisions) else set()
        finished = {rid for kind, rid, _ in events[i + 1 : end] if kind == "remove"}
        out += [("preempt", rid) for rid in sorted(set(running) - set(run))]
        out += [("start", rid) for rid in run if rid not in running and (rid in later or rid in finished)]
    return out


# Wave 1: long batch work at 0; wave 2: short interactive requests arriving while two of it run.
WAVE_1 = [(16, n, BULK) for n in (200, 220, 240, 260, 280, 300)]
WAVE_2 = [(16, n, CHAT) for n in (10, 20, 30, 40, 50, 60)]
WAVE_2_AT = 0.05


def _trace() -> tuple[list[Request], list[Request]]:
    first = _requests(WAVE_1)
    second = [dataclasses.replace(r, id=f"s{r.id}") for r in _requests(WAVE_2, WAVE_2_AT)]
    return first, second


async def test_the_same_trace_gives_the_same_decisions() -> None:
    """Twelve requests of two classes under SRTF (oracle lengths, batch of 2, a re-rank every 50
    tokens) through the simulator and through the worker's scheduler with the sim engine in real
    time. "The same decisions": the same flattened sequence of preemptions and starts
    (``_transitions``); the times of decisions, their number and the tokens generated at each are
    not compared.

    Why a timing-free comparison is valid here: SRTF's order depends only on token counts (true
    remaining length, ties by arrival), never on time, and every choice in this trace has a margin
    far larger than the timing differences between the shells can create. Each shell's decisions
    come at different instants (the worker's loop wakes a little after each event and learns tokens
    as they stream; the simulator decides at exact iteration boundaries) and may merge events (two
    completions seen at one decision), which changes when a transition happens and how many
    decisions there are, but not the order of the transitions: the second wave arrives while both
    shells run the same two long requests far from their end (their remaining work exceeds every
    wave-2 length), and lengths differ by at least 10 tokens, so completions come in the same order
    in both. With close lengths or time-driven policies (deadlines near the present, Chiron's
    measured ITL) the comparison would have to fix the timing too."""
    profile, max_batch = _profile(), 2
    first, second = _trace()
    sim_rec = Recorder(make_policy("srtf-oracle"))
    cfg = ClusterConfig({MODEL: profile}, 1, _engine_config(max_batch))
    Cluster(cfg, lambda: sim_rec).run(first + second)
    expected = _transitions(sim_rec.events)

    first, second = _trace()
    worker_rec = Recorder(make_policy("srtf-oracle"))
    sched = _scheduler(worker_rec, profile, max_batch, asyncio.get_running_loop().time)
    await sched.slots[MODEL].engine.start()
    await sched.start()
    try:
        jobs = [Job(r, list(range(1, r.prompt_tokens + 1)), {}) for r in first]
        for job in jobs:
            sched.submit(job)
        await asyncio.sleep(WAVE_2_AT)
        assert all(j.req.generated < 100 for j in jobs)  # far from the end: the margin is intact
        later = [Job(r, list(range(1, r.prompt_tokens + 1)), {}) for r in second]
        for job in later:
            sched.submit(job)
        jobs += later
        await asyncio.wait_for(asyncio.gather(*(j.done.wait() for j in jobs)), 60)
    finally:
        await sched.stop()
        await sched.slots[MODEL].engine.close()
    assert all(j.finish_reason == "length" for j in jobs)

    starts = [rid for kind, rid in expected if kind == "start"]
    assert starts[:2] == ["r0", "r1"] and starts[2:8] == [f"sr{i}" for i in range(6)]
    assert ("preempt", "r0") in expected and ("preempt", "r1") in expected
    assert _transitions(worker_rec.events) == expected
