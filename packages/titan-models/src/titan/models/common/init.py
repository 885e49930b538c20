"""Weight-initialization helpers shared by the blocks."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_init(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at 3 std, in place: avoids rare huge weights at init.

    Uses `nn.init`, which works on plain tensors and on DTensor shards alike.
    """
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
