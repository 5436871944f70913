"""The trained ELIS length predictor behind the ``LengthPredictor`` interface.

``predict_remaining`` embeds, in one batched encoder pass, only what is new since a request's last
prediction: its prompt on first sight (``Predictor.init``) and its answer chunks not yet embedded
(``Predictor.iter``); finished chunks are cached per request id (LRU). The text generated so far is
the first ``req.generated`` served tokens of ``req.response_text``, so the simulator can hand over the
whole response and a real worker the streamed text.

Online learning (``online``, on by default; ``tessera.predictor.online``): each prediction's inputs
are kept with the request's cached embeddings, and a request that ``forget`` sees finished hands
them, with its true length, to the learner, whose latest correction every later prediction applies.
``forget`` is the hook ISRTF already calls for every request that leaves it, on the predicting thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tessera.core.request import Request
from tessera.predictor.encoder import ChunkEncoder
from tessera.predictor.features import N_SCALARS, answer_spans, build_features, prompt_chunk, repetition_stats
from tessera.predictor.head import LengthHead
from tessera.predictor.online import (
    FinishedRequest,
    OnlineLearner,
    OnlineSettings,
    shared_learner,
)
from tessera.predictor.samples import EmbeddingStore, chunk_key, shares_tokenizer
from tessera.predictor.tokens import TokenCounter, token_counter
from tessera.predictor.train import HEAD_FILE, META_FILE, resolve_artifact, shipped_heads

DEFAULT_ONLINE = OnlineSettings()  # the text predictor learns online unless told otherwise


@dataclass(slots=True)
class _Entry:
    prompt_emb: np.ndarray
    prompt_tokens: int
    full_chunks: list[np.ndarray] = field(default_factory=list)  # embeddings of complete answer chunks
    # for the online learner: the head's prediction and the scalars at arrival (nothing generated) ...
    arrival: tuple[float, np.ndarray] | None = None
    later: list[np.ndarray] = field(
        default_factory=list
    )  # ... and at each later position: generated, ŷ, scalars
    head_prediction: float | None = None  # the head's own latest prediction (before any correction)


def load_metadata(artifact_dir: str | Path | None = None) -> dict:
    """The artifact's head.json: a folder, the name of a shipped head, or None (the default head)."""
    path = resolve_artifact(artifact_dir) / META_FILE
    if not path.is_file():
        raise ValueError(
            f"no trained predictor at {path.parent}: run `tessera predictor train --out DIR`, or name a "
            f"shipped head ({', '.join(shipped_heads()) or 'none'})"
        )
    return json.loads(path.read_text())


class TextLengthPredictor:
    """Frozen encoder + trained head; predicts remaining output tokens from prompt and text so far."""

    def __init__(
        self,
        artifact_dir: str | Path | None = None,
        tokenizer: str | None = None,
        threads: int | None = None,
        cache_size: int = 8192,
        encoder: ChunkEncoder | None = None,
        store: EmbeddingStore | None = None,
        online: OnlineSettings | OnlineLearner | None = DEFAULT_ONLINE,
    ) -> None:
        self.meta = load_metadata(artifact_dir)
        spec = "minilm" if self.meta["encoder"] == "all-MiniLM-L6-v2" else self.meta["encoder"]
        self.encoder = encoder or ChunkEncoder(
            spec, self.meta["encoder_layers"], self.meta["quantize"], threads
        )
        if self.encoder.signature() != self.meta["encoder_signature"]:
            raise ValueError(
                f"encoder {self.encoder.signature()} differs from the one the head was trained on "
                f"({self.meta['encoder_signature']}): retrain with `tessera predictor train`"
            )
        folder = resolve_artifact(artifact_dir)
        self.artifact = folder  # the head's folder
        state = torch.load(folder / HEAD_FILE, map_location="cpu")
        self.head = LengthHead(
            self.meta["feature_dim"],
            self.meta["hidden"],
            self.meta["depth"],
            self.meta["target_scale"],
            self.meta.get("dropout", 0.0),  # artifacts from before the setting had none
            self.meta.get("cap_tokens"),  # None: no cap class (every head trained without --cap-class)
        )
        self.head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        self.head.eval()
        steps = self.meta["steps"]
        self.chunk_tokens = int(steps["chunk_tokens"])
        self.prompt_max_tokens = int(steps["prompt_max_tokens"])
        self.window = int(steps["window"])
        if tokenizer is None and self.meta.get("served_tokenizer"):
            tokenizer = str(folder / self.meta["served_tokenizer"])  # the tokens the head was trained on
        self.served: TokenCounter = token_counter(tokenizer)
        self.same_tokenizer = shares_tokenizer(self.served, self.encoder)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self.chunks_embedded = 0  # total encoder inputs so far (prompts + answer chunks)
        # Optional content-addressed store shared across runs (replaying the same texts, e.g. the same
        # trace under several policies, embeds each chunk once); None: every new chunk is embedded.
        self.store = store
        # Settings: the process's learner for this head (kept across reloads); a learner: that one; None: off.
        self.online: OnlineLearner | None = (
            shared_learner(str(folder.resolve()), online) if isinstance(online, OnlineSettings) else online
        )
        self.unrecorded = 0  # finished requests the learner missed (their entry left the LRU cache)

    def forget(self, req: Request) -> None:
        """Drop a request's cached embeddings; a finished one teaches the online learner first."""
        entry = self._cache.pop(req.id, None)
        if self.online is None or not req.finished:
            return
        if entry is None or entry.arrival is None:
            self.unrecorded += 1
            return
        head, scalars = entry.arrival
        later = np.stack(entry.later) if entry.later else np.zeros((0, 2 + N_SCALARS), np.float32)
        self.online.record(
            FinishedRequest(
                entry.prompt_emb, head, scalars, req.generated, req.generated >= req.max_tokens, later
            )
        )

    def last_head_prediction(self, req: Request) -> float:
        """The head's own prediction (before any online correction) at ``req``'s latest prediction;
        KeyError when the request is not cached."""
        entry = self._cache[req.id]
        if entry.head_prediction is None:
            raise KeyError(f"request {req.id} was not predicted")
        return entry.head_prediction

    def predict_remaining(self, requests: Sequence[Request]) -> list[float]:
        """Predicted remaining output tokens, one per request (one encoder and one head pass)."""
        if not requests:
            return []
        for req in requests:
            if req.prompt_text is None:
                raise ValueError(
                    f"request {req.id} has no prompt text: the text predictor needs prompt_text "
                    "(use a trace with prompts, or the running-mean/constant predictor)"
                )
        cut = self.served.first_tokens(
            [(r.response_text or "") if r.generated else "" for r in requests],
            [r.generated for r in requests],
        )
        # As in training (build_samples): the served ids themselves when the encoder shares the tokenizer.
        answer_ids = (
            [ids for ids, _ in cut] if self.same_tokenizer else self.encoder.ids([text for _, text in cut])
        )
        # This call's entries, held here: storing new prompts may evict cached ones (LRU bound).
        entries = {r.id: self._cache[r.id] for r in requests if r.id in self._cache}
        new_prompts = [i for i, r in enumerate(requests) if r.id not in entries]
        prompt_pieces = self.encoder.ids([requests[i].prompt_text or "" for i in new_prompts])
        jobs: list[list[int]] = [prompt_chunk(ids, self.prompt_max_tokens) for ids in prompt_pieces]
        plan: list[tuple[list[tuple[int, int]], int]] = []  # per request: spans, first span to embed
        for i, req in enumerate(requests):
            spans = answer_spans(len(answer_ids[i]), self.chunk_tokens)
            cached = len(entries[req.id].full_chunks) if req.id in entries else 0
            first = min(cached, len(spans))
            plan.append((spans, first))
            jobs.extend(answer_ids[i][s:e] for s, e in spans[first:])
        vecs = self._embed(jobs)
        for j, i in enumerate(new_prompts):
            entries[requests[i].id] = _Entry(vecs[j], requests[i].prompt_tokens)
            self._store(requests[i].id, entries[requests[i].id])
        cursor = len(new_prompts)
        feats = []
        for i, req in enumerate(requests):
            entry = entries[req.id]
            if req.id in self._cache:
                self._cache.move_to_end(req.id)
            spans, first = plan[i]
            fresh = vecs[cursor : cursor + len(spans) - first]
            cursor += len(spans) - first
            embs = [*entry.full_chunks[:first], *fresh]
            for k in range(len(entry.full_chunks), len(spans)):  # cache newly completed chunks
                if spans[k][1] - spans[k][0] == self.chunk_tokens:
                    entry.full_chunks.append(embs[k])
            lens = [e - s for s, e in spans]
            stack = np.stack(embs) if embs else np.zeros((0, self.encoder.dim), dtype=np.float32)
            rep = repetition_stats(answer_ids[i], self.chunk_tokens)
            feats.append(
                build_features(entry.prompt_emb, stack, lens, req.generated, entry.prompt_tokens, rep)
            )
        x = np.stack(feats)
        preds = self.head.predict_tokens(torch.from_numpy(x)).numpy().astype(np.float64)
        for req, pred in zip(requests, preds, strict=True):
            entries[req.id].head_prediction = float(pred)
        if self.online is None:
            return [float(p) for p in preds]
        scalars = x[:, -N_SCALARS:]
        for i, req in enumerate(requests):
            entry = entries[req.id]
            if req.generated == 0:
                entry.arrival = (float(preds[i]), scalars[i].copy())
            elif not entry.later or entry.later[-1][0] < req.generated:  # one row per position
                entry.later.append(np.concatenate([[req.generated, preds[i]], scalars[i]]).astype(np.float32))
        prompts = np.stack([entries[r.id].prompt_emb for r in requests])
        generated = np.array([r.generated for r in requests])
        preds = self.online.adjust(preds, scalars, prompts, generated)
        return [float(p) for p in preds]

    def _embed(self, jobs: list[list[int]]) -> np.ndarray:
        """Embeddings of ``jobs`` in one encoder pass; chunks in the shared store are not re-embedded."""
        out = np.zeros((len(jobs), self.encoder.dim), dtype=np.float32)
        keys = [chunk_key(ids) for ids in jobs] if self.store is not None else []
        todo = [j for j in range(len(jobs)) if self.store is None or keys[j] not in self.store.vectors]
        if todo:
            out[todo] = self.encoder.embed([jobs[j] for j in todo])
            self.chunks_embedded += len(todo)
        if self.store is not None:
            for j, key in enumerate(keys):
                if key in self.store.vectors:
                    out[j] = self.store.vectors[key]
                else:
                    self.store.vectors[key] = out[j]
        return out

    def _store(self, key: str, entry: _Entry) -> None:
        self._cache[key] = entry
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
