"""ELIS regression head: an MLP from the feature vector to remaining output tokens.

ELIS §4.2: 8 FC layers, ReLU, hidden 1024, scalar output; clamped at >= 0 at inference (our choice).
CHOICE here: hidden 512 by default so the shipped artifact stays under 10 MB (8 layers × 1024 would be
~30 MB); ``hidden``, ``depth`` and ``dropout`` (after each hidden ReLU, training only: without it
the head memorises AlpacaEval's 805 prompts within one epoch) are settings. Inputs are standardised
with training statistics kept as buffers; the output is in units of ``target_scale`` tokens for
well-conditioned optimisation.

Cap class (optional, ``cap_tokens`` set; not in ELIS): a served model whose answers often run to the
token cap (SmolLM2-135M repeats itself until it hits 512 in half its greedy answers) has a remaining
length that is exactly ``cap − generated`` for those answers. A small MLP over the feature vector's
scalars only (position, prompt length and the distinct-token ratios that flag a loop) gives P(cap),
and the prediction is ``P·(cap − g) + (1 − P)·min(ŷ, cap − g)`` with ŷ the regression head's. Why the
scalars alone: on the smollm2 held-out prompts the 8-layer head, fed 1152 embedding dimensions, hardly
uses the ratios (AUC of its prediction for a cap hit 0.53-0.60 at 100-450 tokens generated, against
0.67-0.92 for the 4-chunk distinct ratio by itself).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tessera.predictor.features import GENERATED_SCALE, N_SCALARS, SCALAR_GENERATED

CAP_HIDDEN = 32  # width of the cap classifier's two hidden layers (CHOICE: 1.3k weights for 6 inputs)


class LengthHead(nn.Module):
    """Standardise, then ``depth`` Linear layers with ReLU between them; output in tokens."""

    def __init__(
        self,
        in_dim: int,
        hidden: int = 512,
        depth: int = 8,
        target_scale: float = 100.0,
        dropout: float = 0.0,
        cap_tokens: int | None = None,
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
        self.cap_tokens: int | None = None
        self.cap: nn.Sequential | None = None
        if cap_tokens is not None:
            self.add_cap_class(cap_tokens)

    def add_cap_class(self, cap_tokens: int) -> None:
        """Add the (untrained) cap classifier. The trainer adds it after the regression head is trained,
        so the regression head's initialisation and dropout draws are those of a head without one."""
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens}")
        self.cap_tokens = cap_tokens
        self.cap = nn.Sequential(
            nn.Linear(N_SCALARS, CAP_HIDDEN),
            nn.ReLU(),
            nn.Linear(CAP_HIDDEN, CAP_HIDDEN),
            nn.ReLU(),
            nn.Linear(CAP_HIDDEN, 1),
        )

    def set_normalisation(self, x: torch.Tensor) -> None:
        """Standardisation statistics from the training features."""
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0).clamp_min(1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted remaining tokens divided by ``target_scale`` (unclamped, for training)."""
        return self.net((x - self.mean) / self.std).squeeze(-1)

    def cap_logit(self, x: torch.Tensor) -> torch.Tensor:
        """Logit of P(the answer runs to the cap), from the standardised scalar features only."""
        if self.cap is None:
            raise ValueError("this head has no cap class (trained without cap_tokens)")
        scalars = (x[:, -N_SCALARS:] - self.mean[-N_SCALARS:]) / self.std[-N_SCALARS:]
        return self.cap(scalars).squeeze(-1)

    @torch.inference_mode()
    def predict_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted remaining tokens, clamped at 0 (with a cap class: the blend in the module doc)."""
        pred = (self.forward(x) * self.target_scale).clamp_min(0.0)
        if self.cap_tokens is None:
            return pred
        generated = torch.round(x[:, -N_SCALARS + SCALAR_GENERATED] * GENERATED_SCALE)
        to_cap = (self.cap_tokens - generated).clamp_min(0.0)
        p = torch.sigmoid(self.cap_logit(x))
        return p * to_cap + (1.0 - p) * torch.minimum(pred, to_cap)
