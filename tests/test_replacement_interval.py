"""SeaLLM adaptive re-placement interval (Eq. 8) and least-churn roll-out."""

from __future__ import annotations

import pytest

from tessera.core.planners import (
    GroupPlan,
    IntervalMetrics,
    IntervalSettings,
    PlacementPlan,
    RoleCounts,
    next_replacement_interval,
    rollout_diff,
)
from tessera.core.planners.naming import group_name

S = IntervalSettings(initial_s=300, min_s=60, max_s=1800, beta=0.1)
EST = IntervalMetrics(slo_attainment=0.9, norm_latency=2.0)


def test_first_interval_is_initial():
    assert next_replacement_interval(None, None, None, S) == 300


def test_stationary_traffic_grows_by_one_plus_beta_up_to_max():
    i = 300.0
    seen = []
    for _ in range(40):
        i = next_replacement_interval(i, EST, IntervalMetrics(0.91, 2.05), S)
        seen.append(i)
    assert seen[0] == pytest.approx(330)
    assert seen[1] == pytest.approx(363)
    assert seen[-1] == 1800


def test_large_error_shrinks_by_one_minus_beta_down_to_min():
    i = next_replacement_interval(300, EST, IntervalMetrics(0.5, 2.0), S)
    assert i == pytest.approx(270)
    # the larger of the two relative errors decides: L_N off by 50 %
    assert next_replacement_interval(300, EST, IntervalMetrics(0.9, 3.0), S) == pytest.approx(270)
    for _ in range(50):
        i = next_replacement_interval(i, EST, IntervalMetrics(0.2, 9.0), S)
    assert i == 60


def test_equal_error_keeps_interval_and_missing_measure_keeps_it():
    assert next_replacement_interval(300, IntervalMetrics(1.0, 2.0), IntervalMetrics(0.9, 2.0), S) == 300
    assert next_replacement_interval(300, EST, None, S) == 300


def test_settings_validated():
    with pytest.raises(ValueError, match="min <= initial <= max"):
        IntervalSettings(initial_s=10, min_s=60)
    with pytest.raises(ValueError, match="beta"):
        IntervalSettings(beta=1.5)


def _g(services, tp, n):
    return GroupPlan(group_name(tuple(services), tp), tuple(services), tp, RoleCounts(interactive=n))


def test_rollout_keeps_groups_that_stay():
    old = PlacementPlan("seallm", (_g(["a", "b"], 1, 2), _g(["c"], 2, 1), _g(["d"], 1, 1)))
    new = PlacementPlan("seallm", (_g(["a", "b"], 1, 3), _g(["c"], 2, 1), _g(["d", "e"], 1, 1)))
    diff = rollout_diff(old, new)
    assert set(diff.keep) == {_g(["a", "b"], 1, 0).name, _g(["c"], 2, 0).name}
    assert diff.scaled == ((_g(["a", "b"], 1, 0).name, 2, 3),)
    assert [g.name for g in diff.create] == [_g(["d", "e"], 1, 0).name]
    assert diff.delete == (_g(["d"], 1, 0).name,)
    assert diff.moved_services == ("d", "e")
    assert rollout_diff(new, new).unchanged


def test_group_names_are_stable_and_dns_safe():
    a = group_name(("Chat_Llama", "code"), 2)
    assert a == group_name(("code", "Chat_Llama"), 2)
    assert a != group_name(("code", "Chat_Llama"), 4)
    assert len(group_name(tuple(f"service-{i}" for i in range(20)), 1)) <= 40
    assert all(c.isalnum() or c == "-" for c in a) and a == a.lower()


def test_a_load_shift_must_pass_the_threshold_and_the_poisson_noise() -> None:
    from tessera.core.planners.replacement import shifted_loads

    planned = {"busy": 4.0, "quiet": 0.02, "new": 0.0, "unmeasured": 1.0}
    # Over 30 s: busy doubled, quiet saw 3 requests where 0.6 were expected (5x, but within noise),
    # new got 10 requests where none was planned.
    measured = {"busy": (240.0, 30.0), "quiet": (3.0, 30.0), "new": (10.0, 30.0)}
    assert shifted_loads(planned, measured, 0.5) == {"busy": (4.0, 8.0), "new": (0.0, 10 / 30)}
    # Within the threshold (+25 %), however many requests: no shift.
    assert shifted_loads({"busy": 4.0}, {"busy": (150.0, 30.0)}, 0.5) == {}
    # Down as well as up; a threshold of 0 turns the watch off.
    assert shifted_loads({"busy": 4.0}, {"busy": (30.0, 30.0)}, 0.5) == {"busy": (4.0, 1.0)}
    assert shifted_loads(planned, measured, 0.0) == {}
