"""ELIS regression head: an MLP from the feature vector to remaining output tokens.

ELIS §4.2: 8 FC layers, ReLU, hidden 1024, scalar output; clamped at >= 0 at inference (our choice).
CHOICE here: hidden 512 by default so the shipped artifact stays under 10 MB (8 layers × 1024 would be
~30 MB); ``hidden``, ``depth`` and ``dropout`` (after each hidden ReLU, training only: without it
the head memorises AlpacaEval's 805 prompts within one epoch) are settings. Inputs are standardised
with training statistics kept as buffers; the output is in units of ``target_scale`` tokens for
well-conditioned optimisation.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


class LengthHead(nn.Module):
    """Standardise, then ``depth`` Linear layers with ReLU between them; output in tokens."""

    def __init__(
        self,
        in_dim: int,
        hidden: int = 512,
        depth: int = 8,
        target_scale: float = 100.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if depth < 2:
            raise ValueError(f"head depth must be >= 2 layers, got {depth}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"head dropout must be in [0, 1), got {dropout}")
        dims = [in_dim] + [hidden] * (depth - 1)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, 1))  # no activation after the last layer (spec CHOICE)
        self.net = nn.Sequential(*layers)
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))
        self.target_scale = target_scale

    def set_normalisation(self, x: torch.Tensor) -> None:
        """Standardisation statistics from the training features."""
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0).clamp_min(1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted remaining tokens divided by ``target_scale`` (unclamped, for training)."""
        return self.net((x - self.mean) / self.std).squeeze(-1)

    @torch.inference_mode()
    def predict_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted remaining tokens, clamped at 0."""
        return (self.forward(x) * self.target_scale).clamp_min(0.0)
