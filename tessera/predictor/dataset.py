"""Prompt/response data: loading with validation, split by prompt, ELIS step augmentation.

Input: JSONL (optionally gzipped), one object per line with string ``prompt`` and ``response``;
optional ``prompt_id`` (the split key; default: sha1 of the prompt), ``source``, ``model``, and
``finish_reason`` with ``max_tokens`` (a served model's own answers: whether the answer ran to its token cap).
Step augmentation (ELIS §4.2; docs/papers.md, "ELIS: response length predictor"): for a response
of L tokens and window K, steps k = 0..⌊(L−1)/K⌋; the input is the prompt plus the first K·k
response tokens and the target is the remaining L − K·k tokens. Responses of 0 tokens give no step
(nothing remains to predict).
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tessera.api.traces import read_jsonl


@dataclass(frozen=True, slots=True)
class Pair:
    """One prompt and one model's response."""

    prompt: str
    response: str
    group: str  # prompt id: rows with the same group never straddle the train/validation split
    source: str = ""
    model: str = ""
    # The answer's token cap and whether it ran to it (finish_reason "length"); None: the row does not say.
    max_tokens: int | None = None
    capped: bool | None = None


def load_pairs(path: str | Path) -> list[Pair]:
    """Read and validate a prompt/response JSONL(.gz) file; ValueError with the line on bad rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"data file {path} does not exist: give a JSONL(.gz) with prompt and response fields"
        )
    pairs: list[Pair] = []
    for lineno, row in read_jsonl(path):
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                got = f"{row.get(key)!r:.40}"
                raise ValueError(f"{path}:{lineno}: field {key!r} must be a string (got {got})")
        group = row.get("prompt_id") or hashlib.sha1(row["prompt"].encode()).hexdigest()[:12]
        pairs.append(
            Pair(
                row["prompt"],
                row["response"],
                str(group),
                str(row.get("source", "")),
                str(row.get("model", "")),
                int(row["max_tokens"]) if isinstance(row.get("max_tokens"), int) else None,
                None if row.get("finish_reason") is None else row["finish_reason"] == "length",
            )
        )
    if not pairs:
        raise ValueError(f"{path}: no rows")
    return pairs


def is_validation(group: str, val_fraction: float, salt: str = "") -> bool:
    """Whether a prompt group falls in the validation split (stable hash of the id, not file order);
    another ``salt`` draws an independent split (the dev split inside the training prompts)."""
    bucket = int(hashlib.sha1((group + salt).encode()).hexdigest()[:8], 16) % 10_000
    return bucket < val_fraction * 10_000


def row_group(pair: Pair) -> str:
    """A split group of its own for one row (a content hash of prompt id, model and response)."""
    return hashlib.sha1("\x00".join((pair.group, pair.model, pair.response)).encode()).hexdigest()[:12]


def by_row(pairs: list[Pair]) -> list[Pair]:
    """The pairs with each row its own split group (``row_group``).

    Only to compare with ELIS' reported accuracy (ELIS §4.2 splits rows 6:2:2): a row split puts other models'
    answers to the same prompt on both sides, so held-out figures leak."""
    return [replace(p, group=row_group(p)) for p in pairs]


def heldout(pairs: list[Pair], split: dict) -> list[Pair]:
    """The rows a trained artifact held out, from its metadata's ``split`` (by prompt id or by row)."""
    key = row_group if split.get("by") == "row" else (lambda p: p.group)
    return [p for p in pairs if is_validation(key(p), float(split["val_fraction"]))]


def unseen_by_head(pairs: list[Pair], meta: dict) -> list[Pair]:
    """The rows whose prompt a trained head never trained on, from its metadata (``head.json``).

    A file that is not the head's training data keeps every row but those sharing a prompt id with
    the head's training prompts (AlpacaEval's other models' answers, for the smollm2 head); the
    training file itself keeps its validation split. When the training file is not on this machine
    (or the head was split by row), the rows in the head's validation split by id (``heldout``)."""
    split = meta["split"]
    source = training_data_path(meta)
    if split.get("by") == "row" or source is None:
        return heldout(pairs, split)
    val_fraction = float(split["val_fraction"])
    trained: set[str] = set()
    for _, row in read_jsonl(source):
        group = row.get("prompt_id") or hashlib.sha1(str(row.get("prompt", "")).encode()).hexdigest()[:12]
        if not is_validation(str(group), val_fraction):
            trained.add(str(group))
    return [p for p in pairs if p.group not in trained]


def training_data_path(meta: dict) -> Path | None:
    """The head's training file from its metadata: absolute, or relative to the repository root (where
    the shipped heads were trained); None when it is not on this machine."""
    given = meta.get("config", {}).get("data")
    if not given:
        return None
    path = Path(given)
    if not path.is_absolute():
        path = Path(__file__).resolve().parents[2] / path
    return path if path.is_file() else None


def split_by_prompt(pairs: list[Pair], val_fraction: float, salt: str = "") -> tuple[list[Pair], list[Pair]]:
    """(train, validation): every row of a prompt lands on the same side."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train = [p for p in pairs if not is_validation(p.group, val_fraction, salt)]
    val = [p for p in pairs if is_validation(p.group, val_fraction, salt)]
    return train, val


def filter_sources(
    pairs: list[Pair], exclude: tuple[str, ...] = (), only: tuple[str, ...] = ()
) -> list[Pair]:
    """Rows whose source contains none of ``exclude`` (and one of ``only`` when given)."""
    kept = [p for p in pairs if not any(s in p.source for s in exclude)]
    if only:
        kept = [p for p in kept if any(s in p.source for s in only)]
    return kept


def sample_per_prompt(pairs: list[Pair], per_prompt: int | None, seed: int) -> list[Pair]:
    """At most ``per_prompt`` rows of each prompt, drawn with ``seed`` (None: all rows)."""
    if per_prompt is None:
        return list(pairs)
    if per_prompt < 1:
        raise ValueError(f"rows per prompt must be >= 1, got {per_prompt}")
    groups: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        groups[p.group].append(p)
    rng = random.Random(seed)
    out: list[Pair] = []
    for group in sorted(groups):
        rows = groups[group]
        out.extend(rows if len(rows) <= per_prompt else rng.sample(rows, per_prompt))
    return out


def sample_rows(pairs: list[Pair], max_rows: int | None, seed: int) -> list[Pair]:
    """At most ``max_rows`` rows drawn with ``seed`` (None: all), in file order."""
    if max_rows is None or len(pairs) <= max_rows:
        return list(pairs)
    keep = sorted(random.Random(seed).sample(range(len(pairs)), max_rows))
    return [pairs[i] for i in keep]


def log_iqr_bounds(lengths: list[int], k: float = 1.5) -> tuple[float, float]:
    """ELIS' outlier rule (§4.2): keep lengths within ``k``·IQR of the quartiles of log length."""
    if not lengths:
        raise ValueError("no lengths to compute outlier bounds from")
    q1, q3 = np.percentile(np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)), [25, 75])
    return float(np.exp(q1 - k * (q3 - q1))), float(np.exp(q3 + k * (q3 - q1)))


def step_points(length: int, window: int) -> list[int]:
    """Generated-token counts at which ELIS predicts: 0, K, 2K, ... while tokens remain."""
    return [window * k for k in range((length - 1) // window + 1)] if length > 0 else []
