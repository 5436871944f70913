"""Every prediction a replay can ask for, computed ahead in batched passes (simulation only).

In a simulated replay the response text is known up front, so each prediction ISRTF can request —
a request's prompt plus its first ``k·window`` generated tokens — is known too. ``precompute_table``
runs the wrapped ``TextLengthPredictor`` once per window step over all requests together (step 0 for
every request, then step 1, ...), the order in which its per-request chunk cache fills online; the
replay then looks predictions up by content. A prediction at any other point (``generated`` not on a
window step, or a request not precomputed) falls through to the wrapped predictor, so the policy sees
the same predictor either way, only computed ahead.

Caveat: the int8 dynamically quantised encoder scales activations per batch, so a chunk's embedding
(and the prediction) varies slightly with the batch it was embedded in — online as well as here.
Precomputed predictions equal online ones up to that batch-composition noise, not bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tessera.core.request import Request
from tessera.predictor.dataset import step_points


def content_key(req: Request) -> str:
    """What a prediction depends on besides ``generated``: prompt text and tokens, response text."""
    h = hashlib.blake2b(digest_size=16)
    for part in (req.prompt_text or "", str(req.prompt_tokens), req.response_text or ""):
        h.update(part.encode())
        h.update(b"\x00")
    return h.hexdigest()


class PrecomputedPredictor:
    """A ``LengthPredictor`` answering from a table filled ahead, falling back to ``inner`` on a miss."""

    def __init__(self, inner: Any, requests: Sequence[Request], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.inner = inner
        self.served = inner.served
        self.meta = inner.meta
        self.table: dict[tuple[str, int], float] = {}
        self.hits = 0
        self.misses = 0
        self._precompute(requests, window)

    def _precompute(self, requests: Sequence[Request], window: int) -> None:
        unique: dict[str, Request] = {}
        for req in requests:
            if req.prompt_text is None or req.response_text is None:
                raise ValueError(
                    f"request {req.id} lacks prompt_text or response_text: predictions can be "
                    "precomputed only for replays that carry both texts"
                )
            unique.setdefault(content_key(req), req)
        # One stand-in per content, so the wrapped predictor's per-request cache works as online.
        stand_ins = {
            key: Request(
                id=f"precompute-{key}",
                arrival=0.0,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.max_tokens,
                prompt_text=req.prompt_text,
                response_text=req.response_text,
            )
            for key, req in unique.items()
        }
        points = {key: step_points(req.target_output_tokens, window) for key, req in unique.items()}
        for k in range(max((len(p) for p in points.values()), default=0)):
            batch = [(key, p[k]) for key, p in points.items() if k < len(p)]
            for key, generated in batch:
                stand_ins[key].generated = generated
            preds = self.inner.predict_remaining([stand_ins[key] for key, _ in batch])
            self.table.update(zip(batch, preds, strict=True))
        for req in stand_ins.values():
            self.inner.forget(req)

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        """Table look-ups; requests not in the table are predicted by ``inner`` in one batch."""
        out: list[float | None] = [self.table.get((content_key(r), r.generated)) for r in requests]
        missing = [i for i, p in enumerate(out) if p is None]
        if missing:
            for i, pred in zip(
                missing, self.inner.predict_remaining([requests[i] for i in missing]), strict=True
            ):
                out[i] = pred
        self.misses += len(missing)
        self.hits += len(requests) - len(missing)
        return [float(p) for p in out if p is not None]

    def forget(self, req: Request) -> None:
        """Drop ``inner``'s cached embeddings of a finished request."""
        self.inner.forget(req)
