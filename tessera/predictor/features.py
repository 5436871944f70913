"""Feature vector of the regression head, built from per-chunk embeddings (pure numpy).

Why chunks: re-prediction every K tokens must be cheap on CPU. The prompt is embedded once; the
answer is embedded in consecutive chunks of ``chunk_tokens`` encoder tokens, and a finished chunk is
never embedded again. This approximates ELIS' mean pooling over the whole (prompt ⊕ answer) input by
pooling chunk means, and lets the predictor cost one short chunk per request per window.

Layout (CHOICE, recorded in the artifact's metadata): prompt embedding ⊕ token-weighted mean of the
answer chunks ⊕ the latest answer chunk ⊕ [log1p(generated)/8, generated/1000, log1p(prompt)/8,
1 if nothing generated yet, distinct-token ratio of the latest chunk and of the last 4 chunks]. The
counts are explicit because the encoder sees truncated text; the distinct ratios flag degenerate
loops, which run until the token cap and make most of the long tail of remaining lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

N_SCALARS = 6
SCALAR_GENERATED = 1  # index among the scalars of generated / GENERATED_SCALE (the head's cap class reads it)
GENERATED_SCALE = 1000.0


def feature_dim(embed_dim: int) -> int:
    """Length of the feature vector for an encoder of ``embed_dim``."""
    return 3 * embed_dim + N_SCALARS


def prompt_chunk(ids: Sequence[int], max_tokens: int) -> list[int]:
    """The prompt's encoder ids kept for embedding: all, or the first and last halves of ``max_tokens``
    (CHOICE: keep the head and the most recent tokens)."""
    if len(ids) <= max_tokens:
        return list(ids)
    head = max_tokens // 2
    return [*ids[:head], *ids[len(ids) - (max_tokens - head) :]]


def answer_spans(n_ids: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) spans of the answer's chunks; the last one may be partial."""
    return [(s, min(s + chunk_tokens, n_ids)) for s in range(0, n_ids, chunk_tokens)]


def distinct_ratio(ids: Sequence[int]) -> float:
    """Share of distinct tokens in ``ids`` (1.0 for an empty sequence): low for repetitive loops."""
    return len(set(ids)) / len(ids) if len(ids) else 1.0


def repetition_stats(answer_ids: Sequence[int], chunk_tokens: int) -> tuple[float, float]:
    """Distinct-token ratios of the latest chunk and of the last four chunks of the answer so far."""
    n = len(answer_ids)
    last = answer_ids[(max(0, n - 1) // chunk_tokens) * chunk_tokens :] if n else answer_ids
    return distinct_ratio(last), distinct_ratio(answer_ids[max(0, n - 4 * chunk_tokens) :])


def build_features(
    prompt_emb: np.ndarray,
    chunk_embs: np.ndarray,
    chunk_lens: Sequence[int],
    generated: int,
    prompt_tokens: int,
    repetition: tuple[float, float] = (1.0, 1.0),
) -> np.ndarray:
    """One feature vector (float32) from a prompt embedding and its answer chunks (k × dim, may be 0 rows)."""
    dim = prompt_emb.shape[0]
    if len(chunk_lens):
        w = np.asarray(chunk_lens, dtype=np.float32)
        mean = (chunk_embs * w[:, None]).sum(0) / w.sum()
        last = chunk_embs[-1]
    else:
        mean = last = np.zeros(dim, dtype=np.float32)
    scalars = np.array(
        [
            np.log1p(generated) / 8.0,
            generated / GENERATED_SCALE,
            np.log1p(prompt_tokens) / 8.0,
            float(generated == 0),
            *repetition,
        ],
        dtype=np.float32,
    )
    return np.concatenate([prompt_emb, mean, last, scalars]).astype(np.float32)
