"""Tokenizer helpers, data loading/validation, prompt-level split and ELIS step augmentation."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from tessera.predictor import count_tokens, prefix_text
from tessera.predictor.dataset import (
    by_row,
    heldout,
    load_pairs,
    log_iqr_bounds,
    split_by_prompt,
    step_points,
)
from tessera.predictor.features import answer_spans, distinct_ratio, prompt_chunk
from tessera.predictor.metrics import regression_metrics
from tessera.predictor.tokens import TokenCounter

TEXT = "Broadway actors: Hugh Jackman, Audra McDonald and Neil Patrick Harris started on stage."


def test_prefix_text_has_exactly_n_tokens() -> None:
    total = count_tokens(TEXT)
    assert total > 10
    for n in (1, 5, total - 1):
        cut = prefix_text(TEXT, n)
        assert TEXT.startswith(cut)
        assert count_tokens(cut) == n
    assert prefix_text(TEXT, 0) == ""
    assert prefix_text(TEXT, total + 10) == TEXT
    counter = TokenCounter.from_path(None)
    cut = counter.first_tokens([TEXT, "", TEXT], [5, 3, total + 1])
    assert cut[0] == (counter.ids(TEXT)[:5], prefix_text(TEXT, 5))
    assert cut[1] == ([], "") and cut[2] == (counter.ids(TEXT), TEXT)


def test_tokenizer_path_errors_say_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        TokenCounter.from_path(tmp_path)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    with gzip.open(path, "wt") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def test_load_pairs_validates_rows_with_line_numbers(tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "a.jsonl.gz", [{"prompt": "p", "response": "r"}, "{not json"])
    with pytest.raises(ValueError, match=r"a\.jsonl\.gz:2: not valid JSON"):
        load_pairs(bad)
    missing = write_jsonl(tmp_path / "b.jsonl.gz", [{"prompt": "p", "response": 3}])
    with pytest.raises(ValueError, match=r":1: field 'response' must be a string"):
        load_pairs(missing)
    with pytest.raises(ValueError, match="does not exist"):
        load_pairs(tmp_path / "nope.jsonl")


def test_split_is_by_prompt_never_by_row(tmp_path: Path) -> None:
    rows = [
        {"prompt_id": f"p{i}", "prompt": f"q{i}", "response": f"a{j}"} for i in range(200) for j in range(5)
    ]
    pairs = load_pairs(write_jsonl(tmp_path / "d.jsonl.gz", rows))
    train, val = split_by_prompt(pairs, 0.2)
    assert {p.group for p in train}.isdisjoint({p.group for p in val})
    assert len(train) + len(val) == len(pairs)
    assert 0.1 < len(val) / len(pairs) < 0.3
    # without prompt_id the prompt text groups rows
    anon = load_pairs(write_jsonl(tmp_path / "e.jsonl.gz", [{"prompt": "same", "response": "x"}] * 2))
    assert anon[0].group == anon[1].group
    # a salted split (the dev split inside the training prompts) is drawn independently of the first
    rest, dev = split_by_prompt(train, 0.2, salt="#dev")
    assert {p.group for p in rest}.isdisjoint({p.group for p in dev})
    assert len(rest) + len(dev) == len(train) and 0.1 < len(dev) / len(train) < 0.3
    assert {p.group for p in dev} != {p.group for p in split_by_prompt(train, 0.2)[1]}


def test_heldout_follows_the_artifacts_split(tmp_path: Path) -> None:
    rows = [
        {"prompt_id": f"p{i}", "prompt": f"q{i}", "response": f"a{j}", "model": f"m{j}"}
        for i in range(50)
        for j in range(6)
    ]
    pairs = load_pairs(write_jsonl(tmp_path / "h.jsonl.gz", rows))
    by_prompt = heldout(pairs, {"by": "prompt_id", "val_fraction": 0.3})
    assert by_prompt == split_by_prompt(pairs, 0.3)[1]
    # a row split puts answers to one prompt on both sides: the leak ELIS' figure has
    held = heldout(pairs, {"by": "row", "val_fraction": 0.3})
    kept = [p for p in pairs if p not in held]
    assert 0.15 < len(held) / len(pairs) < 0.45
    assert {p.group for p in held} & {p.group for p in kept}
    assert len({p.group for p in by_row(pairs)}) == len(pairs)


def test_step_points_follow_elis_rule() -> None:
    assert step_points(0, 50) == []
    assert step_points(1, 50) == [0]
    assert step_points(50, 50) == [0]
    assert step_points(51, 50) == [0, 50]
    assert step_points(120, 50) == [0, 50, 100]


def test_chunking_helpers() -> None:
    assert answer_spans(120, 50) == [(0, 50), (50, 100), (100, 120)]
    ids = list(range(300))
    kept = prompt_chunk(ids, 128)
    assert len(kept) == 128 and kept[:64] == ids[:64] and kept[-64:] == ids[-64:]
    assert distinct_ratio([1, 1, 1, 1]) == 0.25 and distinct_ratio([]) == 1.0


def test_metrics_perfect_and_reversed() -> None:
    true = np.array([10.0, 50.0, 100.0, 400.0])
    perfect = regression_metrics(true, true)
    assert perfect["r2"] == 1.0 and perfect["mae"] == 0.0 and perfect["kendall_tau"] == pytest.approx(1.0)
    assert regression_metrics(true[::-1].copy(), true)["kendall_tau"] == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        regression_metrics(np.array([]), np.array([]))


def test_log_iqr_bounds_drop_only_extreme_lengths() -> None:
    lengths = [100, 150, 200, 250, 300, 350, 400] * 10 + [2, 20_000]
    lo, hi = log_iqr_bounds(lengths)
    assert lo > 2 and hi < 20_000
    assert all(lo <= n <= hi for n in (100, 400))
    with pytest.raises(ValueError, match="no lengths"):
        log_iqr_bounds([])
