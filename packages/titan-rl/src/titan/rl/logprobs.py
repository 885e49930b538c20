"""Per-token log-probabilities, computed the same way by the generator's rescore mode and the
trainer's loss, so the two agree bit for bit on the same batch layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[target] for every position: logits [..., V], targets [...]
    (long) -> [...] float32. `temperature` 0 (greedy) counts as 1; the softmax runs in float32."""
    scale = temperature if temperature > 0 else 1.0
    logits = logits.float()
    if scale != 1.0:
        logits = logits / scale
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _replicated(value: torch.Tensor) -> torch.Tensor:
    """A small per-token result of a vocab-parallel reduction as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def sharded_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`token_logprobs` of vocab-sharded logits (a DTensor under tensor parallel with
    loss parallel, inside ``loss_parallel()``), without gathering the vocabulary: a
    vocab-parallel cross-entropy per token, whose per-token result is all that crosses
    ranks. Equal to :func:`token_logprobs` up to float32 summation order."""
    scale = temperature if temperature > 0 else 1.0
    flat = logits.float().flatten(0, 1)
    if scale != 1.0:
        flat = flat / scale
    logp = -F.cross_entropy(flat, targets.flatten(), reduction="none")
    return _replicated(logp).view(targets.shape)


def sharded_token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` per position of vocab-sharded logits, reduced over
    the shards (each rank sums its slice of the vocabulary), float32 ``[B, S]``."""
    scale = temperature if temperature > 0 else 1.0
    flat = logits.float().flatten(0, 1)
    if scale != 1.0:
        flat = flat / scale
    logp = F.log_softmax(flat, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return _replicated(entropy).view(logits.shape[:-1])


def pad_sequences(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad prompt + completion rows into `input_ids` [B, L] and return, with them,
    `targets` [B, L] (the next token, pad where none) and `completion_mask` [B, L] (True at
    positions whose next token is a completion token: the positions that score it).
    """
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    targets = torch.full_like(input_ids, pad_id)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor(prompt + completion, dtype=torch.long)
        input_ids[row, : len(seq)] = seq
        targets[row, : len(seq) - 1] = seq[1:]
        mask[row, len(prompt) - 1 : len(seq) - 1] = True
    return input_ids, targets, mask


__all__ = ["pad_sequences", "sharded_token_entropy", "sharded_token_logprobs", "token_logprobs"]
