"""Parameter and FLOP accounting shared by the model families."""

from __future__ import annotations

from torch import nn


def count_params(module: nn.Module, exclude: nn.Module | None = None) -> int:
    """Number of parameter elements in `module`, minus those of submodule `exclude`.

    `numel()` of a DTensor is its global size, so the count is the same before and after
    sharding; meta tensors count too, so sizes can be checked without allocating.
    """
    total = sum(p.numel() for p in module.parameters())
    if exclude is not None:
        total -= sum(p.numel() for p in exclude.parameters())
    return total


def dense_flops_per_token(
    non_embedding_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token of a dense decoder (forward + backward = 3x forward).

    6 * N for the matmuls against weights, plus 12 * L * H * Dh * S for the attention scores
    and the weighted sum (2 matmuls, x2 for multiply-add, x3 for training). Causal masking is
    ignored, as is customary, so MFU numbers stay comparable with other frameworks.
    """
    return 6.0 * non_embedding_params + 12.0 * n_layers * n_heads * head_dim * seq_len
