"""Token-level cross-entropy normalized by the global number of valid label tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value for positions that carry no target (padding)."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over valid labels, computed in float32.

    Summing (rather than averaging) per microbatch lets the caller divide by the token count
    of the whole global batch, so every token weighs the same whatever microbatch or rank it
    landed in.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of label positions that contribute to the loss."""
    return (labels != IGNORE_INDEX).sum()


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or gradient norm is NaN/inf; the run stops before the optimizer
    step so the weights stay finite."""
