"""The dataset generator's output (``tessera predictor gen-dataset``) is what the trainer reads, and the
shipped smollm2 dataset and head agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.bench.responses import decodings, load_prompts, summarize, write_rows
from tessera.predictor.dataset import load_pairs


def _row(pid: str, decoding: str, response: str, tokens: int, finish: str = "stop") -> dict:
    return {"id": f"{pid}__m__{decoding}", "prompt_id": pid, "source": "s", "model": "m",
            "decoding": decoding,
            "temperature": 0.0 if decoding == "greedy" else 0.7, "seed": None if decoding == "greedy" else 1,
            "max_tokens": 8, "prompt": f"question {pid}", "response": response, "prompt_tokens": 3,
            "response_tokens": tokens, "finish_reason": finish}  # fmt: skip


def test_generated_rows_load_as_training_pairs_grouped_by_prompt(tmp_path: Path) -> None:
    rows = [
        _row("p2", "t0.7-s1", "b b", 2),
        _row("p1", "greedy", "a a a", 3),
        _row("p1", "t0.7-s1", "x" * 9, 8, "length"),
    ]
    out = tmp_path / "d.jsonl.gz"
    write_rows(rows, out)
    pairs = load_pairs(out)
    assert [(p.group, p.response) for p in pairs] == [("p1", "a a a"), ("p1", "x" * 9), ("p2", "b b")]
    assert {p.model for p in pairs} == {"m"}
    first = out.read_bytes()
    write_rows(list(reversed(rows)), out)  # same answers, any order: the same bytes
    assert out.read_bytes() == first
    stats = summarize(rows)
    assert stats["t0.7-s1"]["answers"] == 2 and stats["t0.7-s1"]["hit_cap"] == 1
    assert stats["greedy"]["hit_cap"] == 0 and stats["greedy"]["mean_tokens"] == 3


def test_decodings_and_prompts_are_validated(tmp_path: Path) -> None:
    assert [d.name for d in decodings(True, 0.7, [1, 2])] == ["greedy", "t0.7-s1", "t0.7-s2"]
    with pytest.raises(ValueError, match="temperature"):
        decodings(True, 0.0, [1])
    with pytest.raises(ValueError, match="nothing to generate"):
        decodings(False, 0.7, [])
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt_id": "a", "prompt": "x"})
        + "\n"
        + json.dumps({"prompt_id": "a", "prompt": "y"})
        + "\n"
    )
    with pytest.raises(ValueError, match="appears twice"):
        load_prompts(path)
    assert load_prompts(path, limit=1) == [{"prompt_id": "a", "prompt": "x", "source": ""}]


def test_a_stopped_run_keeps_only_the_answered_prefix_of_its_jobs() -> None:
    from tessera.bench.responses import answered_prefix

    rows = [_row("p1", "greedy", "a", 1), _row("p3", "greedy", "c", 1), _row("p1", "t0.7-s1", "d", 1)]
    order = [("p1", "greedy"), ("p2", "greedy"), ("p3", "greedy"), ("p1", "t0.7-s1")]
    # p2 is still unanswered (a long answer in flight): p3's short answer and p1's sample wait for it
    assert answered_prefix(rows, order) == rows[:1]
    assert answered_prefix([*rows, _row("p2", "greedy", "b", 1)], order)[-1]["decoding"] == "t0.7-s1"


def test_the_shipped_smollm2_head_reproduces_its_stored_metrics_on_its_dataset() -> None:
    from tessera.predictor.evaluate import evaluate
    from tessera.predictor.model import TextLengthPredictor, load_metadata
    from tessera.predictor.train import DEFAULT_ARTIFACT_DIR, SERVED_TOKENIZER_FILE

    folder = DEFAULT_ARTIFACT_DIR / "smollm2"
    meta = load_metadata("smollm2")
    assert meta["served_tokenizer"] == SERVED_TOKENIZER_FILE and meta["split"]["by"] == "prompt_id"
    data = folder / Path(meta["config"]["data"]).name
    assert {p.model for p in load_pairs(data)} == {"smollm2"}
    got = evaluate(TextLengthPredictor("smollm2", threads=1), data, split="heldout", cache_dir=None)
    stored = meta["validation"]
    assert {k: got[k] for k in stored} == pytest.approx(stored, rel=1e-6)
