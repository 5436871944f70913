"""Class priority (RequestClass ``spec.priority``, higher first) breaks each policy's ties and decides
its overload choices, and never overrides the order the policy computes.

Every case is a tie (or an overload choice) between two requests or groups of classes A and B, run
with A higher, with B higher, and with both equal: the higher class wins, and with equal priorities
the policy decides as it did without priorities. The last test drives a worker on the sim engine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tessera.api.request_class import DEFAULT_CLASS_HEADER
from tessera.api.worker_config import parse_config
from tessera.core import InstanceView, Phase, Request, ServiceClass, StepProfile
from tessera.core.chiron import ChironLocal, ChironPolicy, GlobalQueue
from tessera.core.policies.qlm.estimator import GroupCosts
from tessera.core.policies.qlm.milp import GroupSpec, QueueSpec, SolverSettings, edf_plan, solve
from tessera.core.policies.qlm.policy import QLMPolicy
from tessera.core.policies.qoe import AndesQoE
from tessera.core.policies.seallm import DoublingBudget, ServiceStats
from tessera.core.registry import make_policy
from tessera.worker.runtime import Worker
from tessera.worker.server.app import create_app

PROFILE = StepProfile("t", 0.01, 0.0, 0.0, 0.01, 0.0, kv_capacity_tokens=100_000)
# (priority of A, priority of B, the winner): A higher, B higher, equal (the policy's own tie-break)
CASES = [(5, 1, "a"), (1, 5, "b"), (0, 0, None)]


def _cls(name: str, priority: int, **kw: Any) -> ServiceClass:
    return ServiceClass(name=name, priority=priority, **kw)


def _req(rid: str, arrival: float, cls: ServiceClass, prompt: int = 10, out: int = 50) -> Request:
    return Request(rid, arrival, prompt, 1000, service_class=cls, true_output_tokens=out)


def _view(running: list[Request], now: float = 10.0, max_batch: int = 1) -> InstanceView:
    return InstanceView(now, "i0", running, max_batch, PROFILE.kv_capacity_tokens, 0, PROFILE)


def _running(req: Request) -> Request:
    req.phase, req.kv_resident = Phase.RUNNING, True
    return req


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
@pytest.mark.parametrize("policy", ["fcfs", "edf", "priority", "sjf-oracle", "srtf-oracle"])
def test_baselines_serve_the_higher_class_first_among_equal_keys(
    policy: str, pa: int, pb: int, winner: str | None
) -> None:
    pol = make_policy(policy)
    # Equal arrival, deadline and length: every key of these policies ties.
    a, b = _req("a", 1.0, _cls("A", pa, ttft_slo_s=5.0)), _req("b", 1.0, _cls("B", pb, ttft_slo_s=5.0))
    for r in (a, b):
        pol.add(r, 1.0)
    assert [r.id for r in pol.schedule(_view([])).run] == [winner or "a"]  # equal: the first queued


@pytest.mark.parametrize(("delay", "order"), [(None, "ilb"), (50.0, "ilb"), (30.0, "ibl"), (0.0, "bil")])
def test_priority_queue_puts_interactive_ahead_of_batch_set_back_by_the_delay(
    delay: float | None, order: str
) -> None:
    # b (batch) arrives at 0, i (interactive) at 5, l (interactive) at 40: strict priority runs both
    # interactive requests first; a set-back of d queues b as if it had arrived at d.
    pol = make_policy("priority", batch_delay_s=delay)
    batch, chat = ServiceClass("bulk", "batch", deadline_s=600.0), ServiceClass("chat", ttft_slo_s=10.0)
    for r in (_req("b", 0.0, batch), _req("i", 5.0, chat), _req("l", 40.0, chat)):
        pol.add(r, 40.0)
    assert "".join(r.id for r in pol.schedule(_view([], now=40.0, max_batch=3)).run) == order


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_edf_priority_decides_equal_deadlines_before_arrival(pa: int, pb: int, winner: str | None) -> None:
    pol = make_policy("edf")
    # a arrives first, b later with a shorter SLO: both deadlines are at 10 s.
    a, b = _req("a", 0.0, _cls("A", pa, ttft_slo_s=10.0)), _req("b", 5.0, _cls("B", pb, ttft_slo_s=5.0))
    for r in (a, b):
        pol.add(r, 5.0)
    assert [r.id for r in pol.schedule(_view([])).run] == [winner or "a"]  # equal: earlier arrival


def test_priority_never_overrides_the_policy_order() -> None:
    low, high = _cls("low", 0, ttft_slo_s=5.0), _cls("high", 1000, ttft_slo_s=5.0)
    fcfs = make_policy("fcfs")
    early, late = _req("early", 0.0, low), _req("late", 0.5, high)
    for r in (early, late):
        fcfs.add(r, 1.0)
    assert [r.id for r in fcfs.schedule(_view([])).run] == ["early"]
    edf = make_policy("edf")
    soon, later = _req("soon", 0.0, low), _req("later", 0.0, _cls("high", 1000, ttft_slo_s=6.0))
    for r in (later, soon):
        edf.add(r, 1.0)
    assert [r.id for r in edf.schedule(_view([])).run] == ["soon"]
    sjf = make_policy("sjf-oracle")
    short, long = _req("short", 0.0, low, out=10), _req("long", 0.0, high, out=11)
    for r in (long, short):
        sjf.add(r, 1.0)
    assert [r.id for r in sjf.schedule(_view([])).run] == ["short"]


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_fcfs_preempts_the_lower_class_last_in_the_batch(pa: int, pb: int, winner: str | None) -> None:
    # The engine preempts the last request of ``run`` when KV runs out: among equal arrivals the
    # lower class sits last.
    pol = make_policy("fcfs")
    a, b = _req("a", 1.0, _cls("A", pa)), _req("b", 1.0, _cls("B", pb))
    for r in (a, b):
        pol.add(r, 1.0)
    run = [r.id for r in pol.schedule(_view([], max_batch=2)).run]
    assert run[-1] == {"a": "b", "b": "a", None: "b"}[winner]


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_isrtf_priority_breaks_equal_predictions(pa: int, pb: int, winner: str | None) -> None:
    # Every prediction ties; the starvation guard is off so that age does not break the tie first.
    pol = make_policy("isrtf", predictor="constant", aging_tokens_per_s=0)
    a, b = _req("a", 0.0, _cls("A", pa)), _req("b", 1.0, _cls("B", pb))
    for r in (a, b):
        pol.add(r, 1.0)
    assert [r.id for r in pol.schedule(_view([], now=1.0)).run] == [winner or "a"]  # equal: arrival


# ---- Andes (qoe) ----------------------------------------------------------------------------------


def _qoe_profile() -> StepProfile:
    return StepProfile("t", 0.02, 0.0, 0.0, 0.0, 0.0, kv_capacity_tokens=1000, block_size=1)


def _qoe_view(running: list[Request], now: float) -> InstanceView:
    prof = _qoe_profile()
    used = sum(r.prompt_tokens + r.generated + 1 for r in running)
    return InstanceView(now, "i0", running, 8, prof.kv_capacity_tokens, used, prof)


def _streaming(req: Request, first: float, count: int, interval: float) -> Request:
    req.tokens.append_run(first, count, interval)
    req.generated = count
    return _running(req)


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_qoe_knapsack_admits_the_higher_class_among_equal_gains(pa: int, pb: int, winner: str | None) -> None:
    # Triggered (KV above the watermark); a and b are identical and only one fits next to r.
    pol = AndesQoE(kv_watermark=0.1)
    qoe = {"reading_speed_tps": 5.0, "ttft_target_s": 1.0}
    r = _streaming(_req("r", 0.0, _cls("R", 0, **qoe), prompt=100), 1.0, 20, 0.2)
    a, b = (
        _req("a", 19.0, _cls("A", pa, **qoe), prompt=500),
        _req("b", 19.0, _cls("B", pb, **qoe), prompt=500),
    )
    for x in (r, a, b):
        pol.add(x, 20.0)
    ids = {x.id for x in pol.schedule(_qoe_view([r], 20.0)).run}
    assert pol.solves == 1
    chosen = winner or "a"  # equal: the first added
    assert chosen in ids and ({"a", "b"} - {chosen}).isdisjoint(ids)


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_qoe_preempts_the_lower_class_among_equal_gains(pa: int, pb: int, winner: str | None) -> None:
    # x and y run identically with long buffers (little gain) and fill the KV past the watermark;
    # the newcomer needs the KV of one of them.
    pol = AndesQoE(preemption_cap="none")
    qoe = {"reading_speed_tps": 5.0, "ttft_target_s": 1.0}
    x = _streaming(_req("a", 0.0, _cls("A", pa, **qoe), prompt=350), 1.0, 100, 0.02)
    y = _streaming(_req("b", 0.0, _cls("B", pb, **qoe), prompt=350), 1.0, 100, 0.02)
    n = _req("n", 19.0, _cls("N", 0, **qoe), prompt=300)
    for r in (x, y, n):
        pol.add(r, 20.0)
    d = pol.schedule(_qoe_view([x, y], 20.0))
    ids = [r.id for r in d.run]
    kept = winner or "a"  # equal: the first added keeps running
    assert pol.solves == 1 and "n" in ids
    assert kept in ids and ({"a", "b"} - {kept}).isdisjoint(ids)


def test_qoe_untriggered_fcfs_takes_the_higher_class_among_equal_arrivals() -> None:
    pol = AndesQoE()
    a, b = _req("a", 1.0, _cls("A", 1)), _req("b", 1.0, _cls("B", 5))
    for r in (a, b):
        pol.add(r, 1.0)
    assert [r.id for r in pol.schedule(_view([], now=1.0, max_batch=1)).run] == ["b"]
    assert pol.solves == 0


# ---- QLM ------------------------------------------------------------------------------------------


def _groups(pa: int, pb: int, slack: float) -> tuple[list[GroupSpec], list[QueueSpec]]:
    costs = {"q": GroupCosts(10.0, 10.0, 12.0, 0.5)}
    return (
        [GroupSpec(0, "m", slack, costs, priority=pa), GroupSpec(1, "m", slack, costs, priority=pb)],
        [QueueSpec("q", "m")],
    )


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_qlm_overload_the_lower_class_group_misses(pa: int, pb: int, winner: str | None) -> None:
    # Both groups cannot meet a 5 s slack (each drains 10 s): no order meets every SLO, and the
    # EDF fallback puts the higher class first among equal slack.
    groups, queues = _groups(pa, pb, 5.0)
    plan = solve(groups, queues, SolverSettings())
    assert plan.status == "edf-infeasible"
    assert plan.order["q"][0] == {"a": 0, "b": 1, None: 0}[winner]
    assert edf_plan(groups, queues, "edf-timeout").order == plan.order


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_qlm_smith_rule_puts_the_lower_class_last_among_equal_groups(
    pa: int, pb: int, winner: str | None
) -> None:
    groups, queues = _groups(pa, pb, 100.0)  # feasible in either order: total wait ties
    plan = solve(groups, queues, SolverSettings())
    assert plan.status == "optimal"
    assert plan.order["q"][0] == {"a": 0, "b": 1, None: 0}[winner]


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_qlm_policy_serves_the_higher_class_group_when_one_must_miss(
    pa: int, pb: int, winner: str | None
) -> None:
    # Two classes with the same 1 s TTFT SLO, arriving together: their groups' slacks tie and the
    # instance cannot serve both in time.
    pol = QLMPolicy()
    a_cls, b_cls = _cls("A", pa, ttft_slo_s=1.0), _cls("B", pb, ttft_slo_s=1.0)
    reqs = [_req(f"a{i}", 0.0, a_cls, prompt=200, out=500) for i in range(3)]
    reqs += [_req(f"b{i}", 0.0, b_cls, prompt=200, out=500) for i in range(3)]
    for r in reqs:
        pol.add(r, 0.0)
    assert [g.priority for g in pol.vq.groups] == [pa, pb]
    run = pol.schedule(_view([], now=0.0, max_batch=3)).run
    assert pol.counters["solves"] == 1
    assert {r.id[0] for r in run} == {winner or "a"}


# ---- SeaLLM DB, Chiron ----------------------------------------------------------------------------


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_seallm_db_seeds_the_higher_class_among_equal_budgets(pa: int, pb: int, winner: str | None) -> None:
    pol = DoublingBudget({"m": ServiceStats(5.0, 1.0)})
    a, b = _req("a", 0.0, _cls("A", pa)), _req("b", 1.0, _cls("B", pb))  # fresh: O_r ties
    for r in (a, b):
        pol.add(r, 1.0)
    assert [r.id for r in pol.schedule(_view([], now=1.0)).run] == [winner or "a"]  # equal: arrival


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_chiron_evicts_the_lower_class_batch_request(pa: int, pb: int, winner: str | None) -> None:
    # Batch size 2, both slots held by batch work; an interactive arrival evicts one of them.
    pol = ChironPolicy(make_policy("fcfs"), ChironLocal(min_batch=1, max_batch=2, initial=2))
    a = _running(_req("a", 0.0, _cls("A", pa, kind="batch", deadline_s=600.0)))
    b = _running(_req("b", 1.0, _cls("B", pb, kind="batch", deadline_s=600.0)))
    for r in (a, b):
        pol.add(r, 1.0)
    assert [r.id for r in pol.schedule(_view([], now=1.0, max_batch=2)).run] == ["a", "b"]
    pol.add(_req("i", 2.0, _cls("I", 0, ttft_slo_s=1.0)), 2.0)
    d = pol.schedule(_view([a, b], now=2.0, max_batch=2))
    kept = winner or "a"  # equal: the latest admitted (b) is evicted
    assert sorted(r.id for r in d.run) == sorted([kept, "i"])
    assert d.preempt_mode == "swap"


@pytest.mark.parametrize(("pa", "pb", "winner"), CASES)
def test_chiron_global_queue_hands_out_the_higher_class_among_equal_deadlines(
    pa: int, pb: int, winner: str | None
) -> None:
    queue = GlobalQueue(group_s=6.0)
    a = _req("a", 0.0, _cls("A", pa, kind="batch", deadline_s=600.0))
    b = _req("b", 5.0, _cls("B", pb, kind="batch", deadline_s=595.0))  # the same deadline, later
    queue.push(a)
    queue.push(b)
    assert queue.pop_batch().id == (winner or "a")  # equal: arrival


# ---- through the worker (sim engine) --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "edf"])
@pytest.mark.parametrize(("pa", "pb", "winner"), CASES[:2])
async def test_worker_serves_the_higher_class_first_under_overload(
    policy: str, pa: int, pb: int, winner: str
) -> None:
    """One batch slot, taken by a long request; one request of each class arrives at the same instant
    (the scheduler's clock is held still for the arrivals) with the same SLO: the higher class is
    served first, whichever arrives first."""
    slo = {"ttftSeconds": 30, "itlSeconds": 1}
    config = parse_config(
        {
            "models": [{"name": "m", "engine": "sim", "maxModelLen": 512}],
            "classes": {"a": {"slo": slo, "priority": pa}, "b": {"slo": slo, "priority": pb}},
            "scheduling": {"policy": policy, "batch": {"min": 1, "max": 1, "initial": 1}},
        }
    )
    worker = Worker(config)
    app = create_app(worker, manage_worker=False)
    await worker.start()
    sched = worker.scheduler
    done: list[str] = []

    async def post(c: httpx.AsyncClient, cls: str, max_tokens: int) -> httpx.Response:
        body = {"model": "m", "prompt": f"class {cls}", "max_tokens": max_tokens}
        resp = await c.post("/v1/completions", json=body, headers={DEFAULT_CLASS_HEADER: cls})
        done.append(cls)
        return resp

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            long = asyncio.create_task(post(c, "a", 60))
            while sched.waiting or not sched.inflight:
                await asyncio.sleep(0.01)
            frozen = time.monotonic()
            sched.clock = lambda: frozen
            tasks = [asyncio.create_task(post(c, cls, 3)) for cls in ("a", "b")]
            while sched.waiting < 2:
                await asyncio.sleep(0)
            sched.clock = time.monotonic
            assert not long.done()  # both arrived while the slot was taken
            answers = await asyncio.wait_for(asyncio.gather(long, *tasks), 30)
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert done == ["a", winner, {"a": "b", "b": "a"}[winner]]
    finally:
        await worker.stop()
