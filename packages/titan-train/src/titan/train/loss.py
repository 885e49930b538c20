"""Token-level cross-entropy normalized by the global number of valid label tokens."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value for positions that carry no target (padding)."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 0) -> torch.Tensor:
    """Sum of per-token cross-entropy over valid labels, computed in float32.

    Summing (rather than averaging) per microbatch lets the caller divide by the token count
    of the whole global batch, so every token weighs the same whatever microbatch or rank it
    landed in.

    ``chunk_tokens > 0`` computes it ``chunk_tokens`` positions at a time, each chunk
    recomputed in backward instead of saved: the float32 copy of the logits and the
    log-softmax autograd keeps (each ``[tokens, vocab]`` float32, the largest activations of
    a big-vocabulary model) then exist for one chunk at a time, never for the whole
    microbatch. Vocab-sharded logits (loss parallel) are chunked the same way, each chunk a
    vocab-parallel cross-entropy. The value equals the unchunked one up to float32 summation
    order.
    """
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    if chunk_tokens <= 0 or flat_labels.numel() <= chunk_tokens:
        return _summed_cross_entropy(flat_logits, flat_labels)
    chunks = zip(flat_logits.split(chunk_tokens), flat_labels.split(chunk_tokens), strict=True)
    return sum(checkpoint(_summed_cross_entropy, chunk, chunk_labels, use_reentrant=False)
               for chunk, chunk_labels in chunks)


def next_token_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], *, chunk_tokens: int = 0) -> torch.Tensor:
    """The ``LossFn`` of pretraining, SFT, validation and RL's SFT warm-up: summed
    cross-entropy over the valid ``labels`` of the microbatch (``chunk_tokens``: see
    :func:`cross_entropy_sum`)."""
    return cross_entropy_sum(logits, batch["labels"], chunk_tokens=chunk_tokens)


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Float32 cross-entropy of ``[tokens, vocab]`` logits, summed over valid labels."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of label positions that contribute to the loss."""
    return (labels != IGNORE_INDEX).sum()


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or gradient norm is NaN/inf; the run stops before the optimizer
    step so the weights stay finite."""
