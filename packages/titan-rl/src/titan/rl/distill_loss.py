"""The distillation loss of ``titan gkd``: the generalized Jensen-Shannon divergence between the
student's and the teacher's next-token distributions, over the whole vocabulary, per token.

GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"; TRL's ``GKDTrainer``) interpolates between the two KL directions with
``beta``. With ``S`` the student's and ``T`` the teacher's distribution at one position and
``M = (1 - beta) S + beta T`` their mixture::

    JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)

Both ends of that family vanish (``M`` becomes the distribution it is compared with), so, as
TRL does, ``beta = 0`` is the forward KL ``KL(T || S)`` itself (supervised distillation: the
student covers every token the teacher likes) and ``beta = 1`` the reverse KL ``KL(S || T)``
(mode seeking: the student stays where the teacher is confident). The loss is summed over
labelled positions; the loop divides by the global batch's labelled tokens as it does the SFT
loss, which is TRL's ``batchmean`` over the tokens of the whole global batch.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from titan.rl.logprobs import sharded_log_softmax
from titan.train.loss import IGNORE_INDEX
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint


def check_beta(beta: float) -> None:
    """Refuse an interpolation weight outside [0, 1], naming the flag."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"--gkd.beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q)`` of each row, from log-probabilities over the last dimension. A token
    ``P`` gives no mass adds nothing, whatever ``Q`` gives it (``0 log 0 = 0``)."""
    return torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), 0.0).sum(-1)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence of each row of ``[tokens, vocab]`` logits (module docstring), in float32
    (float64 stays float64); the teacher's side carries no gradient."""
    check_beta(beta)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = F.log_softmax(student_logits.to(dtype), dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
    return _jsd_of_log_probs(student, teacher, beta)


def _jsd_of_log_probs(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence of each row from the two models' log-probabilities (plain tensors, or
    DTensors sharded over the vocabulary: every op here is elementwise or a sum over it)."""
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    mixture = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def _summed_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence summed over the rows."""
    return generalized_jsd(student, teacher, beta).sum()


@functools.cache
def _compiled_jsd():
    """:func:`_summed_jsd` under torch.compile, made once per process."""
    return torch.compile(_summed_jsd)


def gkd_loss_sum(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, *, beta: float,
                 vocab_size: int | None = None, chunk_tokens: int = 0, compiled: bool = False) -> torch.Tensor:
    """The generalized JSD summed over the positions whose label is not ``IGNORE_INDEX``:
    ``logits`` and ``teacher_logits`` ``[B, S, V]``, ``labels`` ``[B, S]``.

    ``vocab_size``: the tokenizer's ids, the columns compared (each model's distribution
    renormalized over them): a model's vocabulary may be padded past the tokenizer's, and
    the two models' paddings differ. None: every column (the two must then have as many).

    Only labelled positions are computed. ``chunk_tokens > 0`` takes that many of them at a
    time, each chunk recomputed in backward instead of saved (``--training.loss_chunk_tokens``):
    the float32 log-softmaxes of both models then exist for one chunk at a time. ``compiled``
    (``--compile.components loss``) runs each piece under torch.compile (the casts,
    log-softmaxes and the mixture fused)."""
    vocab = vocab_size or logits.shape[-1]
    if teacher_logits.shape[:-1] != logits.shape[:-1] or min(teacher_logits.shape[-1], logits.shape[-1]) < vocab:
        raise ValueError(f"the teacher's logits {tuple(teacher_logits.shape)} and the student's "
                         f"{tuple(logits.shape)} do not both cover the {vocab} token ids compared")
    labelled = labels.flatten() != IGNORE_INDEX
    student = logits.flatten(0, 1)[labelled][:, :vocab]
    teacher = teacher_logits.flatten(0, 1)[labelled][:, :vocab]
    summed = _compiled_jsd() if compiled else _summed_jsd
    if chunk_tokens <= 0 or student.shape[0] <= chunk_tokens:
        return summed(student, teacher, beta)
    chunks = zip(student.split(chunk_tokens), teacher.split(chunk_tokens), strict=True)
    return sum(checkpoint(summed, s, t, beta, use_reentrant=False) for s, t in chunks)


_OUTSIDE = -1e30
"""The logit given to a column outside the compared token ids in the vocab-parallel loss (a
shard cannot slice them off): its probability underflows to exactly 0 in float32."""


def _vocab_parallel_summed_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, mesh: Any,
                               kept: torch.Tensor) -> torch.Tensor:
    """The divergence summed over ``[n, V / tp]`` rows of this rank's vocabulary columns
    (``kept``: those among the compared ids), the same value on every rank. Each log-softmax
    reduces its max and sum over the ranks, the divergence its per-rank sum: only per-row
    numbers cross ranks."""
    dtype = torch.promote_types(student.dtype, torch.float32)  # float32 (float64 stays float64)
    student = DTensor.from_local(student.to(dtype).masked_fill(~kept, _OUTSIDE), mesh, [Shard(1)], run_check=False)
    teacher = DTensor.from_local(teacher.detach().to(dtype).masked_fill(~kept, _OUTSIDE), mesh, [Shard(1)],
                                 run_check=False)
    jsd = _jsd_of_log_probs(sharded_log_softmax(student), sharded_log_softmax(teacher), beta)
    return jsd.sum().full_tensor()


def vocab_parallel_gkd_loss_sum(logits: DTensor, teacher_logits: torch.Tensor, labels: torch.Tensor, *, beta: float,
                                vocab_size: int | None = None, teacher_sharded: bool = False,
                                chunk_tokens: int = 0) -> torch.Tensor:
    """:func:`gkd_loss_sum` of vocab-sharded student ``logits`` (tensor parallel with loss
    parallel: a DTensor ``[B, S, V]`` sharded evenly over the last dimension on a 1-D mesh),
    never gathering the vocabulary. ``teacher_logits``: with ``teacher_sharded`` this rank's
    columns of the teacher's (``[B, S, V / tp]``, a sharded teacher of the same vocabulary),
    else the teacher's whole (this rank's columns are taken). Columns at or past ``vocab_size`` count as outside
    both distributions, as the plain loss slices them off; equal to it up to float32
    summation order."""
    check_beta(beta)
    mesh = logits.device_mesh
    local = logits.to_local()
    width = local.shape[-1]
    start = mesh.get_local_rank() * width
    vocab = vocab_size or logits.shape[-1]
    if teacher_sharded:
        if teacher_logits.shape[-1] != width:
            raise ValueError(f"the teacher's vocabulary shard {tuple(teacher_logits.shape)} is not the student's "
                             f"({tuple(local.shape)})")
    else:  # the teacher's whole vocabulary: this rank's columns
        if teacher_logits.shape[-1] < vocab:
            raise ValueError(f"the teacher's logits {tuple(teacher_logits.shape)} do not cover the {vocab} token ids "
                             "compared")
        teacher_logits = teacher_logits[..., start:start + width]
        teacher_logits = F.pad(teacher_logits, (0, width - teacher_logits.shape[-1]))  # past its vocabulary
    kept = torch.arange(start, start + width, device=local.device) < vocab
    labelled = labels.flatten() != IGNORE_INDEX
    student = local.flatten(0, 1)[labelled]
    teacher = teacher_logits.flatten(0, 1)[labelled]
    summed = functools.partial(_vocab_parallel_summed_jsd, beta=beta, mesh=mesh, kept=kept)
    if chunk_tokens <= 0 or student.shape[0] <= chunk_tokens:
        return summed(student, teacher)
    chunks = zip(student.split(chunk_tokens), teacher.split(chunk_tokens), strict=True)
    return sum(checkpoint(summed, s, t, use_reentrant=False) for s, t in chunks)


def vocab_parallel_logits(logits: torch.Tensor) -> bool:
    """Whether ``logits`` are sharded evenly over the vocabulary on a 1-D mesh (tensor
    parallel with loss parallel), as :func:`vocab_parallel_gkd_loss_sum` takes them."""
    return (isinstance(logits, DTensor) and logits.device_mesh.ndim == 1 and len(logits.placements) == 1
            and isinstance(logits.placements[0], Shard) and logits.placements[0].dim in (-1, logits.dim() - 1)
            and logits.shape[-1] % logits.device_mesh.size() == 0)


__all__ = ["check_beta", "generalized_jsd", "gkd_loss_sum", "vocab_parallel_gkd_loss_sum", "vocab_parallel_logits"]
