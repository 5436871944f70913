"""Training of the length head on frozen-encoder features (CPU).

Optimiser and checkpointing: AdamW, best checkpoint (ELIS names neither; docs/papers.md, "ELIS: response
length predictor"). CHOICES, all settings, measured on AlpacaEval:
- lr 1e-3 / batch 256 / 6 epochs instead of ELIS' 1e-4 / 16 / 16: same samples per epoch, far
  fewer optimiser steps on 2 shared cores (the default run takes about 4 min here).
- Huber loss and head dropout 0.3: the head memorises AlpacaEval's 805 prompts within one epoch
  (each appears 51 times × every step); MSE on raw tokens chases the few 3000+-token loops.
- The best epoch is picked on a dev split of the training prompts (``dev_fraction``), so the
  validation figures come from prompts no training choice saw.
- Encoder layers 0 (mean-pooled static MiniLM token embeddings, see encoder.py) and every response
  of each training prompt (``rows_per_prompt`` None). Against the full 6-layer int8 MiniLM on the
  same held-out prompts (all 7,850 rows): Kendall τ over all steps 0.327 vs 0.246, R² about 0 for
  both; at step 0 τ 0.222 vs 0.325 (the transformer reads the prompt better). ISRTF in
  ``tessera bench elis``, mean of seeds 0-2: 24.0/22.7/16.7% below FCFS at batch 1/2/4 vs
  23.9/20.8/15.7%. A batch of 16 costs ~10 ms instead of ~120 ms (window) and ~300 ms (prompts).
Cleaning (ELIS §4.2): training rows whose response length lies outside 1.5 IQR
of the log lengths are dropped (``clean_outliers``); dev and validation keep every row. The
shipped head is these defaults.

Why the accuracy stays low on AlpacaEval: 51 models of very different verbosity answer each
prompt and the model is not an input. On the held-out prompts, even oracle information does not
reach the predictor's target (R² 0.5 on held-out prompts): the mean length of the other 50 models'
answers to the same prompt, conditioned on the tokens already generated, gives R² 0.14 and τ 0.41;
scaled by the answering model's mean verbosity, R² 0.18 and τ 0.52.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tessera.predictor.dataset import (
    Pair,
    by_row,
    filter_sources,
    load_pairs,
    log_iqr_bounds,
    sample_per_prompt,
    split_by_prompt,
)
from tessera.predictor.encoder import ChunkEncoder
from tessera.predictor.features import feature_dim
from tessera.predictor.head import LengthHead
from tessera.predictor.metrics import regression_metrics
from tessera.predictor.samples import CACHE_DIR, EmbeddingStore, StepSettings, build_samples
from tessera.predictor.tokens import TokenCounter

HEAD_FILE = "head.pt"
DEV_SALT = "#dev"  # salt of the dev split drawn inside the training prompts
META_FILE = "head.json"
# A head trained on a served model's own tokens carries that tokenizer (gzipped), so it counts and cuts
# the answer in the tokens the engine generates wherever it is loaded.
SERVED_TOKENIZER_FILE = "tokenizer.json.gz"
DEFAULT_ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"


def shipped_heads() -> list[str]:
    """Names of the heads shipped beside the default one (sub-folders of the artifact folder)."""
    return sorted(p.name for p in DEFAULT_ARTIFACT_DIR.iterdir() if (p / META_FILE).is_file())


def resolve_artifact(spec: str | Path | None = None) -> Path:
    """The folder of a trained head: None is the default shipped head, a bare name one of the other
    shipped heads (``shipped_heads``), anything else a folder path."""
    if spec is None:
        return DEFAULT_ARTIFACT_DIR
    text = str(spec)
    if "/" not in text and text in shipped_heads():
        return DEFAULT_ARTIFACT_DIR / text
    return Path(spec)


@dataclass(slots=True)
class TrainConfig:
    """Every setting of a training run (stored in the artifact's metadata)."""

    data: str
    out: str
    encoder: str = "auto"
    encoder_layers: int | None = 0  # None: all layers; 0: static token embeddings (see module doc)
    quantize: bool = True
    tokenizer: str | None = None  # served model's tokenizer; None: the default (see tokens.py)
    steps: StepSettings = field(default_factory=StepSettings)
    val_fraction: float = 0.2
    # "prompt" (the default and the only honest one) or "row": every row its own group, which leaks
    # prompts across the split; kept to compare with ELIS' row-split figure (ELIS §4.2).
    split_by: str = "prompt"
    # Share of the training prompts held out as the dev split that picks the best epoch, so the
    # validation figures come from prompts no training choice has seen.
    dev_fraction: float = 0.1
    rows_per_prompt: int | None = None
    val_rows_per_prompt: int | None = 4
    exclude_sources: tuple[str, ...] = ()
    hidden: int = 512
    depth: int = 8
    dropout: float = 0.3
    epochs: int = 6
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01  # AdamW's default
    clean_outliers: bool = True  # ELIS' log-IQR rule on response length, training rows only
    loss: str = "huber"  # "mse" or "huber"
    # Add the cap class (head.py): needs rows that say finish_reason and one max_tokens (a served model's
    # own answers, `tessera predictor gen-dataset`).
    cap_class: bool = False
    seed: int = 0
    threads: int | None = None
    cache_dir: str | None = str(CACHE_DIR)  # frozen-encoder embeddings cache (None: in memory only)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# The cap classifier's optimisation (CHOICE): full batch, AdamW; it has 1.3k weights and 6 inputs, so
# 200 steps over the smollm2 training rows take about 2 s on one shared core.
CAP_STEPS = 200
CAP_LR = 1e-2
CAP_WEIGHT_DECAY = 1e-3


def _cap_tokens(pairs: list[Pair]) -> int:
    """The one token cap the training answers were generated under; ValueError when rows do not say."""
    if any(p.capped is None or p.max_tokens is None for p in pairs):
        raise ValueError(
            "--cap-class needs every row's finish_reason and max_tokens (as `tessera predictor gen-dataset` "
            "writes them)"
        )
    caps = {p.max_tokens for p in pairs}
    if len(caps) != 1:
        raise ValueError(f"--cap-class needs one max_tokens for all training rows, got {sorted(caps)}")
    return int(caps.pop())


def _train_cap_class(
    head: LengthHead, x: torch.Tensor, capped: list[bool], cap_tokens: int, seed: int
) -> None:
    """Add the cap classifier to ``head`` and fit it on the training features (the regression head stays)."""
    torch.manual_seed(seed)
    head.add_cap_class(cap_tokens)
    assert head.cap is not None
    y = torch.tensor(capped, dtype=torch.float32)
    opt = torch.optim.AdamW(head.cap.parameters(), lr=CAP_LR, weight_decay=CAP_WEIGHT_DECAY)
    head.eval()
    for _ in range(CAP_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head.cap_logit(x), y)
        loss.backward()
        opt.step()


def train(cfg: TrainConfig) -> dict:
    """Train, keep the best-validation head, write head.pt + head.json to ``cfg.out``; return the metadata."""
    if cfg.loss not in ("mse", "huber"):
        raise ValueError(f"loss must be 'mse' or 'huber', got {cfg.loss!r}")
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    served = TokenCounter.from_path(cfg.tokenizer)
    encoder = ChunkEncoder(cfg.encoder, cfg.encoder_layers, cfg.quantize, cfg.threads)
    pairs = filter_sources(load_pairs(cfg.data), exclude=cfg.exclude_sources)
    if cfg.split_by not in ("prompt", "row"):
        raise ValueError(f"split_by must be 'prompt' or 'row', got {cfg.split_by!r}")
    if cfg.split_by == "row":
        pairs = by_row(pairs)
    train_pairs, val_pairs = split_by_prompt(pairs, cfg.val_fraction)
    train_pairs, dev_pairs = split_by_prompt(train_pairs, cfg.dev_fraction, salt=DEV_SALT)
    for name, part, flag in (
        ("training", train_pairs, "--val-fraction/--dev-fraction"),
        ("dev", dev_pairs, "--dev-fraction"),
        ("validation", val_pairs, "--val-fraction"),
    ):
        if not part:
            raise ValueError(f"the {name} split has no prompts: change {flag} or give more prompt ids")
    train_pairs = sample_per_prompt(train_pairs, cfg.rows_per_prompt, cfg.seed)
    dev_pairs = sample_per_prompt(dev_pairs, cfg.val_rows_per_prompt, cfg.seed + 2)
    val_pairs = sample_per_prompt(val_pairs, cfg.val_rows_per_prompt, cfg.seed + 1)
    _log(
        f"encoder {encoder.signature()}; rows train {len(train_pairs)}, dev {len(dev_pairs)}, "
        f"validation {len(val_pairs)}"
    )
    store = EmbeddingStore(encoder, Path(cfg.cache_dir) if cfg.cache_dir else None)
    tr_samples, tr_chunks = build_samples(train_pairs, served, encoder, cfg.steps)
    dv_samples, dv_chunks = build_samples(dev_pairs, served, encoder, cfg.steps)
    va_samples, va_chunks = build_samples(val_pairs, served, encoder, cfg.steps)
    bounds = None
    if cfg.clean_outliers:
        # Training rows only: validation keeps every row, so its metrics are on unfiltered data.
        length = {s.row: s.generated + s.target for s in tr_samples}
        bounds = log_iqr_bounds(list(length.values()))
        tr_samples = [s for s in tr_samples if bounds[0] <= length[s.row] <= bounds[1]]
        dropped = len(length) - len({s.row for s in tr_samples})
        _log(
            f"outlier rule: kept responses of {bounds[0]:.0f}..{bounds[1]:.0f} tokens, dropped {dropped} rows"
        )
    _log(f"step samples train {len(tr_samples)}, dev {len(dv_samples)}, validation {len(va_samples)}")
    store.ensure({**tr_chunks, **dv_chunks, **va_chunks})
    t_embedded = time.perf_counter()
    x_tr = torch.from_numpy(store.features(tr_samples))
    y_tr = torch.tensor([s.target for s in tr_samples], dtype=torch.float32)
    x_dv = torch.from_numpy(store.features(dv_samples))
    y_dv = np.array([s.target for s in dv_samples], dtype=np.float64)

    head = LengthHead(feature_dim(encoder.dim), cfg.hidden, cfg.depth, dropout=cfg.dropout)
    head.set_normalisation(x_tr)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn = torch.nn.MSELoss() if cfg.loss == "mse" else torch.nn.HuberLoss(delta=1.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    best: tuple[float, dict, int, dict] | None = None
    for epoch in range(1, cfg.epochs + 1):
        head.train()
        perm = torch.randperm(len(x_tr), generator=gen)
        total = 0.0
        for start in range(0, len(perm), cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            opt.zero_grad()
            loss = loss_fn(head(x_tr[idx]), y_tr[idx] / head.target_scale)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        head.eval()
        dev = regression_metrics(head.predict_tokens(x_dv).numpy(), y_dv)
        r2, tau = dev["r2"], dev["kendall_tau"]
        _log(f"epoch {epoch}: train loss {total / len(perm):.4f}, dev R² {r2:.3f}, τ {tau:.3f}")
        if best is None or dev["r2"] > best[0]:
            best = (dev["r2"], {k: v.clone() for k, v in head.state_dict().items()}, epoch, dev)
    assert best is not None
    head.load_state_dict(best[1])
    cap_tokens = None
    if cfg.cap_class:
        cap_tokens = _cap_tokens(train_pairs)
        _train_cap_class(head, x_tr, [bool(s.capped) for s in tr_samples], cap_tokens, cfg.seed)
    # fp16 storage halves the file; weights load back into fp32. Validation is scored with the weights
    # as stored, so `tessera predictor eval --split heldout` reproduces it.
    stored = {k: v.half() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in stored.items()})
    head.eval()
    x_va = torch.from_numpy(store.features(va_samples))
    y_va = np.array([s.target for s in va_samples], dtype=np.float64)
    validation = regression_metrics(head.predict_tokens(x_va).numpy(), y_va)
    cap_meta = None
    if cap_tokens is not None:
        cap_meta = {
            "tokens": cap_tokens,
            "train_share": float(np.mean([bool(s.capped) for s in tr_samples])),
            # the dev split with the cap class (``dev`` is the regression head alone, which picked the epoch)
            "dev": regression_metrics(head.predict_tokens(x_dv).numpy(), y_dv),
        }
        dev_cap = cap_meta["dev"]
        _log(f"cap class ({cap_tokens} tokens): dev R² {dev_cap['r2']:.3f}, τ {dev_cap['kendall_tau']:.3f}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(stored, out / HEAD_FILE)
    if cfg.tokenizer is not None:
        source = Path(served.name)
        raw = source.read_bytes()
        # mtime 0: the same tokenizer gives the same bytes
        (out / SERVED_TOKENIZER_FILE).write_bytes(
            raw if source.name.endswith(".gz") else gzip.compress(raw, compresslevel=9, mtime=0)
        )
    meta = {
        "encoder": encoder.name,
        "encoder_signature": encoder.signature(),
        "encoder_layers": encoder.num_layers,
        "quantize": cfg.quantize,
        "embed_dim": encoder.dim,
        "feature_dim": feature_dim(encoder.dim),
        "hidden": cfg.hidden,
        "depth": cfg.depth,
        "dropout": cfg.dropout,
        "target_scale": head.target_scale,
        "cap_tokens": cap_tokens,
        "steps": asdict(cfg.steps),
        "tokenizer": "default (all-MiniLM-L6-v2 WordPiece)" if cfg.tokenizer is None else cfg.tokenizer,
        "served_tokenizer": None if cfg.tokenizer is None else SERVED_TOKENIZER_FILE,
        "split": {
            "by": "prompt_id" if cfg.split_by == "prompt" else "row",
            "val_fraction": cfg.val_fraction,
            "dev_fraction": cfg.dev_fraction,
            "exclude_sources": list(cfg.exclude_sources),
        },
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("steps",)},
        "rows": {"train": len(train_pairs), "dev": len(dev_pairs), "validation": len(val_pairs)},
        "samples": {"train": len(tr_samples), "dev": len(dv_samples), "validation": len(va_samples)},
        "outlier_bounds_tokens": bounds,
        "best_epoch": best[2],
        "dev": best[3],
        "cap_class": cap_meta,
        "validation": validation,
        "seconds": {"embedding": t_embedded - t_start, "total": time.perf_counter() - t_start},
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    took = meta["seconds"]["total"]
    _log(f"wrote {out / HEAD_FILE} (best epoch {best[2]}, dev R² {best[0]:.3f}) in {took:.0f} s")
    return meta
