"""Accuracy metrics of predicted vs true remaining tokens (R² on raw token counts)."""

from __future__ import annotations

import numpy as np
from scipy.stats import kendalltau


def regression_metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """MAE, RMSE, R² (raw remaining tokens) and Kendall τ-b of ``pred`` against ``true``."""
    pred = np.asarray(pred, dtype=np.float64)
    true = np.asarray(true, dtype=np.float64)
    if pred.shape != true.shape or pred.size == 0:
        raise ValueError(f"need equal, non-empty arrays, got {pred.shape} and {true.shape}")
    err = pred - true
    ss_tot = float(((true - true.mean()) ** 2).sum())
    tau = kendalltau(pred, true).statistic if pred.size > 1 else float("nan")
    return {
        "mae": float(np.abs(err).mean()),
        "rmse": float(np.sqrt((err**2).mean())),
        "r2": 1.0 - float((err**2).sum()) / ss_tot if ss_tot > 0 else float("nan"),
        "kendall_tau": float(tau),
        "n": int(pred.size),
    }
