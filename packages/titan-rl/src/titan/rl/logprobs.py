"""Per-token log-probabilities, computed the same way by the generator's rescore mode and the
trainer's loss, so the two agree bit for bit on the same batch layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


def _scaled_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, V]`` logits in float32 divided by the temperature (0, greedy, counts as 1)."""
    scale = temperature if temperature > 0 else 1.0
    logits = logits.float()
    return logits / scale if scale != 1.0 else logits


def _replicated(value: torch.Tensor) -> torch.Tensor:
    """A small per-token result of a vocab-parallel reduction as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _logprob_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[target] of ``[n, V]`` rows. Vocab-sharded rows (a DTensor
    under loss parallel) take a vocab-parallel cross-entropy: only the per-token result
    crosses ranks, the vocabulary is never gathered."""
    rows = _scaled_rows(logits, temperature)
    if isinstance(rows, DTensor):
        return _replicated(-F.cross_entropy(rows, targets, reduction="none"))
    return torch.log_softmax(rows, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) of ``[n, V]`` rows (vocab-sharded rows: each rank sums
    its slice of the vocabulary, then the sums are reduced)."""
    rows = _scaled_rows(logits, temperature)
    if isinstance(rows, DTensor):
        logp = sharded_log_softmax(rows)
    else:
        logp = F.log_softmax(rows, dim=-1)
    return _replicated(-(logp.exp() * logp).sum(-1))


def sharded_log_softmax(rows: DTensor) -> DTensor:
    """log_softmax of vocab-sharded ``[n, V]`` rows from max, exp, sum and log, each of which
    DTensor differentiates as written. Not ``log_softmax``: inside ``loss_parallel()`` its
    backward passes the incoming gradient through unchanged, which is right only when
    ``nll_loss`` (whose backward then forms the whole softmax gradient) consumes the result;
    an entropy built on it got a wrong gradient (300% off on the final norm under TP 2)."""
    shifted = rows - rows.detach().amax(dim=-1, keepdim=True)
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


def _by_chunks(rows_fn, logits: torch.Tensor, targets: torch.Tensor | None, temperature: float,
               chunk_tokens: int) -> torch.Tensor:
    """``rows_fn`` over the positions of ``logits [..., V]`` (and ``targets [...]``),
    ``chunk_tokens`` positions at a time when > 0: with gradients each chunk is recomputed in
    backward instead of saved, so the float32 logits and log-softmax exist for one chunk at a
    time, never for the whole microbatch. Row-wise, so a chunk's values equal the one-piece
    ones."""
    shape = logits.shape[:-1]
    flat = logits.flatten(0, -2)
    args = () if targets is None else (targets.flatten(),)
    if chunk_tokens <= 0 or flat.shape[0] <= chunk_tokens:
        return rows_fn(flat, *args, temperature).view(shape)
    pieces = zip(flat.split(chunk_tokens), *(a.split(chunk_tokens) for a in args), strict=True)
    if torch.is_grad_enabled():
        out = [checkpoint(rows_fn, *piece, temperature, use_reentrant=False) for piece in pieces]
    else:
        out = [rows_fn(*piece, temperature) for piece in pieces]
    return torch.cat(out).view(shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   chunk_tokens: int = 0) -> torch.Tensor:
    """log_softmax(logits / T)[target] for every position: logits [..., V], targets [...]
    (long) -> [...] float32. `temperature` 0 (greedy) counts as 1; the softmax runs in
    float32. Vocab-sharded logits (a DTensor under tensor parallel with loss parallel, inside
    ``loss_parallel()``) are never gathered: a vocab-parallel cross-entropy per token, equal
    up to float32 summation order. ``chunk_tokens``: see :func:`_by_chunks`."""
    return _by_chunks(_logprob_rows, logits, targets, temperature, chunk_tokens)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, *, chunk_tokens: int = 0) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` at each position, float32 ``[...]``, from plain or
    vocab-sharded logits (never gathered), ``chunk_tokens`` positions at a time when > 0."""
    return _by_chunks(_entropy_rows, logits, None, temperature, chunk_tokens)


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


__all__ = ["pad_sequences", "token_entropy", "token_logprobs"]
