"""Step samples of prompt/response pairs and their features via a cached chunk-embedding store.

The same helpers (``prompt_chunk``, ``answer_spans``, ``build_features``) serve training, evaluation
and online inference, so the features the head sees in serving are those it was trained on.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.predictor.dataset import Pair, step_points
from tessera.predictor.encoder import ChunkEncoder
from tessera.predictor.features import (
    answer_spans,
    build_features,
    feature_dim,
    prompt_chunk,
    repetition_stats,
)
from tessera.predictor.tokens import TokenCounter

CACHE_DIR = Path("/tmp/tessera-predictor-cache")


def chunk_key(ids: list[int] | tuple[int, ...]) -> bytes:
    """Content key of a token-id chunk."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int32).tobytes(), digest_size=12).digest()


@dataclass(slots=True)
class Sample:
    """One step of one response: features come from the prompt key and the answer chunk keys."""

    row: int
    step: int
    generated: int
    prompt_tokens: int
    target: int
    prompt_key: bytes
    chunk_keys: list[bytes] = field(default_factory=list)
    chunk_lens: list[int] = field(default_factory=list)
    repetition: tuple[float, float] = (1.0, 1.0)
    capped: bool | None = None  # the response ran to its token cap (None: the data does not say)


@dataclass(frozen=True, slots=True)
class StepSettings:
    """How inputs are cut: ELIS window K, answer chunk size and prompt truncation (encoder tokens)."""

    window: int = 50
    chunk_tokens: int = 50
    prompt_max_tokens: int = 128


def shares_tokenizer(served: TokenCounter, encoder: ChunkEncoder) -> bool:
    """Whether the served tokenizer is the encoder's: then answer tokens feed the encoder as they are."""
    return Path(served.name).resolve() == (encoder.path / "tokenizer.json").resolve()


def build_samples(
    pairs: list[Pair], served: TokenCounter, encoder: ChunkEncoder, settings: StepSettings
) -> tuple[list[Sample], dict[bytes, list[int]]]:
    """Step-augmented samples of ``pairs`` and the unique chunks (key -> encoder ids) they need."""
    chunks: dict[bytes, list[int]] = {}
    samples: list[Sample] = []
    same_tokenizer = shares_tokenizer(served, encoder)
    prompts_served = served.ids_batch([p.prompt for p in pairs])
    prompts_enc = encoder.ids([p.prompt for p in pairs])
    responses = served.tokenizer.encode_batch([p.response for p in pairs], add_special_tokens=False)
    for row, (pair, p_served, p_enc, resp) in enumerate(
        zip(pairs, prompts_served, prompts_enc, responses, strict=True)
    ):
        pchunk = prompt_chunk(p_enc, settings.prompt_max_tokens)
        pkey = chunk_key(pchunk)
        chunks.setdefault(pkey, pchunk)
        for k, generated in enumerate(step_points(len(resp.ids), settings.window)):
            if generated == 0:
                ans: list[int] = []
            elif same_tokenizer:
                ans = resp.ids[:generated]
            else:
                ans = encoder.ids([pair.response[: resp.offsets[generated - 1][1]]])[0]
            sample = Sample(
                row, k, generated, len(p_served), len(resp.ids) - generated, pkey, capped=pair.capped
            )
            sample.repetition = repetition_stats(ans, settings.chunk_tokens)
            for start, end in answer_spans(len(ans), settings.chunk_tokens):
                piece = ans[start:end]
                key = chunk_key(piece)
                chunks.setdefault(key, piece)
                sample.chunk_keys.append(key)
                sample.chunk_lens.append(end - start)
            samples.append(sample)
    return samples, chunks


class EmbeddingStore:
    """Chunk embeddings by content key, persisted under /tmp so training and evaluation embed once."""

    def __init__(self, encoder: ChunkEncoder, cache_dir: Path | None = CACHE_DIR) -> None:
        self.encoder = encoder
        self.vectors: dict[bytes, np.ndarray] = {}
        self.path = None
        if cache_dir is not None:
            sig = hashlib.sha1(encoder.signature().encode()).hexdigest()[:12]
            self.path = cache_dir / f"chunks-{sig}.npz"
            if self.path.is_file():
                data = np.load(self.path)
                self.vectors = dict(zip((bytes(k) for k in data["keys"]), data["vecs"], strict=True))

    def ensure(self, chunks: dict[bytes, list[int]], log: bool = True) -> None:
        """Embed every chunk not yet stored (batched), then save the cache."""
        missing = [k for k in chunks if k not in self.vectors]
        if not missing:
            return
        t0 = time.perf_counter()
        step = 4096
        for start in range(0, len(missing), step):
            keys = missing[start : start + step]
            vecs = self.encoder.embed([chunks[k] for k in keys])
            self.vectors.update(zip(keys, vecs, strict=True))
            if log:
                done = min(start + step, len(missing))
                rate = done / (time.perf_counter() - t0)
                print(f"  embedded {done}/{len(missing)} chunks ({rate:.0f}/s)", file=sys.stderr, flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keys = np.array(list(self.vectors), dtype="S12")
            tmp = self.path.with_suffix(".tmp.npz")
            np.savez(tmp, keys=keys, vecs=np.stack(list(self.vectors.values())).astype(np.float32))
            tmp.replace(self.path)

    def features(self, samples: list[Sample]) -> np.ndarray:
        """Feature matrix (n, feature_dim) of samples whose chunks are stored."""
        dim = self.encoder.dim
        out = np.empty((len(samples), feature_dim(dim)), dtype=np.float32)
        empty = np.zeros((0, dim), dtype=np.float32)
        for i, s in enumerate(samples):
            embs = np.stack([self.vectors[k] for k in s.chunk_keys]) if s.chunk_keys else empty
            out[i] = build_features(
                self.vectors[s.prompt_key], embs, s.chunk_lens, s.generated, s.prompt_tokens, s.repetition
            )
        return out
