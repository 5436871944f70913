"""Conformance of VTC fair share (``tessera.core.fair_share``) in the two shells: the simulator and
the worker's scheduler over the sim engine, on a two-tenant trace (the harness of
``tests/test_conformance.py``).

Tenant b floods (six requests at 0), tenant a arrives later, one request at a time, while b's run.
The simulator runs the trace to the end; at each of its decision points the worker's scheduler is
brought to the same state (the requests that arrived by then submitted at their arrival, each
in-flight stream fed one token per engine iteration, finished streams ended, the clock at the same
time) and asked to decide. Both shells run the policy the worker configuration builds
(``WorkerConfig.make_policy`` with ``scheduling.fairShare`` on): the views are equal field by
field, the decisions are the same, and so are VTC's counters, the service each tenant received and
the largest service gap.
"""

from __future__ import annotations

import pytest
from scheduler_harness import run_iterations
from test_conformance import MODEL, Recorder, _engine_config, _profile, _scheduler

from tessera.api.worker_config import parse_config
from tessera.core.fair_share import FairShare
from tessera.core.request import Request, ServiceClass
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.worker.scheduler import Job

CHAT = ServiceClass("chat", ttft_slo_s=1.0)
# (tenant, arrival s, prompt tokens, output tokens): b floods at 0, a arrives while b's requests run;
# arrivals fall between the engine's 1 ms iterations, never on one.
TRACE = [("b", 0.0, 30, 40), ("b", 0.0, 24, 45), ("b", 0.0, 40, 35), ("b", 0.0, 22, 50),
         ("b", 0.0, 35, 30), ("b", 0.0, 28, 42), ("a", 0.01234, 26, 20), ("a", 0.04567, 60, 15),
         ("a", 0.05891, 18, 25), ("a", 0.11234, 33, 10)]  # fmt: skip


def _requests() -> list[Request]:
    return [
        Request(f"{t}{i}", at, p, n, model=MODEL, service_class=CHAT, true_output_tokens=n, tenant=t)
        for i, (t, at, p, n) in enumerate(TRACE)
    ]


def _policy(credit: float) -> FairShare:
    share = {"enabled": True, "liftCredit": credit}
    config = parse_config({"models": [{"name": MODEL, "engine": "sim"}],
                           "scheduling": {"policy": "fcfs", "fairShare": share}})  # fmt: skip
    policy = config.make_policy()
    assert isinstance(policy, FairShare)
    return policy


@pytest.mark.parametrize("credit", [0.0, 500.0])  # the paper's lift, and one leaving a credit
async def test_a_two_tenant_trace_gives_the_same_views_decisions_and_counters(credit: float) -> None:
    profile, max_batch = _profile(), 2
    sim_vtc = _policy(credit)
    sim_rec = Recorder(sim_vtc)
    Cluster(ClusterConfig({MODEL: profile}, 1, _engine_config(max_batch)), lambda: sim_rec).run(_requests())
    assert sim_vtc.max_service_gap > 0  # both tenants were backlogged together

    now = 0.0
    worker_vtc = _policy(credit)
    worker_rec = Recorder(worker_vtc)
    sched = _scheduler(worker_rec, profile, max_batch, lambda: now)
    pending = [Job(r, list(range(1, r.prompt_tokens + 1)), {}) for r in _requests()]
    iteration = 0
    try:
        for sim_view, sim_snapshot in zip(sim_rec.views, sim_rec.snapshots, strict=True):
            while pending and pending[0].req.arrival <= sim_view.now:
                now = pending[0].req.arrival
                sched.submit(pending.pop(0))
            run_iterations(sched, sim_view.iteration - iteration)
            iteration = sim_view.iteration
            now = sim_view.now
            sched.decide()
            # the cluster names its instances, a pod its model: every other field is compared
            assert {**worker_rec.snapshots[-1], "instance": "i0"} == sim_snapshot
        run_iterations(sched, max(n for *_, n in TRACE))
    finally:
        await sched.stop()
    assert not pending and not sched.jobs
    assert worker_rec.events == sim_rec.events
    # a was admitted ahead of b's backlog: VTC, not arrival order, decided
    starts = [run[-1] for kind, running, run in sim_rec.events if kind == "decide" and run]
    assert "a6" in starts and starts.index("a6") < starts.index("b5")
    for field in ("counters", "service", "max_service_gap", "max_request_service"):
        assert getattr(worker_vtc, field) == getattr(sim_vtc, field), field
