"""VTC fair share between tenants (``tessera.core.fair_share``), run the way the product runs it: built
by ``WorkerConfig.make_policy`` when ``scheduling.fairShare`` is on, in the simulator and in a real
``tessera worker`` process (sim engine) over HTTP, which must make the same decisions on one
two-tenant trace."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import httpx
import pytest
from router_harness import CLASS_HEADER, MODEL, PLAN

from tessera.api.tenant import TENANT_HEADER, TENANT_WEIGHT_HEADER
from tessera.api.worker_config import WorkerConfig
from tessera.core.fair_share import FairShare
from tessera.core.policy import InstanceView
from tessera.core.registry import make_policy
from tessera.core.request import Request, ServiceClass
from tessera.local.supervisor import Supervisor
from tessera.router.headers import upstream_headers
from tessera.sim.cluster import Cluster, ClusterConfig
from tessera.sim.engine import EngineConfig

CHAT = ServiceClass("chat", ttft_slo_s=5.0)
BASE = PLAN.instances[0].config


def _config(fair: bool, max_batch: int = 1, policy: str = "fcfs") -> WorkerConfig:
    """The quickstart worker with ``policy``, a batch of ``max_batch``, fair share on or off."""
    data = BASE.to_json()
    data["scheduling"] = {**data["scheduling"], "policy": policy, "settings": {},
                          "batch": {"min": 1, "max": max_batch, "initial": max_batch},
                          "autoscale": {"enabled": False}, "fairShare": {"enabled": fair},
                          "benchHints": make_policy(policy).oracle}  # fmt: skip
    return WorkerConfig.model_validate(data)


def _simulate(config: WorkerConfig, requests: list[Request]) -> list[Request]:
    """``requests`` through the simulator under the configuration's policy (its own make_policy), the
    engine as the worker's sim engine runs it; the requests in the order they finished."""
    entry = config.models[0]
    profile = entry.profile.to_profile(MODEL, entry.kv_capacity_tokens)
    engine = EngineConfig(max_batch=config.scheduling.batch.start, chunked_prefill=True, swap_space_tokens=0)
    Cluster(ClusterConfig({MODEL: profile}, 1, engine), config.make_policy).run(requests)
    return sorted(requests, key=lambda r: r.finished_at or 0.0)


def _flood(prompt: int = 40, output: int = 100) -> list[Request]:
    """Tenant b sends six requests at 0; tenant a, three at 0.05 s, while b's first runs; all alike."""
    reqs = [Request(f"b{i}", 0.0, prompt, output, MODEL, CHAT, output, tenant="b") for i in range(6)]
    return reqs + [Request(f"a{i}", 0.05, prompt, output, MODEL, CHAT, output, tenant="a") for i in range(3)]


FAIR_ORDER = ["b", "a", "b", "a", "b", "a", "b", "b", "b"]


def test_make_policy_wraps_the_policy_only_when_fair_share_is_on() -> None:
    assert isinstance(_config(True).make_policy(), FairShare)
    assert not isinstance(_config(False).make_policy(), FairShare)
    assert _config(True).make_policy().name == "fcfs"


def test_a_late_tenant_is_lifted_and_alternates_with_the_flooding_one() -> None:
    """With VTC, a arrives lifted to b's counter (not at 0, which would hand it all three slots first)
    and the two alternate while both wait; without it, FCFS serves b's flood first."""
    assert [r.tenant for r in _simulate(_config(True), _flood())] == FAIR_ORDER
    assert [r.tenant for r in _simulate(_config(False), _flood())] == ["b"] * 6 + ["a"] * 3


def test_a_tenant_of_weight_two_gets_twice_the_service() -> None:
    reqs = [Request(f"b{i}", 0.0, 40, 60, MODEL, CHAT, 60, tenant="b") for i in range(8)]
    reqs += [Request(f"a{i}", 0.0, 40, 60, MODEL, CHAT, 60, tenant="a", tenant_weight=2.0) for i in range(8)]
    order = "".join(r.tenant for r in _simulate(_config(True), reqs))
    assert order[:9] in ("aabaabaab", "abaabaaba"), order


def test_the_inner_order_decides_within_a_tenant_and_classes_are_shared_apart() -> None:
    """EDF inside VTC: within tenant b its own deadlines decide; a's batch class does not count against
    a's chat service."""
    bulk = ServiceClass("bulk", kind="batch", deadline_s=100.0)
    reqs = [Request(f"b{i}", 0.0, 40, 50, MODEL, dataclasses.replace(CHAT, ttft_slo_s=10.0 - i), 50,
                    tenant="b") for i in range(4)]  # fmt: skip
    reqs += [Request("a-bulk", 0.0, 40, 50, MODEL, bulk, 50, tenant="a")]
    reqs += [Request(f"a{i}", 0.01, 40, 50, MODEL, CHAT, 50, tenant="a") for i in range(2)]
    done = [r.id for r in _simulate(_config(True, policy="edf"), reqs) if r.service_class.name == "chat"]
    assert [d for d in done if d.startswith("b")] == ["b3", "b2", "b1", "b0"]  # EDF's order within b
    assert done[:4] == ["b3", "a0", "b2", "a1"]


def test_a_cancelled_held_request_leaves_no_trace() -> None:
    policy = FairShare(make_policy("fcfs"))
    first, held = (Request(f"r{i}", 0.0, 10, 5, MODEL, CHAT, tenant=t) for i, t in enumerate("ab"))
    policy.add(first, 0.0)
    policy.add(held, 0.0)
    assert len(policy) == 2
    policy.remove(held, 0.1)
    assert len(policy) == 1 and policy.counters[("chat", "b")] == 0.0


def test_a_tenant_arriving_before_the_engine_shows_an_admission_is_lifted_past_it() -> None:
    """The worker may take an arrival between a decision and the next one (which shows what the engine
    admitted): the lift counts the admission proposed, as the simulator's later decision would."""
    entry = BASE.models[0]
    view = InstanceView(0.0, "i", [], 1, 100_000, 0, entry.profile.to_profile(MODEL, 100_000))
    policy = FairShare(make_policy("fcfs"))
    first, second = (Request(f"b{i}", 0.0, 40, 10, MODEL, CHAT, tenant="b") for i in range(2))
    policy.add(first, 0.0)
    policy.add(second, 0.0)
    assert policy.schedule(view).run == [first]
    policy.add(Request("a0", 0.01, 40, 10, MODEL, CHAT, tenant="a"), 0.01)
    assert policy.counters[("chat", "a")] == 40.0  # b's admitted prompt, not 0


@pytest.mark.parametrize("credit", [0.0, 100.0])
def test_a_tenant_with_requests_running_is_lifted_to_the_credit_below_the_least(credit: float) -> None:
    """The paper's lift raises a to b's counter when a's queue empties, though a's request still runs;
    with ``lift_credit`` it stays up to the credit below. A tenant with nothing running gets the full lift."""
    entry = BASE.models[0]
    profile = entry.profile.to_profile(MODEL, 100_000)
    policy = FairShare(make_policy("fcfs"), lift_credit=credit)
    a0, a1 = (Request(f"a{i}", 0.0, 40, 900, MODEL, CHAT, tenant="a") for i in range(2))
    b0, b1 = (Request(f"b{i}", 0.0, 40, 900, MODEL, CHAT, tenant="b") for i in range(2))

    def decide(*running: Request) -> list[Request]:
        return policy.schedule(InstanceView(0.0, "i", list(running), 2, 100_000, 0, profile)).run

    policy.add(a0, 0.0)
    assert decide() == [a0]
    policy.add(b0, 0.0)
    policy.add(b1, 0.0)
    assert decide(a0) == [a0, b0]  # a's prompt charged (40); b lifted to it and admitted
    b0.generated = 500
    decide(a0, b0)  # b: 40 + 40 + 2 x 500; b1 waits (no slot)
    assert policy.counter("chat", "b") == 1080.0
    policy.add(a1, 0.0)  # a0 still runs
    assert policy.counter("chat", "a") == 1080.0 - credit
    policy.add(Request("c0", 0.0, 40, 10, MODEL, CHAT, tenant="c"), 0.0)  # nothing of c's running
    assert policy.counter("chat", "c") == 1080.0 - credit  # the least backlogged, a's, in full
    with pytest.raises(ValueError, match="lift_credit"):
        FairShare(make_policy("fcfs"), lift_credit=-1.0)


@pytest.mark.parametrize("inner", ["fcfs", "edf", "srtf-oracle"])
def test_the_service_gap_of_two_backlogged_tenants_stays_within_vtcs_bound(inner: str) -> None:
    rng = random.Random(7)
    reqs = []
    for n in range(160):
        tenant = "b" if rng.random() < 0.8 else "a"
        out = rng.randint(5, 120)
        reqs.append(
            Request(f"{tenant}{n}", n * 0.01, rng.randint(10, 300), out, MODEL, CHAT, out, tenant=tenant)
        )
    config = _config(True, max_batch=4, policy=inner)
    policies: list[FairShare] = []

    def build() -> FairShare:
        policies.append(config.make_policy())  # type: ignore[arg-type]
        return policies[-1]

    entry = config.models[0]
    engine = EngineConfig(max_batch=4, chunked_prefill=True, swap_space_tokens=0)
    Cluster(
        ClusterConfig({MODEL: entry.profile.to_profile(MODEL, entry.kv_capacity_tokens)}, 1, engine), build
    ).run(reqs)
    (policy,) = policies
    bound = 2 * max(1 * r.prompt_tokens + 2 * r.generated for r in reqs)
    assert 0 < policy.max_service_gap <= bound
    assert policy.max_request_service == bound / 2


def _preempting(preempt: bool, mode: str) -> tuple[FairShare, list[Request]]:
    """b's four long requests at 0 fill a batch of 2; a's two short ones arrive at 0.05 s and 0.06 s;
    VTC with or without ``preempt``, the engine preempting by ``mode``."""
    reqs = [Request(f"b{i}", 0.0, 40, 200, MODEL, CHAT, 200, tenant="b") for i in range(4)]
    reqs += [Request(f"a{i}", 0.05 + i / 100, 40, 10, MODEL, CHAT, 10, tenant="a") for i in range(2)]
    policy = FairShare(make_policy("fcfs"), preempt=preempt)
    entry = BASE.models[0]
    engine = EngineConfig(max_batch=2, chunked_prefill=True, swap_space_tokens=0, preempt_mode=mode)  # type: ignore[arg-type]
    Cluster(ClusterConfig({MODEL: entry.profile.to_profile(MODEL, entry.kv_capacity_tokens)}, 1, engine),
            lambda: policy).run(reqs)  # fmt: skip
    return policy, reqs


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_preempt_gives_the_least_served_tenant_its_share_of_the_slots_at_once(mode: str) -> None:
    """Without ``preempt`` a waits for one of b's requests to end; with it, a takes the slot of b's
    latest admitted request at its next decision (b holds both slots, over its share of one), and only
    that one: a holding its share, its second request waits as in plain VTC. The preempted request
    resumes and completes; the service gap stays within the bound."""
    plain, before = _preempting(False, mode)
    fair, after = _preempting(True, mode)
    first_end = min(r.finished_at or 0.0 for r in before if r.tenant == "b")
    assert before[4].first_scheduled_at is not None and before[4].first_scheduled_at >= first_end
    assert plain.preempted == 0 and fair.preempted == 1
    a0, a1 = after[4], after[5]
    assert a0.first_scheduled_at is not None and a0.first_scheduled_at < 0.06  # at its arrival's decision
    assert after[1].preemptions == 1 and after[0].preemptions == 0  # b1, the latest admitted
    assert a1.first_scheduled_at is not None and a1.first_scheduled_at >= (a0.finished_at or 0.0)
    assert all(r.generated == r.target_output_tokens for r in after)
    bound = 2 * max(1 * r.prompt_tokens + 2 * r.generated for r in after)
    assert fair.max_service_gap <= bound and fair.service == plain.service  # each got all it asked


def test_the_router_drops_a_tenant_header_a_client_sent() -> None:
    sent = [("x-tessera-tenant", "someone-else"), ("X-Tessera-Tenant-Weight", "1000"), ("accept", "*/*")]
    for drop in (True, False):
        assert upstream_headers(sent, drop_authorization=drop) == [
            ("accept", "*/*"),
            ("content-type", "application/json"),
        ]


@pytest.mark.integration
async def test_a_worker_process_makes_the_simulators_decisions_on_a_two_tenant_trace(tmp_path: Path) -> None:
    """The same trace through a ``tessera worker`` (sim engine in real time, batch of 1, fair share on)
    over HTTP, the tenant in the router's header: the requests finish in the simulator's order."""
    config = _config(True)
    expected = [r.tenant for r in _simulate(config, _flood())]
    assert expected == FAIR_ORDER
    supervisor = Supervisor(tmp_path, grace_s=2.0)
    supervisor.start_all([dataclasses.replace(PLAN.instances[0], config=config)], 60.0)
    finished: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=supervisor.workers[0].url, timeout=60) as client:

            async def one(tenant: str) -> None:
                answer = await client.post("/v1/completions", headers={
                    CLASS_HEADER: "chat", TENANT_HEADER: tenant, TENANT_WEIGHT_HEADER: "1"},
                    json={"model": MODEL, "prompt": "the same prompt for all", "max_tokens": 100,
                          "ignore_eos": True})  # fmt: skip
                assert answer.status_code == 200, answer.text
                finished.append(tenant)

            flood = [asyncio.create_task(one("b")) for _ in range(6)]
            await asyncio.sleep(0.05)
            late = [asyncio.create_task(one("a")) for _ in range(3)]
            await asyncio.gather(*flood, *late)
    finally:
        supervisor.stop_all()
    assert finished == expected
