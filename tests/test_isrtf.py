"""ISRTF on hand-built queues: batched prediction at window boundaries, ordering, preemption, aging,
the tail guard and its default, and the wait-bounded variant isrtf-tail."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tessera.core import InstanceView, Phase, Request, StepProfile
from tessera.core.policies.isrtf import ISRTF, TailISRTF
from tessera.core.registry import make_policy
from tessera.predictor import ConstantPredictor, RunningMeanPredictor

PROFILE = StepProfile("t", 0.01, 0.0, 0.0, 0.01, 0.0, kv_capacity_tokens=100_000)


class TableOracle:
    """Test predictor: remaining = a per-request table value minus tokens generated; records calls."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.calls: list[list[tuple[str, int]]] = []

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        self.calls.append([(r.id, r.generated) for r in requests])
        return [self.totals[r.id] - r.generated for r in requests]


def view(
    running: list[Request], now: float = 10.0, max_batch: int = 1, profile: StepProfile = PROFILE
) -> InstanceView:
    return InstanceView(now, "i0", running, max_batch, profile.kv_capacity_tokens, 0, profile)


def req(rid: str, arrival: float) -> Request:
    return Request(rid, arrival, 10, 10_000)


def run_ids(pol: ISRTF, running: list[Request], **kw: Any) -> list[str]:
    decision = pol.schedule(view(running, **kw))
    for r in decision.run:
        r.phase = Phase.RUNNING
    return [r.id for r in decision.run]


def test_orders_by_predicted_remaining_with_one_batched_prediction() -> None:
    oracle = TableOracle({"a": 300, "b": 40, "c": 120})
    pol = ISRTF(guard_credit=0.0, predictor=oracle)
    for i, rid in enumerate("abc"):
        pol.add(req(rid, float(i)), float(i))
    assert oracle.calls == []  # nothing predicted before a decision
    assert run_ids(pol, [], max_batch=2) == ["b", "c"]
    assert len(oracle.calls) == 1 and sorted(r for r, _ in oracle.calls[0]) == ["a", "b", "c"]
    assert len(pol) == 3


def test_ties_go_to_earlier_arrival() -> None:
    pol = ISRTF(guard_credit=0.0, predictor=ConstantPredictor(100))
    late, early = req("late", 5.0), req("early", 1.0)
    pol.add(late, 5.0)
    pol.add(early, 5.0)
    assert run_ids(pol, []) == ["early"]


def test_repredicts_only_at_the_configured_step() -> None:
    oracle = TableOracle({"x": 500})
    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=20)
    x = req("x", 0.0)
    pol.add(x, 0.0)
    decision = pol.schedule(view([]))
    x.phase = Phase.RUNNING
    assert decision.recheck_after_tokens == 20
    x.generated = 7  # an event mid-window (e.g. an arrival elsewhere): no re-prediction
    decision = pol.schedule(view([x]))
    assert len(oracle.calls) == 1
    assert decision.recheck_after_tokens == 13  # the engine re-checks exactly at the boundary
    x.generated = 20
    pol.schedule(view([x]))
    assert oracle.calls[-1] == [("x", 20)] and len(oracle.calls) == 2
    assert x.predicted_remaining == 480


def test_preempts_at_window_boundary_not_mid_window() -> None:
    oracle = TableOracle({"long": 400, "short": 30})
    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=50)
    long = req("long", 0.0)
    pol.add(long, 0.0)
    assert run_ids(pol, []) == ["long"]
    long.generated = 10
    pol.add(req("short", 1.0), 1.0)
    # mid-window arrival: the running window is never interrupted
    assert run_ids(pol, [long], now=1.0) == ["long"]
    long.generated = 50
    # boundary: 350 predicted remaining loses to 30
    assert run_ids(pol, [long], now=2.0) == ["short"]


def test_running_request_keeps_slot_when_still_shortest() -> None:
    oracle = TableOracle({"a": 60, "b": 500})
    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=50)
    a, b = req("a", 0.0), req("b", 0.0)
    pol.add(a, 0.0)
    pol.add(b, 0.0)
    assert run_ids(pol, []) == ["a"]
    a.generated = 50
    assert run_ids(pol, [a]) == ["a"]  # 10 remaining beats 500


def test_aging_guard_lets_an_old_long_request_win() -> None:
    oracle = TableOracle({"old": 1000, "new": 100})
    plain = ISRTF(aging_tokens_per_s=0.0, guard_credit=0.0, predictor=oracle)
    aged = ISRTF(predictor=oracle, aging_tokens_per_s=10.0, guard_credit=0.0)
    for pol in (plain, aged):
        pol.add(req("old", 0.0), 0.0)
        pol.add(req("new", 200.0), 200.0)
    assert run_ids(plain, [], now=200.0) == ["new"]
    # old waited 200 s: 1000 - 10*200 < 100 - 0
    assert run_ids(aged, [], now=200.0) == ["old"]


def test_running_mean_fallback_learns_from_finished_requests() -> None:
    pred = RunningMeanPredictor(prior=100, prior_weight=1)
    pol = ISRTF(guard_credit=0.0, predictor=pred)
    done = req("done", 0.0)
    pol.add(done, 0.0)
    pol.schedule(view([]))
    done.generated, done.phase = 301, Phase.FINISHED
    pol.remove(done, 5.0)
    fresh = req("fresh", 6.0)
    pol.add(fresh, 6.0)
    pol.schedule(view([]))  # a finished request reaches the predictor at the next prediction
    assert pred.mean("default") == pytest.approx(200.5)
    assert fresh.predicted_remaining == pytest.approx(200.5)
    fresh.generated = 50
    assert pred.predict_remaining([fresh]) == [pytest.approx(150.5)]


def test_predicting_ahead_then_scheduling_predicts_once_and_still_preempts_at_the_boundary() -> None:
    """The worker's path: predictions_due + predict (on a thread), then schedule."""
    oracle = TableOracle({"long": 500, "short": 60})
    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=50)
    long = req("long", 0.0)
    pol.add(long, 0.0)
    assert pol.predictions_due([]) == [long]
    pol.predict(pol.predictions_due([]))
    assert run_ids(pol, []) == ["long"]
    assert len(oracle.calls) == 1  # schedule did not predict again
    short = req("short", 1.0)
    pol.add(short, 1.0)
    assert run_ids(pol, [long]) == ["long"]  # mid-window: the newcomer only fills free slots
    long.generated = 50  # window boundary: predicted ahead (450 left), then re-ranked: short wins
    due = pol.predictions_due([long])
    assert due == [long]
    taken_at = long.generated
    pol.predict(due)
    long.generated = 53  # tokens streamed while the prediction ran on its thread
    assert run_ids(pol, [long]) == ["short"]
    assert len(oracle.calls) == 3  # arrival of short (in schedule), long ahead; nothing else
    assert long.annotations["isrtf_predicted_at"] == taken_at  # next window counts from the input


def test_registry_and_validation() -> None:
    pol = make_policy("isrtf", predictor="constant", window_tokens=10)
    assert isinstance(pol, ISRTF) and pol.window == 10
    with pytest.raises(ValueError, match="window_tokens"):
        make_policy("isrtf", predictor="constant", window_tokens=0)
    with pytest.raises(ValueError, match="unknown predictor"):
        ISRTF(predictor="magic")
    with pytest.raises(ValueError, match="predict_remaining"):
        ISRTF(predictor=object())  # type: ignore[arg-type]


def test_tail_guard_is_on_by_default_in_the_class_and_the_settings() -> None:
    from tessera.core.policies.isrtf import DEFAULT_GUARD_AFTER_JCT_MULTIPLE, DEFAULT_GUARD_CREDIT
    from tessera.core.registry import settings_model

    assert DEFAULT_GUARD_CREDIT > 0
    pol = ISRTF(predictor="constant")
    assert (pol.guard_credit, pol.guard_after, pol.aging) == (
        DEFAULT_GUARD_CREDIT, DEFAULT_GUARD_AFTER_JCT_MULTIPLE, 0.0
    )  # fmt: skip
    assert make_policy("isrtf", predictor="constant").guard_credit == DEFAULT_GUARD_CREDIT  # type: ignore[attr-defined]
    fields = settings_model("isrtf").model_fields
    assert fields["guard_credit"].default == DEFAULT_GUARD_CREDIT
    assert fields["guard_after_jct_multiple"].default == DEFAULT_GUARD_AFTER_JCT_MULTIPLE
    assert fields["aging_tokens_per_s"].default == 0.0
    assert make_policy("isrtf", predictor="constant", guard_credit=0.0).guard_credit == 0.0  # type: ignore[attr-defined]
    for bad in ({"guard_credit": -0.1}, {"guard_credit": 11.0}, {"guard_after_jct_multiple": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_policy("isrtf", predictor="constant", **bad)
    with pytest.raises(ValueError, match="guard_credit"):
        ISRTF(predictor="constant", guard_credit=-1.0)


def test_tail_guard_credits_only_requests_past_the_wait_at_the_decode_rate() -> None:
    """Before its wait a request keeps its plain key; past it, the credit grows by guard_credit x the
    decode rate (max_batch / decode step) tokens' worth of service per second since it crossed, and it
    overtakes a shorter one. Keys are seconds of service: here 0.01 s a token, the first from the prefill."""
    oracle = TableOracle({"done": 10, "long": 300, "short": 100, "later": 100})
    profile = StepProfile("flat", 0.01, 0.0, 0.0, 0.01, 0.0, kv_capacity_tokens=100_000)  # 100 tokens/s
    pol = ISRTF(predictor=oracle, guard_credit=0.5, guard_after_jct_multiple=2.0)
    done = req("done", 0.0)
    pol.add(done, 0.0)
    assert run_ids(pol, [], now=0.0, profile=profile) == ["done"]
    finish(pol, done, 5.0)  # recent mean JCT 5 s: the credit starts after 10 s of waiting
    long, short = req("long", 5.0), req("short", 14.0)
    pol.add(long, 5.0)
    pol.add(short, 14.0)
    assert run_ids(pol, [], now=14.0, profile=profile) == ["short"]  # long waited 9 s: no credit yet
    assert pol.key(long, 14.0)[0] == pytest.approx(3.0)  # 300 tokens
    finish(pol, short, 14.5)
    pol.add(later := req("later", 16.0), 16.0)
    # long crossed at 5 + 2 x 4.93 s (the mean moved 1/64 of the way to short's 0.5 s): at 16 s it has
    # 1.14 s of credit at 0.5 x 100 tokens/s = 57 tokens: 243 > 100, later still goes first
    assert run_ids(pol, [], now=16.0, profile=profile) == ["later"]
    crossed = 5.0 + 2.0 * pol.mean_jct  # type: ignore[operator]
    assert pol.key(long, 16.0)[0] == pytest.approx(0.01 * (300 - 50.0 * (16.0 - crossed)))
    finish(pol, later, 17.0)
    pol.add(again := req("again", 20.0), 20.0)
    oracle.totals["again"] = 100
    # at 20 s: 5.14 s of credit (257 tokens): 43 < 100, the old long request overtakes
    assert run_ids(pol, [], now=20.0, profile=profile) == ["long"]
    assert pol.key(again, 20.0)[0] == pytest.approx(1.0)  # a new request has no credit: 100 tokens


def test_tail_guard_off_keeps_the_plain_order() -> None:
    oracle = TableOracle({"done": 10, "long": 300, "short": 100})
    pol = ISRTF(predictor=oracle, guard_credit=0.0)
    done = req("done", 0.0)
    pol.add(done, 0.0)
    run_ids(pol, [], now=0.0)
    finish(pol, done, 1.0)
    pol.add(long := req("long", 1.0), 1.0)
    pol.add(req("short", 900.0), 900.0)
    assert run_ids(pol, [], now=900.0) == ["short"]  # waited 900 mean JCTs: still behind
    assert pol.key(long, 900.0)[0] == pytest.approx(3.0)  # 300 tokens at 0.01 s


def finish(pol: ISRTF, r: Request, now: float) -> None:
    r.phase, r.finished_at = Phase.FINISHED, now
    pol.remove(r, now)


def test_isrtf_tail_promotes_requests_older_than_a_multiple_of_the_recent_mean_jct() -> None:
    oracle = TableOracle({"done": 10, "long": 1000, "s1": 100, "s2": 100})
    pol = TailISRTF(predictor=oracle, max_wait_jct_multiple=2.0)
    assert (pol.aging, pol.guard_credit) == (0.0, 0.0)  # the wait bound guards instead
    done = req("done", 0.0)
    pol.add(done, 0.0)
    assert run_ids(pol, [], now=0.0) == ["done"]
    finish(pol, done, 5.0)  # recent mean JCT 5 s: the bound is 10 s of waiting
    assert pol.mean_jct == 5.0
    long, s1 = req("long", 5.0), req("s1", 6.0)
    pol.add(long, 5.0)
    pol.add(s1, 6.0)
    assert run_ids(pol, [], now=6.0) == ["s1"]  # shortest first while nobody waited 10 s
    finish(pol, s1, 8.0)  # JCT 2 s: the mean moves by 1/64 of the difference
    s2 = req("s2", 14.0)
    pol.add(s2, 14.0)
    assert run_ids(pol, [], now=14.0) == ["s2"]  # long waited 9 s < 2 x 4.95 s
    finish(pol, s2, 15.0)
    pol.add(s3 := req("s3", 16.0), 16.0)
    oracle.totals["s3"] = 100
    assert run_ids(pol, [], now=16.0) == ["long"]  # 11 s > 2 x mean JCT: promoted past the shorter s3
    assert pol.key(long, 16.0)[0] == 0 and pol.key(s3, 16.0)[0] == 1


def test_isrtf_tail_without_finished_requests_keeps_the_plain_order_and_is_registered() -> None:
    oracle = TableOracle({"old": 1000, "new": 100})
    assert isinstance(make_policy("isrtf-tail", predictor="constant"), TailISRTF)
    pol = TailISRTF(predictor=oracle, max_wait_jct_multiple=1.0)
    pol.add(req("old", 0.0), 0.0)
    pol.add(req("new", 500.0), 500.0)
    assert run_ids(pol, [], now=500.0) == ["new"]  # no JCT observed yet: no bound to promote by
    with pytest.raises(ValueError, match="max_wait_jct_multiple"):
        make_policy("isrtf-tail", predictor="constant", max_wait_jct_multiple=0.0)


def test_orders_by_predicted_service_time_so_long_prompts_wait_for_shorter_work() -> None:
    """A 30,000-token prompt with 10 tokens to answer is 2.6 s of work on the 8B profile; 200 tokens
    after a 100-token prompt 1.6 s: the short answer to the long prompt goes second, and at a window
    boundary it does not displace a running request that holds its KV and has 200 tokens left."""
    from tessera.core.profiles import load_profile

    profile = load_profile("a100-llama3-8b")
    oracle = TableOracle({"prompt": 10, "answer": 200, "running": 250})
    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=50)
    prompt, answer = Request("prompt", 0.0, 30_000, 1000), Request("answer", 1.0, 100, 1000)
    pol.add(prompt, 1.0)
    pol.add(answer, 1.0)
    assert run_ids(pol, [], now=1.0, profile=profile) == ["answer"]

    pol = ISRTF(guard_credit=0.0, predictor=oracle, window_tokens=50)
    running = Request("running", 0.0, 100, 1000)
    pol.add(running, 0.0)
    assert run_ids(pol, [], now=0.0, profile=profile) == ["running"]
    running.kv_resident, running.generated = True, 50  # at its window boundary: 200 left
    pol.add(Request("prompt", 5.0, 30_000, 1000), 5.0)
    assert run_ids(pol, [running], now=5.0, profile=profile) == ["running"]
