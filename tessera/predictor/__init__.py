"""ELIS response-length predictor: predicts the *remaining* output tokens of a request.

Public pieces:

- ``tokens``: token counting and "text of the first n tokens" with the served model's tokenizer
  (``count_tokens`` / ``prefix_text`` use the documented default when none is given);
- ``TextLengthPredictor``: frozen sentence encoder + MLP head (the shipped artifact);
- ``RunningMeanPredictor`` / ``ConstantPredictor``: cheaper fallbacks behind the same interface.

Every predictor exposes ``predict_remaining(requests) -> list[float]``. Heavy modules (torch) load
lazily so that importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.core.prediction import ConstantPredictor, LengthPredictor, RunningMeanPredictor
from tessera.predictor.tokens import count_tokens, prefix_text

if TYPE_CHECKING:
    from tessera.predictor.model import TextLengthPredictor

__all__ = [
    "ConstantPredictor",
    "LengthPredictor",
    "RunningMeanPredictor",
    "TextLengthPredictor",
    "count_tokens",
    "prefix_text",
]


def __getattr__(name: str) -> Any:
    if name == "TextLengthPredictor":
        from tessera.predictor.model import TextLengthPredictor

        return TextLengthPredictor
    raise AttributeError(name)
