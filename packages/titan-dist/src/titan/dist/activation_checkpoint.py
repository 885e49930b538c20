"""Activation checkpointing per transformer block: full, every k-th block, or per op."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from titan.dist.plan import blocks_of

# Outputs worth keeping: matmuls are the expensive ops, attention is expensive and its
# recompute would need the K/V exchange again, and re-running a collective costs bandwidth.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save matmul/attention/collective outputs, recompute the
    rest (elementwise ops and norms are cheap to redo and their outputs are large)."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def checkpoint_block(block: nn.Module, *, per_op: bool = False, context_fn: Callable | None = None,
                     preserve_rng_state: bool = False) -> nn.Module:
    """Make `block` recompute its activations in backward, in place: all of them, or with
    `per_op` what titan's per-op policy does not save (`context_fn`: another policy's
    selective-checkpoint contexts instead). `preserve_rng_state` stashes the RNG states before
    the forward and replays them in the recomputation, so random ops (dropout) draw the same
    values twice; titan's models draw none, so it is off by default (torchtitan's default).

    The block's `forward` is wrapped rather than the module itself, so parameter names
    (and therefore checkpoints and optimizer groups) are the same with and without AC.
    """
    inner: Callable = block.forward
    context_fn = context_fn or (_op_context if per_op else None)
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                          **kwargs, **kw)

    block.forward = forward
    return block


def apply_activation_checkpointing(model: nn.Module, mesh, config) -> nn.Module:
    """Apply `ActivationCheckpointConfig` to every block of the model's layer container.

    "full" checkpoints every block; "selective" checkpoints blocks 0, k, 2k, ... with
    k = `config.checkpoint_every()`, either whole (recompute all) or per op (`selective_op`).
    `mesh` is unused (AC is local) but kept for the `apply_*` signature.
    """
    if config.mode == "none":
        return model
    every = config.checkpoint_every()
    per_op = config.mode == "selective" and config.selective_op
    for index, (_, block) in enumerate(blocks_of(model)):
        if index % every == 0:
            checkpoint_block(block, per_op=per_op, preserve_rng_state=config.preserve_rng_state)
    return model
