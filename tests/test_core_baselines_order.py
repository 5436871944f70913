"""Ordering rules of the baseline policies on hand-built queues."""

from __future__ import annotations

from tessera.core import InstanceView, Phase, Request, ServiceClass, StepProfile
from tessera.core.registry import make_policy

PROFILE = StepProfile("t", 0.01, 0.0, 0.0, 0.01, 0.0, kv_capacity_tokens=100_000)


def view(running: list[Request], now: float = 10.0, max_batch: int = 2) -> InstanceView:
    return InstanceView(now, "i0", running, max_batch, PROFILE.kv_capacity_tokens, 0, PROFILE)


def req(rid: str, arrival: float, out: int, deadline: float | None = None) -> Request:
    cls = ServiceClass(name="c", ttft_slo_s=deadline)
    return Request(rid, arrival, 10, 1000, service_class=cls, true_output_tokens=out)


def test_fcfs_runs_in_arrival_order_and_keeps_running() -> None:
    pol = make_policy("fcfs")
    a, b, c = req("a", 3.0, 5), req("b", 1.0, 50), req("c", 2.0, 1)
    for r in (a, b, c):
        pol.add(r, 3.0)
    assert [r.id for r in pol.schedule(view([])).run] == ["b", "c"]
    b.phase = c.phase = Phase.RUNNING
    # a later, earlier-arrived request never displaces running ones (non-preemptive)
    d = req("d", 0.5, 1)
    pol.add(d, 4.0)
    assert [r.id for r in pol.schedule(view([b, c])).run] == ["b", "c"]


def test_edf_orders_by_slo_deadline() -> None:
    pol = make_policy("edf")
    a, b = req("a", 0.0, 5, deadline=10.0), req("b", 1.0, 5, deadline=2.0)
    pol.add(a, 1.0)
    pol.add(b, 1.0)
    assert [r.id for r in pol.schedule(view([], max_batch=1)).run] == ["b"]


def test_edf_late_last_puts_a_request_that_became_late_while_queued_behind_those_on_time() -> None:
    def first(late_last: bool) -> str:
        pol = make_policy("edf", {"lateLast": late_last})
        busy = req("busy", 0.0, 5, deadline=1.0)
        late, on_time = req("late", 0.0, 5, deadline=3.0), req("on-time", 1.0, 5, deadline=20.0)
        for r in (busy, late, on_time):
            pol.add(r, 1.0)
        assert [r.id for r in pol.schedule(view([], now=1.0, max_batch=1)).run] == ["busy"]
        busy.phase = Phase.RUNNING
        assert [r.id for r in pol.schedule(view([busy], now=2.0, max_batch=1)).run] == ["busy"]
        busy.phase = Phase.FINISHED
        pol.remove(busy, 9.0)
        return pol.schedule(view([], now=10.0, max_batch=1)).run[0].id  # "late" queued past its t=3

    assert first(late_last=False) == "late"  # plain EDF: the earliest deadline, met or not
    assert first(late_last=True) == "on-time"


def test_edf_late_last_forgets_the_deadlines_of_requests_that_left_its_queue() -> None:
    """A batch deadline can be an hour away: the deadlines watched for re-keying must not keep every
    request that already ran until then."""
    pol = make_policy("edf", {"lateLast": True})
    for i in range(500):
        r = req(f"r{i}", float(i), 5, deadline=3600.0)
        pol.add(r, float(i))
        (ran,) = pol.schedule(view([], now=float(i), max_batch=1)).run
        ran.phase = Phase.FINISHED
        pol.remove(ran, float(i))
    assert len(pol._on_time) <= 64 + 1


def test_sjf_and_srtf_oracles() -> None:
    sjf = make_policy("sjf-oracle")
    a, b = req("a", 0.0, 100), req("b", 1.0, 10)
    sjf.add(a, 1.0)
    sjf.add(b, 1.0)
    assert [r.id for r in sjf.schedule(view([], max_batch=1)).run] == ["b"]

    srtf = make_policy("srtf-oracle")
    long_running = req("x", 0.0, 100)
    long_running.phase, long_running.generated = Phase.RUNNING, 10
    srtf.add(long_running, 0.0)
    srtf.schedule(view([], max_batch=1))
    short = req("y", 5.0, 20)
    srtf.add(short, 5.0)
    decision = srtf.schedule(view([long_running], max_batch=1))
    assert [r.id for r in decision.run] == ["y"]  # 20 remaining beats 90 remaining: preempt
    assert decision.recheck_after_tokens == 50
