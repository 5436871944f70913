"""Online learning of the text predictor: settings bounds, the correction and its prior, refits (inline,
in the background, refused, failed), the worker's hook (``forget`` of a finished request), state kept
across a rebuilt predictor, and the prequential replay with its ranking report."""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from tessera.core import Request
from tessera.core.request import Phase
from tessera.predictor.evaluate import prequential, ranking_report
from tessera.predictor.features import N_SCALARS
from tessera.predictor.model import TextLengthPredictor
from tessera.predictor.online import (
    BLEND_GRID,
    FinishedRequest,
    Fitted,
    OnlineLearner,
    OnlineSettings,
    SampleTables,
    blend_scores,
    blend_weight,
    fit_correction,
    shared_learner,
    validated_fit,
    within_step_tau,
)

DIM = 8
NO_LATER = np.zeros((0, 2 + N_SCALARS), np.float32)


def records(n: int, seed: int = 0, emb_scale: float = 1.0) -> list[FinishedRequest]:
    """Finished requests whose length follows the first embedding coordinate; the head predicts 100."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        emb = rng.normal(size=DIM).astype(np.float32) * emb_scale
        length = int(np.clip(np.exp(4.0 + 0.8 * emb[0] + 0.1 * rng.normal()), 1, 2000))
        out.append(FinishedRequest(emb, 100.0, np.zeros(N_SCALARS, np.float32), length, False, NO_LATER))
    return out


def arrays(recs: list[FinishedRequest]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    head = np.array([r.head_prediction for r in recs])
    scalars = np.stack([r.scalars for r in recs])
    prompts = np.stack([r.prompt_emb for r in recs])
    return head, scalars, prompts, np.array([r.length for r in recs])


@pytest.mark.parametrize(
    ("field", "value"),
    [("refit_every", 0), ("refit_seconds", float("nan")), ("sample_size", 10), ("prior_weight", 0.0),
     ("holdout_fraction", 0.9), ("min_samples", 5), ("blend_folds", 1), ("memory_bandwidth", -1.0)],
)  # fmt: skip
def test_settings_out_of_bounds_are_refused_naming_them(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"online {field} must be in"):
        OnlineSettings(**{field: value})
    with pytest.raises(ValueError, match="online arrival_blend must be one of"):
        OnlineSettings(arrival_blend="half")
    with pytest.raises(ValueError, match=r"min_samples .* must be <= sample_size"):
        OnlineSettings(min_samples=500, sample_size=100)


def test_the_correction_learns_the_ranking_and_its_prior_is_the_head() -> None:
    train, test = records(400), records(200, seed=1)
    head, scalars, prompts, length = arrays(test)
    arrival = np.zeros(len(head), dtype=int)
    learner = OnlineLearner(OnlineSettings(background=False))
    assert np.array_equal(learner.adjust(head, scalars, prompts, arrival), head)  # nothing learnt: the head's
    learner.fitted = Fitted(fit_correction(SampleTables.of(train), 10.0, 10.0), None)
    tau = kendalltau(learner.adjust(head, scalars, prompts, arrival), length).statistic
    assert tau > 0.7  # the head alone (a constant) ranks nothing
    # later positions are the calibration's, none here: the head's at the arrival correction's scale,
    # so that the bias alone moves no queued request against a running one
    bias = learner.fitted.arrival.bias
    got = learner.adjust(head, scalars, prompts, arrival + 50)
    assert bias < -0.3 and np.allclose(np.log1p(got), np.log1p(head) + bias)
    # an overwhelming prior keeps the head's predictions
    learner.fitted = Fitted(fit_correction(SampleTables.of(train), 1e6, 1e6), None)
    assert np.allclose(learner.adjust(head, scalars, prompts, arrival), head, rtol=0.02)


def test_the_later_calibration_rescales_a_head_that_overpredicts_running_requests() -> None:
    # the head predicts 4x the true remaining length at every later position: ranking within a step is
    # right, but a running request looks longer than a queued one of the same length
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(300):
        length = int(rng.integers(60, 500))
        later = np.array(
            [[g, 4.0 * (length - g)] + [0.0] * N_SCALARS for g in range(50, length, 50)], np.float32
        )
        recs.append(FinishedRequest(rng.normal(size=DIM).astype(np.float32), float(length),
                                    np.zeros(N_SCALARS, np.float32), length, False, later))  # fmt: skip
    learner = OnlineLearner(
        OnlineSettings(refit_every=300, min_samples=300, sample_size=300, background=False)
    )
    for rec in recs:
        learner.record(rec)
    assert learner.fitted is not None and learner.fitted.later is not None and learner.refits == 1
    later = recs[0].later
    got = learner.adjust(later[:, 1], later[:, 2:], np.zeros((len(later), DIM)), later[:, 0])
    assert np.allclose(got, recs[0].length - later[:, 0], rtol=0.15)  # not 4x: the prior shrinks a little


def test_refits_every_n_finished_requests_after_min_samples_inline() -> None:
    learner = OnlineLearner(OnlineSettings(refit_every=50, min_samples=100, background=False))
    for rec in records(99):
        learner.record(rec)
    assert learner.fitted is None and learner.refits == 0  # below min_samples: the head alone
    for rec in records(101, seed=2):
        learner.record(rec)
    assert learner.refits + learner.rejected == 3 and learner.refits >= 1  # at 100, 150 and 200
    assert learner.fitted is not None and learner.failed == 0
    assert len(learner.refit_seconds) == 3 and learner.stats()["seen"] == 200


def test_refits_after_refit_seconds_on_its_clock() -> None:
    now = [0.0]
    learner = OnlineLearner(
        OnlineSettings(refit_every=1000, refit_seconds=60, min_samples=20, background=False), lambda: now[0]
    )
    for rec in records(30):
        learner.record(rec)
    assert len(learner.refit_seconds) == 0
    now[0] = 61.0
    learner.record(records(1, seed=3)[0])
    assert len(learner.refit_seconds) == 1


def test_a_refit_that_cannot_rank_better_than_the_head_keeps_its_order_at_the_samples_scale() -> None:
    # the head ranks every answer exactly, at twice its length: no correction can rank better, and
    # the learnt bias still puts the predictions on the answers' scale
    rng = np.random.default_rng(5)
    recs = []
    for _ in range(250):
        length = int(rng.integers(1, 500))
        recs.append(FinishedRequest(rng.normal(size=DIM).astype(np.float32), 2.0 * length,
                                    np.zeros(N_SCALARS, np.float32), length, False, NO_LATER))  # fmt: skip
    learner = OnlineLearner(
        OnlineSettings(refit_every=250, min_samples=250, sample_size=250, background=False)
    )
    for rec in recs:
        learner.record(rec)
    assert learner.rejected == 1 and learner.refits == 0 and learner.stats()["blend_weight_last"] == 0.0
    assert learner.fitted is not None and learner.fitted.arrival is not None
    head, scalars, prompts, length = arrays(records(100, seed=9))
    head = head * np.exp(np.random.default_rng(1).normal(size=len(head)))  # a head that varies
    got = learner.adjust(head, scalars, prompts, np.zeros(len(head), dtype=int))
    assert kendalltau(got, head).statistic == pytest.approx(1.0)  # the head's order
    assert np.median(got / head) == pytest.approx(0.5, rel=0.1)  # the sample's scale


def test_the_validated_blend_ranks_the_sample_at_least_as_well_as_the_head() -> None:
    # lengths follow the embedding and the head ranks nothing: the correction's order is kept (with a
    # constant head every weight above 0 gives that order)
    assert blend_weight(SampleTables.of(records(300)), OnlineSettings()) > 0
    # lengths follow neither: whatever weight is chosen scores at least the head's order (weight 0)
    rng = np.random.default_rng(3)
    noise = [FinishedRequest(r.prompt_emb, float(r.length) * np.exp(rng.normal()), r.scalars,
                             int(rng.integers(1, 500)), False, NO_LATER) for r in records(300)]  # fmt: skip
    settings = OnlineSettings(arrival_prior_weight=0.01, embedding_prior_weight=1.0)
    scores = blend_scores(SampleTables.of(noise), settings)
    weight = blend_weight(SampleTables.of(noise), settings)
    assert scores[BLEND_GRID.index(weight)] == scores.max() >= scores[0]
    assert blend_weight(SampleTables.of(noise), replace(settings, arrival_blend="full")) == 1.0


def test_the_arrival_correction_reads_the_prompt_length() -> None:
    # the length follows the prompt length (an arrival scalar), the embedding is noise
    rng = np.random.default_rng(2)
    recs = []
    for _ in range(300):
        prompt = int(rng.integers(5, 2000))
        scalars = np.array([0, 0, np.log1p(prompt) / 8, 1, 1, 1], np.float32)
        length = int(np.exp(2.0 + 0.5 * np.log(prompt) + 0.2 * rng.normal()))
        recs.append(FinishedRequest(rng.normal(size=DIM).astype(np.float32), 100.0, scalars, length,
                                    False, NO_LATER))  # fmt: skip
    learner = OnlineLearner(OnlineSettings(background=False))
    learner.fitted = validated_fit(SampleTables.of(recs[:200]), learner.settings)
    head, scalars, prompts, length = arrays(recs[200:])
    got = learner.adjust(head, scalars, prompts, np.zeros(len(head), dtype=int))
    assert kendalltau(got, length).statistic > 0.6


def test_the_prompt_memory_learns_repeated_prompts_the_linear_part_cannot() -> None:
    # 60 prompts, each asked 6 times, each with its own typical length unrelated to its embedding
    rng = np.random.default_rng(4)
    prompts = rng.normal(size=(60, DIM)).astype(np.float32)
    typical = np.exp(rng.uniform(2, 6, size=60))
    recs = [FinishedRequest(prompts[k], 100.0, np.zeros(N_SCALARS, np.float32),
                            int(typical[k] * np.exp(0.1 * rng.normal())), False, NO_LATER)
            for k in rng.integers(0, 60, size=360)]  # fmt: skip
    head, scalars, emb, length = arrays(recs[300:])
    arrival = np.zeros(len(head), dtype=int)
    taus = {}
    for bandwidth in (0.0, 0.02):
        learner = OnlineLearner(OnlineSettings(memory_bandwidth=bandwidth, background=False))
        learner.fitted = validated_fit(SampleTables.of(recs[:300]), learner.settings)
        taus[bandwidth] = kendalltau(learner.adjust(head, scalars, emb, arrival), length).statistic
    assert taus[0.02] > 0.8 > taus[0.0] + 0.2


def test_a_failed_refit_keeps_the_previous_correction_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    learner = OnlineLearner(OnlineSettings(refit_every=10, min_samples=100, background=False))
    for rec in records(100):
        learner.record(rec)
    good = learner.fitted
    assert good is not None and good.arrival is not None
    bad = records(10, seed=4)
    bad[0] = FinishedRequest(np.full(DIM, np.nan, np.float32), 100.0, bad[0].scalars, 10, False, NO_LATER)
    with caplog.at_level("WARNING"):
        for rec in bad:
            learner.record(rec)
    assert learner.failed == 1 and learner.fitted is good
    assert "keeping the previous head" in caplog.text


def test_a_background_refit_runs_in_another_process_and_never_blocks_record() -> None:
    learner = OnlineLearner(OnlineSettings(refit_every=10, min_samples=100))
    recs = records(150)
    for rec in recs[:99]:
        learner.record(rec)
    t0 = time.perf_counter()
    for rec in recs[99:]:  # the 100th starts a refit; those after it come while it runs
        learner.record(rec)
    assert time.perf_counter() - t0 < 0.2  # no record waited for the refit process to start or fit
    assert learner.wait(120)
    assert learner.refit_pids and learner.refit_pids[0] != os.getpid()
    assert learner.refits + learner.rejected == 1 and learner.failed == 0  # none started while one ran
    assert learner.fitted is not None and learner.fitted.arrival is not None  # the embedding ranks here
    assert learner.refit_cpu_seconds[0] > 0 and len(learner.snapshot_seconds) == 1
    # a refit that fails in its process keeps the installed correction, counted
    good = learner.fitted
    for rec in records(9, seed=7):
        learner.record(rec)
    learner.record(
        FinishedRequest(np.full(DIM, np.nan, np.float32), 100.0, recs[0].scalars, 10, False, NO_LATER)
    )
    assert learner.wait(120)
    assert learner.failed == 1 and learner.fitted is good
    learner.close()


def test_the_sample_keeps_the_newest_requests_oldest_first() -> None:
    learner = OnlineLearner(
        OnlineSettings(sample_size=20, min_samples=20, refit_every=10**6, background=False)
    )
    recs = records(45)
    for rec in recs:
        learner.record(rec)
    got = learner.sample()
    assert np.array_equal(got.length, [r.length for r in recs[-20:]])
    assert np.array_equal(got.prompt_emb, np.stack([r.prompt_emb for r in recs[-20:]]))
    with pytest.raises(ValueError, match="differ in size"):
        learner.record(
            FinishedRequest(np.zeros(DIM + 1, np.float32), 1.0, recs[0].scalars, 1, False, NO_LATER)
        )


def test_shared_learner_is_one_per_artifact_and_settings() -> None:
    a = shared_learner("/heads/x", OnlineSettings())
    assert shared_learner("/heads/x", OnlineSettings()) is a
    assert shared_learner("/heads/x", OnlineSettings(refit_every=7)) is not a
    assert shared_learner("/heads/y", OnlineSettings()) is not a


def test_within_step_tau_averages_steps_and_ties_count_as_zero() -> None:
    true = np.array([1, 2, 3, 4] * 5 + [9, 8, 7, 6] * 5, dtype=float)
    step = np.array([0] * 20 + [1] * 20)
    pred = true.copy()
    assert within_step_tau(pred, true, step) == pytest.approx(1.0)
    pred[20:] = 5.0  # step 1 ranks nothing
    assert within_step_tau(pred, true, step) == pytest.approx(0.5)
    assert np.isnan(within_step_tau(pred, true, step, min_n=100))
    report = ranking_report(pred, true, step)
    assert report["position_only"]["step0_tau"] == 0.0 and report["tau_by_step"]["0"] == pytest.approx(1.0)


# -- the text predictor ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_predictor() -> TextLengthPredictor:
    return TextLengthPredictor("smollm2", threads=1, online=None)


def _request(i: int, prompt: str, response: str, predictor: TextLengthPredictor) -> Request:
    req = Request(f"q{i}", 0.0, predictor.served.count(prompt), 512, prompt_text=prompt)
    req.response_text = response
    return req


def test_forget_of_a_finished_request_teaches_the_learner_and_an_unfinished_one_does_not(
    text_predictor: TextLengthPredictor,
) -> None:
    learner = OnlineLearner(OnlineSettings(min_samples=10, refit_every=1000, background=False))
    text_predictor.online = learner
    done = _request(0, "Name three colours.", "Red, green and blue.", text_predictor)
    dropped = _request(1, "Count to five.", "1 2 3 4 5", text_predictor)
    text_predictor.predict_remaining([done, dropped])
    done.generated, done.phase = 7, Phase.FINISHED
    text_predictor.forget(done)
    text_predictor.forget(dropped)  # removed unfinished (cancelled, say): nothing to learn
    assert learner.seen == 1
    got = learner.sample()
    assert len(got) == 1 and got.length[0] == 7 and not got.hit_max_tokens[0] and got.head[0] >= 0
    assert len(got.later) == 0
    never_predicted = _request(2, "Hi", "Hello", text_predictor)
    never_predicted.phase = Phase.FINISHED
    text_predictor.forget(never_predicted)
    assert learner.seen == 1 and text_predictor.unrecorded == 1


def test_a_rebuilt_predictor_keeps_the_shared_learner(tmp_path: Path) -> None:
    settings = OnlineSettings(refit_every=999, min_samples=11)  # a key no other test uses
    first = TextLengthPredictor("smollm2", threads=1, online=settings)
    req = _request(0, "Say hi.", "Hi!", first)
    first.predict_remaining([req])
    req.generated, req.phase = 2, Phase.FINISHED
    first.forget(req)
    rebuilt = TextLengthPredictor("smollm2", threads=1, online=settings)  # as a configuration reload does
    assert rebuilt.online is first.online and rebuilt.online is not None and rebuilt.online.seen == 1


def test_prequential_replay_reports_online_head_and_baselines(
    text_predictor: TextLengthPredictor, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        for _ in range(60):
            n = int(rng.integers(1, 40))
            fh.write(json.dumps({"prompt": f"Repeat the word 'ok' {n} times.", "response": " ok" * n}) + "\n")
    settings = OnlineSettings(refit_every=10, min_samples=20, prior_weight=5.0)
    got = prequential(text_predictor, path, settings, seed=1, passes=2, after=60)
    assert got["requests"] == 120 and got["rows"] == 60 and got["learner"]["seen"] == 120
    assert got["learner"]["refits"] + got["learner"]["rejected"] + got["learner"]["failed"] >= 8
    late = got["after_seen"]
    assert set(late) == {"online", "head", "running_mean", "position_only"}
    # the prompt says the length: learnt online, the arrival ranking beats the head and the running mean
    assert late["online"]["step0"]["kendall_tau"] > max(
        late["head"]["step0"]["kendall_tau"], late["running_mean"]["step0"]["kendall_tau"], 0.5
    )
    assert late["online"]["step0"]["n"] == 60
    # ... also among the requests one correction predicted (a refit every 10: six groups of 10)
    assert late["online"]["step0_tau_per_refit"] > max(late["head"]["step0_tau_per_refit"], 0.5)
    assert np.isfinite(late["online"]["within_step_tau_per_refit"])
    assert got["new_prompt_requests"] == 0 and got["after_seen_new_prompts"] is None  # pass 2 repeats all
    with pytest.raises(ValueError, match="leaves no request"):
        prequential(text_predictor, path, settings, after=60)


def test_a_file_other_than_the_heads_training_data_keeps_every_unseen_row(tmp_path: Path) -> None:
    from tessera.predictor.dataset import is_validation, load_pairs, unseen_by_head

    def write(path: Path, groups: list[str]) -> Path:
        with gzip.open(path, "wt") as fh:
            for g in groups:
                fh.write(json.dumps({"prompt_id": g, "prompt": f"about {g}", "response": "text"}) + "\n")
        return path

    trained_on = [f"t{i}" for i in range(40)]
    train = write(tmp_path / "train.jsonl.gz", trained_on)
    meta = {"split": {"by": "prompt_id", "val_fraction": 0.2}, "config": {"data": str(train)}}
    other = load_pairs(write(tmp_path / "other.jsonl.gz", [f"n{i}" for i in range(30)] + trained_on))
    kept = {p.group for p in unseen_by_head(other, meta)}
    held = {g for g in trained_on if is_validation(g, 0.2)}
    assert 0 < len(held) < 40 and kept == {f"n{i}" for i in range(30)} | held
    # the training file itself: its held-out prompts only
    assert {p.group for p in unseen_by_head(load_pairs(train), meta)} == held
    # the training file not on this machine: the held-out split by id, as before
    gone = {**meta, "config": {"data": str(tmp_path / "gone.jsonl.gz")}}
    assert {p.group for p in unseen_by_head(other, gone)} == {
        p.group for p in other if is_validation(p.group, 0.2)
    }


def test_predictor_eval_online_prints_the_ranking_and_refuses_a_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tessera.cli import main

    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        for n in range(1, 41):
            fh.write(json.dumps({"prompt": f"Say 'ok' {n} times.", "response": " ok" * n}) + "\n")
    out = tmp_path / "online.json"
    args = ["predictor", "eval", "--model", "smollm2", "--data", str(path), "--threads", "1"]
    assert main([*args, "--online", "--after", "20", "--min-samples", "10", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "after the learner saw 20" in text and "position only" in text and "refits installed" in text
    assert "the 20 whose prompt was new" in text  # one pass of 40 distinct prompts
    assert json.loads(out.read_text())["after_seen"]["online"]["step0"]["n"] == 20
    assert main([*args]) == 0  # the head alone: step 0 and within-step τ lead
    assert capsys.readouterr().out.startswith("Kendall τ at step 0")
    assert main([*args, "--online", "--split", "heldout"]) == 2
    assert "takes no --split" in capsys.readouterr().err


def test_bench_decision_time_online_part_times_decisions_with_and_without_refits() -> None:
    from tessera.bench.refit_time import online_rows

    opts = {"rounds": 2, "decisions": 15, "batch": 4, "refit_every": 20}
    rows, checks, cfg = online_rows(opts, lambda *a, **k: None)
    off, on = rows
    assert off["policy"] == "predict:refits=off" and on["policy"] == "predict:refits=on"
    assert off["decisions"] == on["decisions"] == 30 and sum(on["hist_ms"].values()) == 30
    assert on["finished"] == 120 and on["refits"] >= 1 and on["refit_failed"] == 0
    assert on["refit_cpu_s_per_1000"] > 0 and on["here_ms_max"] > 0
    assert "decisions ran during a refit" in checks[0] and cfg["part"] == "online"
    with pytest.raises(ValueError, match="rounds=0"):
        online_rows({"rounds": 0}, lambda *a, **k: None)
