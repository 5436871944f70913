"""Andes QoE (spec §B.3) against hand-computed timelines and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tessera.core import Phase, Request, ServiceClass, TokenTimeline
from tessera.core.qoe import (
    ConsumptionTracker,
    QoEParams,
    consumption_times,
    gains,
    horizon_qoe_from_delivery,
    qoe_at,
    qoe_from_delivery,
    request_gain,
    request_qoe,
    ttft_target_s,
)

R = 4.8
PARAMS = QoEParams(arrival=0.0, ttft_target_s=1.0, reading_speed_tps=R)
IDEAL = 1.0 + np.arange(100) / R  # I_i for n = 100


def make_request(delivery: np.ndarray, prompt: int = 100, finished: bool = True) -> Request:
    cls = ServiceClass(reading_speed_tps=R, ttft_target_s=1.0)
    req = Request("r", 0.0, prompt, 10_000, service_class=cls)
    for t in delivery:
        req.tokens.append(float(t))
    if finished:
        req.phase = Phase.FINISHED
    return req


# The spec's closed-form table (§B.3; r = 4.8, T* = 1 s, n = 100).
@pytest.mark.parametrize(
    ("delivery", "expected"),
    [
        (IDEAL, 1.0),
        (0.5 + 0.02 * np.arange(100), 1.0),  # all early: faster delivery adds nothing
        (IDEAL + 5.0, 1 - 500 / 1531.25),  # first token 5 s late, then on pace
        (1.0 + 2 * np.arange(100) / R, 1 - 1031.25 / 3093.75),  # half speed
        (np.where(np.arange(100) >= 50, IDEAL + 10.0, IDEAL), 0.7538),  # 10 s pause after token 50
    ],
)
def test_spec_table_values(delivery: np.ndarray, expected: float) -> None:
    assert qoe_from_delivery(delivery, PARAMS) == pytest.approx(expected, abs=1e-4)
    assert request_qoe(make_request(delivery)) == pytest.approx(expected, abs=1e-4)


def test_half_speed_tends_to_one_over_two_minus_f() -> None:
    # at speed fraction f the QoE tends to 1/(2-f) for long responses (spec §B.3)
    for f in (0.25, 0.5, 0.8):
        delivery = 1.0 + np.arange(20_000) / (f * R)
        assert qoe_from_delivery(delivery, PARAMS) == pytest.approx(1 / (2 - f), abs=2e-3)


def test_hand_computed_three_tokens() -> None:
    # r = 1 tok/s, T* = 1, arrival 0: ideal 1, 2, 3. Delivered at 2, 2, 6.
    # consumption: 2, 3, 6 -> delays 1, 1, 3 -> S_delay 5; S_whole = (6-1)+(6-2)+(6-3) = 12.
    params = QoEParams(0.0, 1.0, 1.0)
    assert qoe_from_delivery(np.array([2.0, 2.0, 6.0]), params) == pytest.approx(1 - 5 / 12)


def test_first_token_shown_on_arrival_even_if_early() -> None:
    # token 1 at 0.2 (early), token 2 at 0.3: consumed at 0.2 and 1.2 (pacer), both before ideal
    params = QoEParams(0.0, 1.0, 1.0)
    assert consumption_times(np.array([0.2, 0.3]), 1.0).tolist() == pytest.approx([0.2, 1.2])
    assert qoe_from_delivery(np.array([0.2, 0.3]), params) == 1.0


def test_no_tokens_is_zero_and_ttft_default() -> None:
    assert qoe_from_delivery(np.empty(0), PARAMS) == 0.0
    assert ttft_target_s(2_000) == 1.0
    assert ttft_target_s(20_000) == pytest.approx(4.0)
    assert ttft_target_s(20_000, 1.3) == 1.3
    req = Request("r", 2.0, 25_000, 10)
    req.tokens.append(6.0)  # T* = 5 s: the first token at arrival + 4 s is on time
    assert request_qoe(req) == 1.0


def test_bad_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="reading speed"):
        QoEParams(0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="TTFT target"):
        QoEParams(0.0, -1.0, 1.0)


def test_qoe_from_runs_matches_per_token_times() -> None:
    # runs with growing spacing, as the simulator records them
    tl = TokenTimeline()
    tl.append_run(3.0, 40, 0.05, 0.001)
    tl.append_run(12.0, 60, 0.1, 0.0)
    req = make_request(np.empty(0))
    req.tokens = tl
    assert request_qoe(req) == pytest.approx(qoe_from_delivery(tl.times(), PARAMS))
    assert 0.0 < request_qoe(req) < 1.0


def random_delivery(rng: np.random.Generator, n: int) -> np.ndarray:
    gaps = rng.exponential(rng.uniform(0.05, 0.6), n)
    gaps[rng.random(n) < 0.05] += rng.uniform(1, 10)  # occasional pauses
    return rng.uniform(0, 6) + np.cumsum(gaps)


def test_bounds_and_monotone_in_every_delivery_time() -> None:
    # Spec Q1 says QoE never rises when a D_i grows. That holds at a fixed horizon and whenever
    # A_n stays put; Eq. 2's S_whole grows with A_n, so the final QoE is not monotone (see below).
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        d = random_delivery(rng, n)
        q = qoe_from_delivery(d, PARAMS)
        assert 0.0 <= q <= 1.0
        i = int(rng.integers(n))
        later = d.copy()
        later[i:] = np.maximum(later[i:], later[i] + rng.uniform(0, 3))  # delay token i (order kept)
        tau = float(consumption_times(later, R)[-1]) + 1.0
        assert (
            horizon_qoe_from_delivery(later, PARAMS, tau) <= horizon_qoe_from_delivery(d, PARAMS, tau) + 1e-12
        )
        if consumption_times(later, R)[-1] == consumption_times(d, R)[-1]:
            assert qoe_from_delivery(later, PARAMS) <= q + 1e-12


def test_final_qoe_can_rise_when_the_last_token_is_later() -> None:
    # r = 1, T* = 1: tokens at 5, 6 -> S_delay 8, S_whole 9, QoE 1/9; the second token at 100
    # instead -> S_delay 102, S_whole 197, QoE 95/197. A property of Eq. 1-3, not a bug here.
    params = QoEParams(0.0, 1.0, 1.0)
    assert qoe_from_delivery(np.array([5.0, 6.0]), params) == pytest.approx(1 / 9)
    assert qoe_from_delivery(np.array([5.0, 100.0]), params) == pytest.approx(95 / 197)


def test_horizon_qoe_at_last_consumption_equals_final() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        d = random_delivery(rng, int(rng.integers(1, 80)))
        last = float(consumption_times(d, R)[-1])
        final = qoe_from_delivery(d, PARAMS)
        assert horizon_qoe_from_delivery(d, PARAMS, last, final_tokens=d.size) == pytest.approx(final)


def test_horizon_qoe_of_waiting_request() -> None:
    # nothing delivered: 1 before T*, 0 once a token is due
    assert horizon_qoe_from_delivery(np.empty(0), PARAMS, 0.9) == 1.0
    assert horizon_qoe_from_delivery(np.empty(0), PARAMS, 3.0) == 0.0
    req = make_request(IDEAL[:10], finished=False)
    assert qoe_at(req, float(IDEAL[9])) == 1.0
    assert 0.0 < qoe_at(req, float(IDEAL[9]) + 5.0) < 1.0


def test_tracker_matches_consumption_times_incrementally() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        r = float(rng.uniform(2, 8))
        tl, tracker, t = TokenTimeline(), ConsumptionTracker(r), float(rng.uniform(0, 5))
        for _ in range(int(rng.integers(1, 8))):
            count = int(rng.integers(1, 30))
            iv = float(rng.uniform(0.0, 0.5))
            growth = float(rng.uniform(-iv / max(count, 2), 0.01))  # growing or shrinking spacing
            tl.append_run(t, count, iv, growth)
            t = tl.last_time() + float(rng.exponential(1.0))
            if rng.random() < 0.6:
                tracker.update(tl)
        tracker.update(tl)
        assert tracker.tokens == tl.total
        assert tracker.last_consumption == pytest.approx(consumption_times(tl.times(), r)[-1])


def spec_gain_loop(d: np.ndarray, p: QoEParams, t: float, horizon: float, g: float, delay: float) -> float:
    """The spec's reference ``gain`` procedure (§B.5), token by token."""
    tau, r = t + horizon, p.reading_speed_tps
    m = 0 if tau < p.ideal_start else math.floor((tau - p.ideal_start) * r) + 1
    n = d.size
    if m <= n:
        return 0.0
    sw = m * (tau - p.ideal_start) - m * (m - 1) / (2 * r)
    k_max = math.floor((horizon - delay) / g) if horizon > delay else 0
    ds, c_prev = 0.0, (float(consumption_times(d, r)[-1]) if n else None)
    for k in range(1, min(k_max, m - n) + 1):
        j, dk = n + k, t + delay + k * g
        c = dk if c_prev is None else max(dk, c_prev + 1 / r)
        ideal = p.ideal_time(j)
        ds += (tau - ideal) - max(0.0, min(c, tau) - ideal)
        c_prev = c
    return ds / sw


def test_gain_equals_spec_loop_and_brute_force_serve_minus_wait() -> None:
    rng = np.random.default_rng(4)
    for case in range(3000):
        r = float(rng.choice([3.3, 4.8, 7.0]))
        p = QoEParams(0.0, float(rng.uniform(0.5, 3)), r)
        d = random_delivery(rng, int(rng.integers(0, 40)))
        t = (float(d[-1]) if d.size else 0.0) + float(rng.uniform(0, 8))
        horizon, g = float(rng.uniform(0.5, 20)), float(rng.uniform(0.01, 0.8))
        delay = float(rng.uniform(0, 1.5)) if case % 3 == 0 else 0.0
        last = consumption_times(d, r)[-1] if d.size else -math.inf
        fast = gains(t, horizon, g, np.array([p.ideal_start]), np.array([r]), np.array([d.size]),
                     np.array([last]), delay)[0]  # fmt: skip
        assert fast == pytest.approx(spec_gain_loop(d, p, t, horizon, g, delay), abs=1e-9)
        # brute force: QoE(tau) when served minus QoE(tau) when not
        tau = t + horizon
        k = max(0, math.floor((horizon - delay) / g)) if horizon > delay else 0
        served = np.concatenate([d, t + delay + g * np.arange(1, k + 1)])
        brute = horizon_qoe_from_delivery(served, p, tau) - horizon_qoe_from_delivery(d, p, tau)
        assert fast == pytest.approx(brute, abs=1e-9)


def test_gain_is_zero_when_buffer_covers_horizon_and_broadcasts_over_batch_sizes() -> None:
    req = make_request(0.5 + 0.01 * np.arange(200), finished=False)  # 200 tokens buffered early
    assert request_gain(req, 3.0, 10.0, 0.05) == 0.0  # 200 tokens cover 41 s of reading
    waiting = make_request(np.empty(0), finished=False)
    g = np.array([[0.02], [0.1], [0.5]])  # one row per batch size
    out = gains(5.0, 10.0, g, np.array([1.0, 1.0]), np.array([R, R]), np.array([0, 200]),
                np.array([-math.inf, 0.5 + 199 / R]))  # fmt: skip
    assert out.shape == (3, 2)
    assert out[0, 0] > out[1, 0] > out[2, 0] > 0.0  # slower generation, smaller gain
    assert np.all(out[:, 1] == 0.0)
    assert request_gain(waiting, 5.0, 10.0, 0.02) == pytest.approx(out[0, 0])
