"""Accuracy of a trained predictor on any prompt/response file, and its CPU inference latency.

What ISRTF uses is the ranking of requests at the same position: at arrival (step 0) the queue it
reorders, and at each window boundary the requests re-ranked together. The pooled Kendall τ over all
steps rewards "later steps have less left", which ranking by position alone already gets (docs/bench.md:
0.731 by position against 0.697 for the head on coding prompts). So every report carries τ at step 0,
the mean τ within each step (``within_step_tau``) and the position-only baseline on the same steps.

``prequential`` replays a file in arrival order as a deployment would see it: each request is
predicted at every step before its answer is known, and the online learner learns from it once it
finishes (``tessera.predictor.online``).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from tessera.core.request import Phase, Request
from tessera.predictor.dataset import (
    Pair,
    filter_sources,
    heldout,
    load_pairs,
    sample_per_prompt,
    sample_rows,
    step_points,
    unseen_by_head,
)
from tessera.predictor.metrics import regression_metrics
from tessera.predictor.model import TextLengthPredictor
from tessera.predictor.online import OnlineLearner, OnlineSettings, within_step_tau
from tessera.predictor.samples import CACHE_DIR, EmbeddingStore, StepSettings, build_samples


def select_rows(
    pairs: list[Pair], meta: dict, split: str, sources: tuple[str, ...], max_rows: int | None, seed: int
) -> list[Pair]:
    """Rows to evaluate: ``split`` "all", or "heldout": the validation rows the trainer scored (its
    held-out prompts, less excluded sources, at most its validation rows per prompt drawn with its
    seed), so that the metrics stored with a head are reproduced."""
    if split not in ("all", "heldout"):
        raise ValueError(f"split must be 'all' or 'heldout', got {split!r}")
    if split == "heldout":
        pairs = heldout(
            filter_sources(pairs, exclude=tuple(meta["split"].get("exclude_sources", ()))), meta["split"]
        )
        cfg = meta.get("config", {})
        if meta["split"].get("by") != "row":  # split by row: every row is its own group, all are kept
            pairs = sample_per_prompt(pairs, cfg.get("val_rows_per_prompt"), int(cfg.get("seed", 0)) + 1)
    pairs = filter_sources(pairs, only=sources)
    if not pairs:
        raise ValueError("no rows left to evaluate after the split and source filters")
    return sample_rows(pairs, max_rows, seed)


def evaluate(
    predictor: TextLengthPredictor,
    data: str | Path,
    split: str = "all",
    sources: tuple[str, ...] = (),
    max_rows: int | None = None,
    seed: int = 0,
    cache_dir: Path | None = CACHE_DIR,
) -> dict:
    """MAE, RMSE, R², Kendall τ over all re-prediction steps, the same under ``step0``, and MAE by step."""
    pairs = select_rows(load_pairs(data), predictor.meta, split, sources, max_rows, seed)
    steps = StepSettings(**predictor.meta["steps"])
    samples, chunks = build_samples(pairs, predictor.served, predictor.encoder, steps)
    store = EmbeddingStore(predictor.encoder, cache_dir)
    store.ensure(chunks)
    pred = predictor.head.predict_tokens(torch.from_numpy(store.features(samples))).numpy()
    true = np.array([s.target for s in samples], dtype=np.float64)
    step = np.array([s.step for s in samples])
    result = ranking_report(pred, true, step)
    result["rows"] = len(pairs)
    return result


def ranking_report(pred: np.ndarray, true: np.ndarray, step: np.ndarray) -> dict:
    """Pooled metrics, the same under ``step0``, ``within_step_tau`` (mean τ among requests at the
    same step), τ by step, MAE by step, and ``position_only``: ranking by the step alone (τ pooled; 0
    within a step and at step 0, where it ties every request)."""
    result = regression_metrics(pred, true)
    result["step0"] = regression_metrics(pred[step == 0], true[step == 0])
    result["within_step_tau"] = within_step_tau(pred, true, step)
    result["tau_by_step"] = {
        str(k): regression_metrics(pred[step == k], true[step == k])["kendall_tau"]
        for k in range(10)
        if (step == k).sum() > 1
    }
    result["mae_by_step"] = {
        str(k): float(np.abs(pred[step == k] - true[step == k]).mean())
        for k in range(10)
        if (step == k).any()
    }
    result["position_only"] = {
        "kendall_tau": regression_metrics(-step.astype(np.float64), true)["kendall_tau"],
        "step0_tau": 0.0,
        "within_step_tau": 0.0,
    }
    return result


def prequential(
    predictor: TextLengthPredictor,
    data: str | Path,
    settings: OnlineSettings,
    seed: int = 0,
    passes: int = 1,
    after: int = 0,
    one_per_prompt: bool = False,
    max_rows: int | None = None,
) -> dict:
    """Replay ``data``'s rows (those whose prompt the head never trained on, ``unseen_by_head``:
    every row of another file, the held-out split of the head's own; ``one_per_prompt``: one answer
    per prompt) in a seeded arrival order, ``passes`` times (each pass reshuffled): predict every
    step of a request, then let the learner learn from it. Reports the online predictor, the head
    alone, the running mean of finished lengths and position alone, over the requests that arrived
    after the learner had seen ``after`` (and over all, and over those after ``after`` whose prompt
    no earlier request had), plus the learner's refit counts and costs. Beside the pooled step-0 τ
    each segment has ``step0_tau_per_refit``: the mean over refits of τ among the requests that
    arrived between two refits (``within_step_tau``: at least 10), predicted under one correction
    as a queue compares them; the pooled figure also ranks requests predicted under different
    refits against each other. ``within_step_tau_per_refit`` is the same for every step."""
    if passes < 1 or after < 0:
        raise ValueError(f"passes must be >= 1 and after >= 0, got {passes} and {after}")
    pairs = unseen_by_head(load_pairs(data), predictor.meta)
    if not pairs:
        raise ValueError(f"{data} has no row whose prompt the head did not train on")
    if one_per_prompt:
        pairs = sample_per_prompt(pairs, 1, seed)
    pairs = sample_rows(pairs, max_rows, seed)
    rng = np.random.default_rng(seed)
    order = [int(i) for _ in range(passes) for i in rng.permutation(len(pairs))]
    if after >= len(order):
        raise ValueError(f"after={after} leaves no request to score: the replay has {len(order)}")
    learner = OnlineLearner(replace(settings, background=False))
    predictor.online = learner
    if predictor.store is None:
        predictor.store = EmbeddingStore(predictor.encoder, cache_dir=None)
    served, window = predictor.served, predictor.window
    cols: dict[str, list[float]] = {"online": [], "head": [], "running_mean": [], "true": [], "step": []}
    arrival_index: list[int] = []
    refit_index: list[int] = []  # per prediction: the learner's refits so far (installed or not)
    novel: list[bool] = []  # per prediction: its prompt had not been seen finished before
    seen_prompts: set[str] = set()
    total, count = 0.0, 0
    for index, row in enumerate(order):
        pair = pairs[row]
        length = max(1, served.count(pair.response))
        req = Request(
            f"pq{index}",
            float(index),
            max(1, served.count(pair.prompt)),
            pair.max_tokens or length,
            prompt_text=pair.prompt,
            response_text=pair.response,
        )
        mean = (total + 200.0) / (count + 1)  # RunningMeanPredictor's prior 200, weight 1
        for k, generated in enumerate(step_points(length, window)):
            req.generated = generated
            cols["online"].append(predictor.predict_remaining([req])[0])
            cols["head"].append(predictor.last_head_prediction(req))
            cols["running_mean"].append(max(mean - generated, 1.0))
            cols["true"].append(length - generated)
            cols["step"].append(k)
            arrival_index.append(index)
            refit_index.append(learner.refits + learner.rejected + learner.failed)
            novel.append(pair.group not in seen_prompts)
        req.generated, req.phase = length, Phase.FINISHED
        predictor.forget(req)
        seen_prompts.add(pair.group)
        total, count = total + length, count + 1
    arr = {k: np.asarray(v, dtype=np.float64) for k, v in cols.items()}
    step = arr["step"].astype(int)
    late = np.asarray(arrival_index) >= after
    new = late & np.asarray(novel, dtype=bool)

    refit = np.asarray(refit_index)

    def scored(sel: np.ndarray) -> dict:
        out = {
            name: ranking_report(arr[name][sel], arr["true"][sel], step[sel])
            for name in ("online", "head", "running_mean")
        }
        first = sel & (step == 0)
        by_step_and_refit = step * (int(refit.max()) + 1) + refit
        for name in out:
            out[name]["step0_tau_per_refit"] = within_step_tau(
                arr[name][first], arr["true"][first], refit[first]
            )
            out[name]["within_step_tau_per_refit"] = within_step_tau(
                arr[name][sel], arr["true"][sel], by_step_and_refit[sel]
            )
        out["position_only"] = out["online"].pop("position_only")
        for name in ("head", "running_mean"):
            out[name].pop("position_only")
        return out

    return {
        "requests": len(order),
        "rows": len(pairs),
        "passes": passes,
        "after": after,
        "all": scored(np.ones_like(late)),
        "after_seen": scored(late),
        # the same, only requests whose prompt no earlier request had: what carries to new prompts
        # (a prompt answered several times, or a second pass, is learnt by heart otherwise)
        "after_seen_new_prompts": scored(new) if (new & (step == 0)).sum() > 1 else None,
        "new_prompt_requests": int((new & (step == 0)).sum()),
        "learner": learner.stats(),
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
    }


def measure_latency(
    predictor: TextLengthPredictor, data: str | Path, batch: int = 16, repeats: int = 30, seed: int = 0
) -> dict:
    """p50/p90 wall time (ms) of ``predict_remaining`` on batches of ``batch`` requests, three cases.

    ``arrival``: new requests, nothing generated yet (the prompts are embedded). ``window``: the
    steady state of ISRTF — each request was predicted at the previous window boundary and now returns
    with one more window of text (one new chunk each). ``cold``: requests first seen mid-answer (after
    an eviction from the per-request cache: the prompt and every answer chunk so far are embedded). As
    in a worker, ``response_text`` is only the text generated so far (cut outside the timed calls).
    """
    pairs = load_pairs(data)
    rng = random.Random(seed)
    window = predictor.window
    times: dict[str, list[float]] = {"arrival": [], "window": [], "cold": []}

    def timed(case: str, reqs: list[Request], record: bool) -> None:
        t0 = time.perf_counter()
        predictor.predict_remaining(reqs)
        if record:
            times[case].append((time.perf_counter() - t0) * 1e3)

    for rep in range(repeats + 1):  # the first repeat warms up torch
        chosen = rng.sample(pairs, batch)
        lengths = [predictor.served.count(p.response) for p in chosen]
        reqs = [
            Request(f"lat{rep}-{i}", 0.0, predictor.served.count(p.prompt), n + 1, prompt_text=p.prompt)
            for i, (p, n) in enumerate(zip(chosen, lengths, strict=True))
        ]
        timed("arrival", reqs, rep > 0)
        for req, pair, n in zip(reqs, chosen, lengths, strict=True):
            predictor.forget(req)
            req.generated = window * rng.randint(0, max(0, (n - 1) // window - 1))
            req.response_text = predictor.served.prefix(pair.response, req.generated)
        timed("cold", reqs, rep > 0)
        for req, pair in zip(reqs, chosen, strict=True):
            req.generated += window
            req.response_text = predictor.served.prefix(pair.response, req.generated)
        timed("window", reqs, rep > 0)
        for req in reqs:
            predictor.forget(req)
    return {
        name: {
            "p50_ms": statistics.median(v),
            "p90_ms": float(np.percentile(v, 90)),
            "batch": batch,
            "repeats": repeats,
        }
        for name, v in times.items()
    } | {"threads": torch.get_num_threads()}
