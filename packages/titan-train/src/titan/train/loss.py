"""Token-level cross-entropy normalized by the global number of valid label tokens.

Two token losses (``--training.loss_type``): ``nll``, the negative log-likelihood, and ``dft``
(Dynamic Fine-Tuning, Wu et al. 2025, "On the Generalization of SFT"; TRL's SFT
``loss_type="dft"``): each token's NLL weighted by the model's own probability of it,
detached, ``-sg(p) log p``, so tokens the model finds very unlikely no longer dominate the
gradient (SFT's gradient read as a policy gradient with an implicit ``1 / p`` reward weight,
rectified).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value for positions that carry no target (padding)."""


LOSS_TYPES: tuple[str, ...] = ("nll", "dft")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 0,
                      compiled: bool = False, loss_type: str = "nll") -> torch.Tensor:
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

    ``compiled`` (``--compile.components loss``) runs each piece under torch.compile: the
    float32 cast, log-softmax and gather fused, the softmax recomputed in backward instead of
    kept. Vocab-sharded logits stay eager (loss parallel's cross-entropy is DTensor dispatch).

    ``loss_type="dft"`` weighs each token's cross-entropy by its detached probability
    (module docstring), in the same pieces.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"--training.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    plain = _summed_cross_entropy if loss_type == "nll" else _summed_dft_cross_entropy
    summed = _compiled(plain) if compiled and not isinstance(logits, DTensor) else plain
    if chunk_tokens <= 0 or flat_labels.numel() <= chunk_tokens:
        return summed(flat_logits, flat_labels)
    chunks = zip(flat_logits.split(chunk_tokens), flat_labels.split(chunk_tokens), strict=True)
    return sum(checkpoint(summed, chunk, chunk_labels, use_reentrant=False) for chunk, chunk_labels in chunks)


def next_token_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], *, chunk_tokens: int = 0,
                    compiled: bool = False, loss_type: str = "nll") -> torch.Tensor:
    """The ``LossFn`` of pretraining, SFT, validation and RL's SFT warm-up: summed
    cross-entropy over the valid ``labels`` of the microbatch (``chunk_tokens``, ``compiled``,
    ``loss_type``: see :func:`cross_entropy_sum`)."""
    return cross_entropy_sum(logits, batch["labels"], chunk_tokens=chunk_tokens, compiled=compiled,
                             loss_type=loss_type)


def supervised_loss(*, chunk_tokens: int = 0, compiled: bool = False, loss_type: str = "nll"):
    """``next_token_loss`` with the run's options bound (``--training.loss_chunk_tokens``,
    ``--compile.components loss``, ``--training.loss_type``): the loss function the loops
    call; validation keeps ``nll`` (a perplexity whatever the training loss)."""
    return functools.partial(next_token_loss, chunk_tokens=chunk_tokens, compiled=compiled, loss_type=loss_type)


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Float32 cross-entropy of ``[tokens, vocab]`` logits, summed over valid labels."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _summed_dft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Float32 cross-entropy of ``[tokens, vocab]`` logits, each valid token's weighted by its
    detached probability ``exp(-ce)``, summed (padding's cross-entropy is 0)."""
    per_token = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (per_token * torch.exp(-per_token.detach())).sum()


@functools.cache
def _compiled(loss):
    """``loss`` (a summed cross-entropy of this module) under torch.compile, made once per
    process (its graphs are cached per shape and dtype like any compiled function's)."""
    return torch.compile(loss)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of label positions that contribute to the loss."""
    return (labels != IGNORE_INDEX).sum()


class NonFiniteLossError(RuntimeError):
    """Raised when the loss or gradient norm is NaN/inf; the run stops before the optimizer
    step so the weights stay finite."""
