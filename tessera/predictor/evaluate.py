"""Accuracy of a trained predictor on any prompt/response file, and its CPU inference latency."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tessera.core.request import Request
from tessera.predictor.dataset import (
    Pair,
    filter_sources,
    heldout,
    load_pairs,
    sample_per_prompt,
    sample_rows,
)
from tessera.predictor.metrics import regression_metrics
from tessera.predictor.model import TextLengthPredictor
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
    result = regression_metrics(pred, true)
    result["step0"] = regression_metrics(pred[step == 0], true[step == 0])
    result["mae_by_step"] = {
        str(k): float(np.abs(pred[step == k] - true[step == k]).mean())
        for k in range(10)
        if (step == k).any()
    }
    result["rows"] = len(pairs)
    return result


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
