"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from titan.models.common.init import SeededInit
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU MLP: `w2(silu(w1(x)) * w3(x))`, no biases.

    w1/w3 are column-parallel and w2 row-parallel under tensor parallelism, so the hidden
    activation never needs a collective.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to the last dim of `x`."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Truncated-normal init; `std_out` (w2) is depth-scaled by the caller."""
        for linear, std in ((self.w1, std_in), (self.w3, std_in), (self.w2, std_out)):
            init.trunc_normal_(linear.weight, std)
