"""PrecomputedPredictor: every window step is predicted ahead; look-ups equal the wrapped predictor."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tessera.core.request import Request
from tessera.predictor.precomputed import PrecomputedPredictor


class FakeText:
    """Deterministic stand-in for TextLengthPredictor: depends on prompt text and generated tokens."""

    def __init__(self) -> None:
        self.served = object()
        self.meta = {"split": {"val_fraction": 0.2}}
        self.calls: list[list[tuple[str, int]]] = []
        self.forgotten: list[str] = []

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        self.calls.append([(r.prompt_text or "", r.generated) for r in requests])
        return [len(r.prompt_text or "") * 10.0 - r.generated / 2 for r in requests]

    def forget(self, req: Request) -> None:
        self.forgotten.append(req.id)


def _req(rid: str, prompt: str, out: int) -> Request:
    return Request(rid, 0.0, 5, out, true_output_tokens=out, prompt_text=prompt, response_text="x" * out)


def test_table_covers_every_window_step_batched_by_step() -> None:
    inner = FakeText()
    reqs = [_req("a", "short", 120), _req("b", "a longer prompt", 40), _req("c", "short", 120)]
    pre = PrecomputedPredictor(inner, reqs, window=50)
    # a and c have the same content: one entry per (content, step); steps 0, 50, 100 and 0
    assert len(pre.table) == 4
    assert [len(c) for c in inner.calls] == [2, 1, 1]  # one batched call per step
    assert len(inner.forgotten) == 2
    reqs[2].generated = 100
    reqs[1].generated = 0
    assert pre.predict_remaining([reqs[2], reqs[1]]) == [50.0 - 50.0, 150.0]
    assert (pre.hits, pre.misses) == (2, 0)
    assert len(inner.calls) == 3  # answered from the table


def test_off_step_requests_fall_through_to_the_wrapped_predictor() -> None:
    inner = FakeText()
    reqs = [_req("a", "short", 120), _req("b", "other", 80)]
    pre = PrecomputedPredictor(inner, reqs, window=50)
    reqs[0].generated = 73  # not on a window step
    reqs[1].generated = 50
    assert pre.predict_remaining(reqs) == [50.0 - 36.5, 25.0]
    assert (pre.hits, pre.misses) == (1, 1)
    assert inner.calls[-1] == [("short", 73)]


def test_requests_without_text_are_rejected() -> None:
    req = Request("a", 0.0, 5, 10, prompt_text="p")
    with pytest.raises(ValueError, match="response_text"):
        PrecomputedPredictor(FakeText(), [req], window=50)
    with pytest.raises(ValueError, match="window"):
        PrecomputedPredictor(FakeText(), [], window=0)
