"""The trained-predictor path end to end on a tiny artifact: train, load, predict (shape, determinism,
incremental re-prediction equals the batch features of training/evaluation), and the shipped head."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.core import Request
from tessera.predictor import count_tokens
from tessera.predictor.dataset import load_pairs
from tessera.predictor.model import TextLengthPredictor
from tessera.predictor.samples import EmbeddingStore, StepSettings, build_samples
from tessera.predictor.train import DEFAULT_ARTIFACT_DIR, HEAD_FILE, TrainConfig, train

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def make_data(path: Path, n: int = 24) -> Path:
    rng = np.random.default_rng(0)
    with gzip.open(path, "wt") as fh:
        for i in range(n):
            length = int(rng.integers(5, 180))
            response = " ".join(WORDS[j % len(WORDS)] for j in rng.integers(0, 100, length))
            row = {
                "prompt_id": f"p{i % 8}",
                "prompt": f"Write {length} words about topic {i % 8}.",
                "response": response,
            }
            fh.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("predictor")
    data = make_data(tmp / "data.jsonl.gz")
    cfg = TrainConfig(
        data=str(data),
        out=str(tmp / "art"),
        encoder="minilm",
        encoder_layers=0,
        quantize=False,
        rows_per_prompt=None,
        val_rows_per_prompt=None,
        val_fraction=0.3,
        dev_fraction=0.3,
        hidden=32,
        depth=3,
        dropout=0.2,
        epochs=2,
        batch_size=8,
        threads=1,
        cache_dir=None,
    )
    meta = train(cfg)
    assert meta["feature_dim"] == 3 * 384 + 6 and meta["best_epoch"] in (1, 2)
    # the epoch is picked on dev prompts; validation prompts are only scored
    assert meta["rows"]["dev"] > 0 and meta["samples"]["dev"] > 0 and meta["dropout"] == 0.2
    assert meta["dev"] != meta["validation"]
    return tmp / "art", data


def requests_from(data: Path, generated: int) -> list[Request]:
    reqs = []
    for i, pair in enumerate(load_pairs(data)[:6]):
        req = Request(f"r{i}", 0.0, count_tokens(pair.prompt), 1000, prompt_text=pair.prompt)
        req.response_text = pair.response
        req.generated = generated
        reqs.append(req)
    return reqs


def test_predictions_have_shape_and_are_deterministic(artifact: tuple[Path, Path]) -> None:
    art, data = artifact
    first = TextLengthPredictor(art, threads=1).predict_remaining(requests_from(data, 0))
    second = TextLengthPredictor(art, threads=1).predict_remaining(requests_from(data, 0))
    assert len(first) == 6 and all(isinstance(x, float) and x >= 0.0 for x in first)
    assert first == second
    assert TextLengthPredictor(art).predict_remaining([]) == []


def test_incremental_prediction_embeds_only_new_chunks_and_matches_batch_features(
    artifact: tuple[Path, Path],
) -> None:
    art, data = artifact
    pred = TextLengthPredictor(art, threads=1)
    reqs = requests_from(data, 0)
    pred.predict_remaining(reqs)
    assert pred.chunks_embedded == 6  # prompts only
    for r in reqs:
        r.generated = 50
    online = pred.predict_remaining(reqs)
    assert pred.chunks_embedded == 12  # one new answer chunk per request
    # the same steps through the training/evaluation feature path give the same predictions
    samples, chunks = build_samples(
        load_pairs(data)[:6], pred.served, pred.encoder, StepSettings(**pred.meta["steps"])
    )
    store = EmbeddingStore(pred.encoder, cache_dir=None)
    store.ensure(chunks, log=False)
    at50 = [s for s in samples if s.generated == 50]
    batch = pred.head.predict_tokens(torch.from_numpy(store.features(at50))).numpy()
    online_at50 = [online[s.row] for s in at50]
    assert np.allclose(batch, online_at50, rtol=1e-4, atol=1e-3)


def test_request_without_prompt_text_is_rejected(artifact: tuple[Path, Path]) -> None:
    pred = TextLengthPredictor(artifact[0])
    with pytest.raises(ValueError, match="prompt text"):
        pred.predict_remaining([Request("x", 0.0, 5, 10)])


def test_missing_artifact_says_how_to_train(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="predictor train"):
        TextLengthPredictor(tmp_path)


def test_shipped_head_is_small_and_loads() -> None:
    head = DEFAULT_ARTIFACT_DIR / HEAD_FILE
    assert head.is_file(), "the trained head ships with the package"
    assert head.stat().st_size <= 10 * 2**20
    pred = TextLengthPredictor()
    req = Request("s", 0.0, 10, 500, prompt_text="List three famous Broadway actors.")
    req.response_text = "1. Hugh Jackman\n2. Audra McDonald\n3. Idina Menzel"
    assert pred.predict_remaining([req])[0] >= 0.0


def test_a_call_with_more_requests_than_the_cache_holds_predicts_all(artifact: tuple[Path, Path]) -> None:
    # Storing the new prompts evicts older cache entries; the call must still use its own.
    art, data = artifact
    small = TextLengthPredictor(art, threads=1, cache_size=2)
    big = TextLengthPredictor(art, threads=1)
    reqs = requests_from(data, 0)
    small.predict_remaining(reqs[:1])  # one cached entry that the next call's new prompts evict
    assert small.predict_remaining(reqs) == big.predict_remaining(requests_from(data, 0))


def test_heldout_eval_reproduces_the_metrics_stored_with_the_head(artifact: tuple[Path, Path]) -> None:
    from tessera.predictor.evaluate import evaluate
    from tessera.predictor.model import load_metadata

    art, data = artifact
    got = evaluate(TextLengthPredictor(art, threads=1), data, split="heldout", cache_dir=None)
    stored = load_metadata(art)["validation"]
    assert {k: got[k] for k in stored} == pytest.approx(stored, rel=1e-6)


def test_a_head_trained_on_a_served_tokenizer_carries_it(tmp_path: Path) -> None:
    from tessera.predictor.tokens import TokenCounter, default_tokenizer_path
    from tessera.predictor.train import SERVED_TOKENIZER_FILE

    data = make_data(tmp_path / "data.jsonl.gz", n=16)
    plain = default_tokenizer_path()
    served = tmp_path / "served"
    served.mkdir()
    (served / "tokenizer.json").write_bytes(plain.read_bytes())
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "art"), encoder="minilm", tokenizer=str(served),
                      val_rows_per_prompt=None, val_fraction=0.3, dev_fraction=0.3, hidden=16, depth=2,
                      epochs=1, batch_size=8, threads=1, cache_dir=None)  # fmt: skip
    meta = train(cfg)
    assert meta["served_tokenizer"] == SERVED_TOKENIZER_FILE
    (served / "tokenizer.json").unlink()  # the artifact no longer needs the served model's folder
    pred = TextLengthPredictor(tmp_path / "art", threads=1)
    assert pred.served.name.endswith(SERVED_TOKENIZER_FILE)
    text = load_pairs(data)[0].response
    assert pred.served.count(text) == TokenCounter.from_path(plain).count(text) > 0


def test_shipped_heads_are_found_by_name(tmp_path: Path) -> None:
    from tessera.predictor.train import resolve_artifact, shipped_heads

    assert resolve_artifact(None) == DEFAULT_ARTIFACT_DIR
    for name in shipped_heads():
        assert resolve_artifact(name) == DEFAULT_ARTIFACT_DIR / name
    assert resolve_artifact(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="shipped head"):
        TextLengthPredictor("no-such-head")


def test_the_cap_class_blends_the_remaining_tokens_to_the_cap() -> None:
    from tessera.predictor.features import build_features
    from tessera.predictor.head import LengthHead

    dim = 4
    head = LengthHead(3 * dim + 6, hidden=8, depth=2, cap_tokens=512)
    assert head.cap is not None
    x = torch.from_numpy(
        np.stack([build_features(np.ones(dim, np.float32), np.ones((1, dim), np.float32), [g], g, 10)
                  for g in (100, 400, 600)])
    )  # fmt: skip
    reg = (head.forward(x) * head.target_scale).clamp_min(0.0).detach()
    last = head.cap[-1]
    assert isinstance(last, torch.nn.Linear)
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(50.0)  # P(cap) = 1: what is left to the cap, nothing past it
    assert head.predict_tokens(x).tolist() == pytest.approx([412.0, 112.0, 0.0])
    with torch.no_grad():
        last.bias.fill_(-50.0)  # P(cap) = 0: the regression head's figure, never past the cap
    to_cap = torch.tensor([412.0, 112.0, 0.0])
    assert head.predict_tokens(x).tolist() == pytest.approx(torch.minimum(reg, to_cap).tolist(), abs=1e-4)


def test_a_head_with_the_cap_class_trains_loads_and_reproduces_its_metrics(tmp_path: Path) -> None:
    from tessera.predictor.evaluate import evaluate

    plain = make_data(tmp_path / "plain.jsonl.gz", n=16)
    cfg = dict(encoder="minilm", val_rows_per_prompt=None, val_fraction=0.3, dev_fraction=0.3, hidden=16,
               depth=2, epochs=1, batch_size=8, threads=1, cache_dir=None, cap_class=True)  # fmt: skip
    with pytest.raises(ValueError, match="--cap-class needs every row's finish_reason"):
        train(TrainConfig(data=str(plain), out=str(tmp_path / "no"), **cfg))
    data = tmp_path / "capped.jsonl.gz"
    with gzip.open(data, "wt") as fh:
        for pair in load_pairs(plain):
            capped = count_tokens(pair.response) >= 130
            row = {"prompt_id": pair.group, "prompt": pair.prompt, "response": pair.response,
                   "max_tokens": 130, "finish_reason": "length" if capped else "stop"}  # fmt: skip
            fh.write(json.dumps(row) + "\n")
    assert {p.capped for p in load_pairs(data)} == {True, False}
    meta = train(TrainConfig(data=str(data), out=str(tmp_path / "art"), **cfg))
    assert meta["cap_tokens"] == 130 and 0.0 < meta["cap_class"]["train_share"] < 1.0
    pred = TextLengthPredictor(tmp_path / "art", threads=1)
    assert pred.head.cap is not None and pred.head.cap_tokens == 130
    reqs = requests_from(data, 150)
    assert pred.predict_remaining(reqs) == [0.0] * len(reqs)  # past the cap nothing remains
    got = evaluate(pred, data, split="heldout", cache_dir=None)
    assert {k: got[k] for k in meta["validation"]} == pytest.approx(meta["validation"], rel=1e-6)
