"""Chiron global autoscaler (spec B5): IBP band, stabilisation, batch backpressure minimality."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tessera.core.chiron import (
    ORPHAN_WAIT_S,
    ArrivalMeter,
    GlobalQueue,
    PullCandidate,
    batch_pulls,
    interactive_lends,
)
from tessera.core.planners import (
    AutoscalerState,
    BatchGroup,
    ChironSettings,
    MetricsSnapshot,
    RoleCounts,
    assign_roles,
    chiron_decide,
)
from tessera.core.planners.chiron import batch_backpressure, waiting_time
from tessera.core.request import Request, ServiceClass

BATCH_CLASS = ServiceClass("offline", kind="batch", deadline_s=600.0)
S = ChironSettings(over_provisioning=1 / 3, band=0.05, scale_down_cooldown_s=0.0, load_time_s=15.0)


def test_scale_up_when_ibp_above_band_hits_target_at_once():
    snap = MetricsSnapshot(ready=RoleCounts(interactive=2, mixed=1), instances_with_interactive=3)
    d = chiron_decide(snap, AutoscalerState(), S, now=10.0)
    # U = 3 -> N_IM* = 9, N_I* = 3, N_M* = 6
    assert d.desired == RoleCounts(interactive=3, mixed=6, batch=0)
    assert d.ibp == pytest.approx(1.0)
    assert d.reasons and "IBP" in d.reasons[0]
    assert d.state.last_scaling == 10.0


def test_pending_instances_prevent_repeated_scale_up():
    snap = MetricsSnapshot(
        ready=RoleCounts(interactive=2, mixed=1),
        pending=RoleCounts(interactive=1, mixed=5),
        instances_with_interactive=3,
    )
    d = chiron_decide(snap, AutoscalerState(), S, now=10.0)
    assert d.desired == RoleCounts(interactive=3, mixed=6)
    assert not d.changed(RoleCounts(interactive=3, mixed=6))


def test_in_band_keeps_counts():
    snap = MetricsSnapshot(ready=RoleCounts(interactive=3, mixed=6), instances_with_interactive=3)
    d = chiron_decide(snap, AutoscalerState(), S, now=0.0)
    assert d.desired == RoleCounts(interactive=3, mixed=6)
    assert d.reasons == ()


def test_scale_down_needs_consecutive_low_evaluations_and_drains_mixed_first():
    snap = MetricsSnapshot(ready=RoleCounts(interactive=3, mixed=6), instances_with_interactive=1)
    st = AutoscalerState()
    d1 = chiron_decide(snap, st, S, now=0.0)
    assert d1.desired == RoleCounts(interactive=3, mixed=6)  # first low evaluation: hold
    d2 = chiron_decide(snap, d1.state, S, now=5.0)
    # U = 1 -> N_IM* = 3: N_I* = 1, N_M* = 2; mixed drained first (6 -> 2), then interactive (3 -> 1)
    assert d2.desired == RoleCounts(interactive=1, mixed=2)
    assert d2.state.low_evaluations == 0


def test_scale_down_cooldown_stabilises():
    settings = ChironSettings(scale_down_cooldown_s=120.0)
    snap_hi = MetricsSnapshot(ready=RoleCounts(interactive=1, mixed=0), instances_with_interactive=1)
    up = chiron_decide(snap_hi, AutoscalerState(), settings, now=0.0)
    assert up.desired.total == 3
    snap_lo = MetricsSnapshot(ready=up.desired, instances_with_interactive=0)
    st = up.state
    for t in (5.0, 10.0, 15.0, 60.0):
        d = chiron_decide(snap_lo, st, settings, now=t)
        assert d.desired == up.desired, t
        st = d.state
    d = chiron_decide(snap_lo, st, settings, now=125.0)
    assert d.desired.total < up.desired.total


def test_no_flapping_under_alternating_load():
    """Load alternating around the band edges must not make the counts oscillate every evaluation."""
    settings = ChironSettings(scale_down_cooldown_s=60.0)
    counts = RoleCounts(interactive=1)
    st = AutoscalerState()
    changes = 0
    for step in range(120):
        busy = 4 if step % 2 else 3
        d = chiron_decide(
            MetricsSnapshot(ready=counts, instances_with_interactive=min(busy, counts.total)),
            st,
            settings,
            5.0 * step,
        )
        changes += d.desired != counts
        counts, st = d.desired, d.state
    assert changes <= 3


def test_queued_interactive_triggers_scale_up_even_without_instances():
    snap = MetricsSnapshot(ready=RoleCounts(), interactive_queued=5)
    d = chiron_decide(snap, AutoscalerState(), S, now=0.0)
    assert d.desired.interactive >= 1 and d.desired.total == 3


def test_waiting_time_piecewise():
    assert waiting_time(100, 10, 0, 5, 15) == pytest.approx(10)
    # 10*15 = 150 by load time, then 10 + 2*5 = 20 tok/s for the remaining 50
    assert waiting_time(200, 10, 2, 5, 15) == pytest.approx(15 + 2.5)
    assert waiting_time(200, 0, 0, 5, 15) == math.inf


def _batch_snapshot(n_groups: int, per_group: int, deadline_step: float) -> MetricsSnapshot:
    return MetricsSnapshot(
        ready=RoleCounts(interactive=1, mixed=2),
        instances_with_interactive=1,
        batch_queue=tuple(BatchGroup(per_group, 3600 + i * deadline_step) for i in range(n_groups)),
        batch_tokens_per_s=500.0,
        mean_output_tokens=300.0,
        std_output_tokens=100.0,
    )


def _bbp(snap, k, settings):
    return batch_backpressure(
        snap.batch_queue,
        now=0.0,
        mean_tokens=300.0,
        std_tokens=100.0,
        rate_now=500.0,
        per_instance=settings.default_instance_tokens_per_s,
        extra_instances=k,
        settings=settings,
    )


def test_batch_autoscaler_returns_smallest_k_with_zero_backpressure():
    snap = _batch_snapshot(n_groups=4, per_group=20_000, deadline_step=600)
    d = chiron_decide(snap, AutoscalerState(), S, now=0.0)
    k = d.desired.batch
    assert k > 1  # several instances in one step for a large queue
    assert _bbp(snap, k, S) == 0
    assert _bbp(snap, k - 1, S) > 0
    assert d.batch_backpressure == _bbp(snap, 0, S)


def test_batch_autoscaler_adds_nothing_when_no_backpressure():
    snap = _batch_snapshot(n_groups=2, per_group=100, deadline_step=600)
    d = chiron_decide(snap, AutoscalerState(), S, now=0.0)
    assert d.desired.batch == 0 and d.batch_backpressure == 0


def test_batch_instances_retire_only_when_queue_empty_and_idle():
    busy = MetricsSnapshot(
        ready=RoleCounts(interactive=1, mixed=2, batch=4), instances_with_interactive=1, batch_running=10
    )
    assert chiron_decide(busy, AutoscalerState(), S, now=0.0).desired.batch == 4
    idle = MetricsSnapshot(ready=RoleCounts(interactive=1, mixed=2, batch=4), instances_with_interactive=1)
    assert chiron_decide(idle, AutoscalerState(), S, now=0.0).desired.batch == 0


def test_unsaveable_group_does_not_launch_the_whole_cap():
    # Deadline in 5 s: shorter than the 15 s load time, no instance can help.
    snap = MetricsSnapshot(
        ready=RoleCounts(interactive=1, mixed=2),
        instances_with_interactive=1,
        batch_queue=(BatchGroup(10_000, 5.0),),
        batch_tokens_per_s=100.0,
        mean_output_tokens=300.0,
        std_output_tokens=0.0,
    )
    d = chiron_decide(snap, AutoscalerState(), S, now=0.0)
    assert d.desired.batch == 0
    assert d.batch_backpressure == 1


def test_overdue_backlog_beyond_the_cap_takes_every_free_slot():
    # 300,000 requests of 300 tokens past their deadline: 90M tokens, to finish within one more batch
    # SLO (3600 s) at 500 tok/s now plus 2000 tok/s per new instance after its 15 s load. Even 6 new
    # instances give 1.8M + 6 x 7.17M = 44.8M tokens in that time: the group stays late whatever is
    # launched, so every slot the interactive targets leave is launched (Alg. 2 runs to the cap).
    # The fewest-k rule alone launched none, since no k lowers BBP.
    settings = ChironSettings(max_instances=10, scale_down_cooldown_s=0.0, load_time_s=15.0)
    snap = MetricsSnapshot(
        ready=RoleCounts(interactive=1, batch=3),
        instances_with_interactive=1,
        batch_queue=(BatchGroup(300_000, -100.0),),
        batch_running=100,
        batch_tokens_per_s=500.0,
        mean_output_tokens=300.0,
        std_output_tokens=0.0,
    )
    assert _bbp(snap, 6, settings) == 1
    d = chiron_decide(snap, AutoscalerState(), settings, now=0.0)
    assert d.desired.total == 10 and d.desired.batch > 3
    assert d.batch_backpressure == 1
    off = chiron_decide(snap, AutoscalerState(), replace(settings, overdue_fills_cap=False), now=0.0)
    assert off.desired.batch == 3


def test_cap_bounds_total_and_interactive_comes_first():
    settings = ChironSettings(max_instances=6, scale_down_cooldown_s=0.0)
    snap = _batch_snapshot(n_groups=4, per_group=50_000, deadline_step=600)
    snap = replace(snap, instances_with_interactive=3)
    d = chiron_decide(snap, AutoscalerState(), settings, now=0.0)
    assert d.desired.total <= 6
    assert d.desired.interactive + d.desired.mixed == 6


def test_defer_counts_only_groups_near_their_deadline():
    settings = ChironSettings(
        defer=True, batch_slo_s=3600.0, defer_horizon_fraction=0.25, scale_down_cooldown_s=0
    )
    snap = _batch_snapshot(n_groups=4, per_group=20_000, deadline_step=600)
    assert chiron_decide(snap, AutoscalerState(), settings, now=0.0).desired.batch == 0
    late = chiron_decide(snap, AutoscalerState(), settings, now=3600 - 800.0)
    assert late.desired.batch > 0


def test_settings_validation():
    with pytest.raises(ValueError, match="over_provisioning"):
        ChironSettings(over_provisioning=0)
    with pytest.raises(ValueError, match="band"):
        ChironSettings(over_provisioning=0.2, band=0.3)
    with pytest.raises(ValueError, match="count"):
        BatchGroup(-1, 0.0)


def test_load_forecasting_sizes_the_spare_from_the_arrival_trend():
    fc = replace(S, forecast_window_s=60.0, forecast_utilization=0.8)
    ready = RoleCounts(interactive=4, mixed=0)
    flat = MetricsSnapshot(ready=ready, instances_with_interactive=4, interactive_arrival_rps=10.0)
    # A flat rate: Θ = 0.8, so 4 busy instances want 5 (Θ_op 1/3 would want 12).
    d = chiron_decide(flat, AutoscalerState(), fc, now=0.0)
    d = chiron_decide(flat, d.state, fc, now=30.0)
    assert d.desired.interactive + d.desired.mixed == 5
    assert d.state.arrival_history == ((0.0, 10.0), (30.0, 10.0))
    # 15 req/s at 40 s, 10 at 0 s: trend 0.125 req/s per second, growth over the 15 s load time
    # 1 + 0.125 * 15 / 15 = 1.125, Θ = 0.8 / 1.125: 4 busy want ceil(4 * 1.125 / 0.8) = 6.
    rising = replace(flat, interactive_arrival_rps=15.0)
    up = chiron_decide(rising, d.state, fc, now=40.0)
    assert up.desired.interactive + up.desired.mixed == 6
    # Measurements older than the window drop out; a history under half a window gives no trend.
    later = chiron_decide(rising, up.state, fc, now=95.0)
    assert later.state.arrival_history == ((40.0, 15.0), (95.0, 15.0))
    assert chiron_decide(rising, AutoscalerState(), fc, now=0.0).desired.total == 5
    # Off (the paper's rule) or without a measured rate: Θ_op.
    assert chiron_decide(rising, d.state, S, now=40.0).desired.total == 12
    no_rate = replace(flat, interactive_arrival_rps=None)
    assert chiron_decide(no_rate, AutoscalerState(), fc, now=0.0).desired.total == 12
    with pytest.raises(ValueError, match="forecast_utilization"):
        replace(S, forecast_utilization=0.01)


def test_arrival_meter_counts_the_window():
    meter = ArrivalMeter(10.0)
    for t in (0.0, 1.0, 2.0, 9.5):
        meter.record(t)
    assert meter.rate(9.5) == pytest.approx(4 / 9.5)  # watched for 9.5 s of the 10 s window
    assert meter.rate(11.5) == pytest.approx(0.2)  # 0 and 1 s have left the window
    # Before a whole window has passed, the rate is over the time watched (Prometheus's rate() over the
    # samples it has), not diluted by the part of the window before the meter started.
    young = ArrivalMeter(60.0, start=100.0)
    for t in (101.0, 102.0, 104.0, 105.0):
        young.record(t)
    assert young.rate(110.0) == pytest.approx(0.4)
    assert young.rate(100.0) == 0.0
    with pytest.raises(ValueError, match="window"):
        ArrivalMeter(0.0)


def test_a_change_of_counts_re_roles_only_what_it_must():
    """Decided counts reach a group's pods by ordinal (one StatefulSet: only the highest ordinals leave,
    new ones come after the last); each running pod keeps its role where the counts allow."""
    i, m, b = "interactive", "mixed", "batch"
    assert assign_roles(RoleCounts(interactive=2, mixed=1, batch=1)) == (i, i, m, b)
    # one more interactive beside the batch ones: a new ordinal; no batch pod is re-roled
    assert assign_roles(RoleCounts(interactive=3, batch=3), (i, i, b, b, b)) == (i, i, b, b, b, i)
    # and one fewer again: the top one leaves
    assert assign_roles(RoleCounts(interactive=2, batch=3), (i, i, b, b, b, i)) == (i, i, b, b, b)
    # fewer interactive with the interactive ones below the batch ones: the highest surplus ordinal
    # takes the missing role, the top (batch) ordinal leaves
    assert assign_roles(RoleCounts(interactive=2, batch=2), (i, i, i, b, b)) == (i, i, b, b)
    # the batch work done: kept batch ordinals become interactive at once instead of starting new ones
    assert assign_roles(RoleCounts(interactive=3), (i, i, b, b, b, i)) == (i, i, i)
    # running ordinals take the missing roles before new ones do, interactive first (highest ordinal)
    assert assign_roles(RoleCounts(interactive=1, mixed=1), (b, b)) == (m, i)
    assert assign_roles(RoleCounts(interactive=2, batch=1), (b, b)) == (b, i, i)
    assert assign_roles(RoleCounts(), (i, b)) == ()


def _candidate(name: str, role: str, outstanding: int = 0, ready: bool = True) -> PullCandidate:
    return PullCandidate(name, role, batch_size=4, kv_capacity_tokens=1_000_000, outstanding=outstanding,
                         ready=ready)  # fmt: skip


def test_batch_pulls_fill_batch_instances_then_mixed_ones_up_to_their_room() -> None:
    cands = [_candidate("i", "interactive"), _candidate("m", "mixed", 1), _candidate("b", "batch", 3),
             _candidate("b2", "batch", ready=False)]  # fmt: skip
    assert batch_pulls(cands, 10, False, 100.0) == [("b", 1), ("m", 3)]
    assert batch_pulls(cands, 2, False, 100.0) == [("b", 1), ("m", 1)]
    # mixed instances lend nothing while interactive work waits for an instance
    assert batch_pulls(cands, 10, True, 100.0) == [("b", 1)]
    # the KV bounds the room: 1,000,000 tokens hold two requests of 400,000
    assert batch_pulls(cands, 10, False, 400_000.0) == [("m", 1)]
    assert batch_pulls(cands, 10, False, 100.0, lend_interactive=True) == [("b", 1), ("m", 3), ("i", 4)]


def test_interactive_instances_lend_only_to_work_orphaned_for_the_wait() -> None:
    queue = GlobalQueue(group_s=6.0)
    only = [_candidate("i", "interactive")]
    assert not interactive_lends(only, queue, now=1000.0)  # nothing held
    queue.push(Request("a", 100.0, 10, 10, service_class=BATCH_CLASS))
    queue.push(Request("b", 150.0, 10, 10, service_class=BATCH_CLASS))
    assert not interactive_lends(only, queue, now=100.0 + ORPHAN_WAIT_S - 1)
    assert interactive_lends(only, queue, now=100.0 + ORPHAN_WAIT_S)
    # a batch or mixed instance, even one still starting, will take the work
    assert not interactive_lends([*only, _candidate("b", "batch", ready=False)], queue, now=1e6)
    assert not interactive_lends([*only, _candidate("m", "mixed")], queue, now=1e6)


def test_a_held_request_whose_client_left_is_dropped_from_its_group() -> None:
    queue = GlobalQueue(group_s=10.0)
    reqs = [Request(str(i), float(i), 10, 10, service_class=BATCH_CLASS) for i in range(5)]
    for r in reqs:
        queue.push(r)
    assert queue.drop(reqs[2]) and not queue.drop(reqs[2])
    assert queue.drop(reqs[4])
    assert sum(g.count for g in queue.batch_groups(0.0)) == 3
    assert [r.id for r in queue.take_batch(10)] == ["0", "1", "3"]
    assert queue.batch_groups(0.0) == ()


def _job_snapshot(deadline: float, **kw) -> MetricsSnapshot:
    """One job of 6,000 lines of 300 tokens (1.8M tokens), nothing of it running yet, beside one
    interactive instance with no spare: only batch instances (2,000 tok/s each after a 15 s load) run it."""
    return MetricsSnapshot(
        ready=RoleCounts(interactive=1),
        instances_with_interactive=1,
        batch_queue=(BatchGroup(6_000, deadline),),
        batch_tokens_per_s=0.0,
        mean_output_tokens=300.0,
        std_output_tokens=0.0,
        **kw,
    )


def test_just_in_time_waits_while_a_later_launch_still_meets_the_deadline():
    # One instance needs 15 + 900 s for the job; the deadline is 2000 s away, so launching at the
    # next evaluation (5 s) still meets it: just in time waits, Alg. 2 launches at once.
    jit = replace(S, just_in_time=True)
    snap = _job_snapshot(2000.0)
    assert chiron_decide(snap, AutoscalerState(), S, now=0.0).desired.batch == 1
    d = chiron_decide(snap, AutoscalerState(), jit, now=0.0)
    assert d.desired.batch == 0
    assert d.batch_backpressure == 1 and "just in time" in d.reasons[-1]
    # At 1082 s one instance launched now ends at 1997 s, launched at the next evaluation at 2002 s: now.
    assert chiron_decide(snap, AutoscalerState(), jit, now=1082.0).desired.batch == 1
    # Later one instance no longer suffices: two (15 + 450 s) wait until 1532 s, their latest start.
    assert chiron_decide(snap, AutoscalerState(), jit, now=1530.0).desired.batch == 0
    assert chiron_decide(snap, AutoscalerState(), jit, now=1532.0).desired.batch == 2


def test_just_in_time_never_waits_for_an_overdue_group():
    jit = replace(S, just_in_time=True)
    snap = _job_snapshot(-10.0)
    assert chiron_decide(snap, AutoscalerState(), jit, now=0.0).desired.batch > 0
