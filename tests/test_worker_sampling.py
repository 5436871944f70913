"""The sampling fields a client sets reach the engine, zeros included."""

from __future__ import annotations

from tessera.worker.server.schemas import CompletionRequest


def test_zero_valued_sampling_fields_are_forwarded() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "temperature": 0, "seed": 0, "top_p": 1, "presence_penalty": 0.0}
    )
    assert body.sampling() == {"temperature": 0, "seed": 0, "top_p": 1, "presence_penalty": 0.0}


def test_unset_and_false_fields_are_left_to_the_engine() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "ignore_eos": False})
    assert body.sampling() == {}
    assert CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "ignore_eos": True}
    ).sampling() == {"ignore_eos": True}
