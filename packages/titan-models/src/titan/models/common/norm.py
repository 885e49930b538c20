"""Root-mean-square layer normalization."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale and no bias.

    The statistics are taken in float32 whatever the input dtype, because the mean of squares
    of bf16 activations loses too much precision; the result is cast back before scaling.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim of `x` to unit RMS, then scale it."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the scale to one (the identity at init)."""
        nn.init.ones_(self.weight)
