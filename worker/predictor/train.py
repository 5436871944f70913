"""Training of the length head on frozen-encoder features (CPU).

Loss, optimiser and checkpointing follow elis_andes_spec §A.12 #3 (MSE on raw tokens, AdamW,
best-validation checkpoint). CHOICE for this machine's CPU budget (2 shared cores, ≤ 30 min): the
spec's lr 1e-4 / batch 16 / 16 epochs become lr 1e-3 / batch 256 / 8 epochs (same sample count per
epoch, far fewer optimiser steps), and ``rows_per_prompt`` caps the responses used per training
prompt (8 of AlpacaEval's 51; the frozen-encoder pass dominates the cost); validation uses
``val_rows_per_prompt``. Cleaning (PAPER §4.2, spec §A.3 step 4): training rows whose response
length lies outside 1.5 IQR of the log lengths are dropped (``clean_outliers``); validation keeps
every row. The shipped head: these defaults with ``loss="huber"`` and ``epochs=4``.

Why the accuracy stays low on AlpacaEval (measured, see the issue-4 report): the same prompt is
answered by 51 models of very different verbosity and the model is not an input, so even the
(model, step) mean explains ~11% of held-out variance; ridge and gradient boosting on the same
features reach R² ≤ 0.08 and τ ≤ 0.28, the level of this head.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tessera.worker.predictor.dataset import (
    filter_sources,
    load_pairs,
    log_iqr_bounds,
    sample_per_prompt,
    split_by_prompt,
)
from tessera.worker.predictor.encoder import ChunkEncoder
from tessera.worker.predictor.features import feature_dim
from tessera.worker.predictor.head import LengthHead
from tessera.worker.predictor.metrics import regression_metrics
from tessera.worker.predictor.samples import CACHE_DIR, EmbeddingStore, StepSettings, build_samples
from tessera.worker.predictor.tokens import TokenCounter

HEAD_FILE = "head.pt"
META_FILE = "head.json"
DEFAULT_ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"


@dataclass(slots=True)
class TrainConfig:
    """Every setting of a training run (stored in the artifact's metadata)."""

    data: str
    out: str
    encoder: str = "auto"
    encoder_layers: int | None = None  # None: all layers
    quantize: bool = True
    tokenizer: str | None = None  # served model's tokenizer; None: the default (see tokens.py)
    steps: StepSettings = field(default_factory=StepSettings)
    val_fraction: float = 0.2
    rows_per_prompt: int | None = 8
    val_rows_per_prompt: int | None = 4
    exclude_sources: tuple[str, ...] = ()
    hidden: int = 512
    depth: int = 8
    epochs: int = 8
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01  # AdamW's default
    clean_outliers: bool = True  # ELIS' log-IQR rule on response length, training rows only
    loss: str = "mse"  # "mse" or "huber"
    seed: int = 0
    threads: int | None = None
    cache_dir: str | None = str(CACHE_DIR)  # frozen-encoder embeddings cache (None: in memory only)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(cfg: TrainConfig) -> dict:
    """Train, keep the best-validation head, write head.pt + head.json to ``cfg.out``; return the metadata."""
    if cfg.loss not in ("mse", "huber"):
        raise ValueError(f"loss must be 'mse' or 'huber', got {cfg.loss!r}")
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    served = TokenCounter.from_path(cfg.tokenizer)
    encoder = ChunkEncoder(cfg.encoder, cfg.encoder_layers, cfg.quantize, cfg.threads)
    pairs = filter_sources(load_pairs(cfg.data), exclude=cfg.exclude_sources)
    train_pairs, val_pairs = split_by_prompt(pairs, cfg.val_fraction)
    train_pairs = sample_per_prompt(train_pairs, cfg.rows_per_prompt, cfg.seed)
    val_pairs = sample_per_prompt(val_pairs, cfg.val_rows_per_prompt, cfg.seed + 1)
    _log(f"encoder {encoder.signature()}; rows train {len(train_pairs)}, validation {len(val_pairs)}")
    store = EmbeddingStore(encoder, Path(cfg.cache_dir) if cfg.cache_dir else None)
    tr_samples, tr_chunks = build_samples(train_pairs, served, encoder, cfg.steps)
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
    _log(f"step samples train {len(tr_samples)}, validation {len(va_samples)}")
    store.ensure({**tr_chunks, **va_chunks})
    t_embedded = time.perf_counter()
    x_tr = torch.from_numpy(store.features(tr_samples))
    y_tr = torch.tensor([s.target for s in tr_samples], dtype=torch.float32)
    x_va = torch.from_numpy(store.features(va_samples))
    y_va = np.array([s.target for s in va_samples], dtype=np.float64)

    head = LengthHead(feature_dim(encoder.dim), cfg.hidden, cfg.depth)
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
        val = regression_metrics(head.predict_tokens(x_va).numpy(), y_va)
        r2, tau = val["r2"], val["kendall_tau"]
        _log(f"epoch {epoch}: train loss {total / len(perm):.4f}, val R² {r2:.3f}, τ {tau:.3f}")
        if best is None or val["r2"] > best[0]:
            best = (val["r2"], {k: v.clone() for k, v in head.state_dict().items()}, epoch, val)
    assert best is not None
    head.load_state_dict(best[1])
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # fp16 storage halves the file; weights load back into fp32.
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in best[1].items()}, out / HEAD_FILE)
    meta = {
        "encoder": encoder.name,
        "encoder_signature": encoder.signature(),
        "encoder_layers": encoder.num_layers,
        "quantize": cfg.quantize,
        "embed_dim": encoder.dim,
        "feature_dim": feature_dim(encoder.dim),
        "hidden": cfg.hidden,
        "depth": cfg.depth,
        "target_scale": head.target_scale,
        "steps": asdict(cfg.steps),
        "tokenizer": "default (all-MiniLM-L6-v2 WordPiece)" if cfg.tokenizer is None else cfg.tokenizer,
        "split": {
            "by": "prompt_id",
            "val_fraction": cfg.val_fraction,
            "exclude_sources": list(cfg.exclude_sources),
        },
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("steps",)},
        "rows": {"train": len(train_pairs), "validation": len(val_pairs)},
        "samples": {"train": len(tr_samples), "validation": len(va_samples)},
        "outlier_bounds_tokens": bounds,
        "best_epoch": best[2],
        "validation": best[3],
        "seconds": {"embedding": t_embedded - t_start, "total": time.perf_counter() - t_start},
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    took = meta["seconds"]["total"]
    _log(f"wrote {out / HEAD_FILE} (best epoch {best[2]}, val R² {best[0]:.3f}) in {took:.0f} s")
    return meta
