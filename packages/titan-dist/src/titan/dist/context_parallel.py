"""Context parallel: the sequence split over ranks, with an exact attention exchange.

Load balancing (head-tail): the sequence is cut into 2*cp chunks and CP rank r holds chunks
r and 2*cp-1-r. Under a causal mask early tokens attend to little and late tokens to a lot,
so pairing an early chunk with a late one gives every rank the same attention work.

Attention exchange (all-gather): each rank all-gathers K and V of the whole sequence (the
autograd version, whose backward reduce-scatters the K/V gradients back to their owners) and
restores the global token order. Each of its two query chunks then attends only to the keys it
can see -- the prefix of the sequence up to the chunk's end -- under a causal mask aligned to
the lower right (`torch.nn.attention.bias.causal_lower_right`): the fused kernels (flash,
memory-efficient) take that mask without materializing it and skip the blocks above the
diagonal, so a rank computes the causal half of its attention, never an [S / cp, S] mask. The
result is exactly single-device attention. It uses only all-gather / reduce-scatter, so it
runs on gloo (CPU) and NCCL (CUDA) alike.

Packed documents (`--training.document_mask`): the model hands its inner attention the local
shard's `document_ids`; this attention all-gathers them too (integers, no gradient) and lets
each local query read the keys that are causally visible AND of its own document, so document
masking composes with CP exactly: on CUDA in half precision through the FlashAttention varlen
kernel (each document's run of queries a sequence over its document's keys, no mask built:
`varlen_chunk_attention`), elsewhere with a boolean mask per chunk over its visible keys. RoPE positions are data then (restarting per document):
`shard_batch_dict_for_context_parallel` shards them with the rest of the batch.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from titan.dist.plan import match_modules, sharding_plan


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp_size) that CP rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_positions(seq_len: int, cp_rank: int, cp_size: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """Absolute positions [seq_len / cp] of this rank's tokens (for RoPE and the mask)."""
    chunk = seq_len // (2 * cp_size)
    a, b = chunk_ids(cp_rank, cp_size)
    pos = torch.arange(seq_len, device=device)
    return torch.cat([pos[a * chunk:(a + 1) * chunk], pos[b * chunk:(b + 1) * chunk]])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's head-tail share of `t` along `seq_dim`."""
    seq_len = t.shape[seq_dim]
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x "
                         f"context_parallel_degree = {2 * cp_size}")
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    a, b = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=seq_dim).contiguous()


def shard_batch_for_context_parallel(cp_mesh: DeviceMesh | None, *tensors: torch.Tensor,
                                     seq_dim: int = 1):
    """Shard a batch (e.g. input_ids, labels) along the sequence for context parallel.

    Returns (sharded tensors..., positions): pass `positions` to the model's forward so
    RoPE uses the true token positions. Without a CP mesh the tensors come back whole and
    positions is None.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return (*tensors, None)
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    seq_len = tensors[0].shape[seq_dim]
    out = [shard_sequence(t, rank, size, seq_dim) for t in tensors]
    return (*out, shard_positions(seq_len, rank, size, tensors[0].device))


def shard_batch_dict_for_context_parallel(cp_mesh: DeviceMesh | None,
                                          batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's share of a batch dict: every tensor shaped [B, S, ...] like
    `batch["input_ids"]` is head-tail sharded along the sequence (input_ids, labels, loss
    masks, `positions`, `document_ids`, ...); anything else passes through unchanged.

    The result always carries `positions` under CP: the batch's own (per-document) positions
    sharded, or else the absolute positions [S / cp] of this rank's tokens. Without a CP mesh
    the batch comes back as a new dict of the same tensors.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return dict(batch)
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    reference = batch["input_ids"]
    bs = tuple(reference.shape[:2])
    out = {key: shard_sequence(t, rank, size, 1)
           if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == bs else t
           for key, t in batch.items()}
    if out.get("positions") is None:
        out["positions"] = shard_positions(bs[1], rank, size, reference.device)
    return out


def _unshuffle(gathered: torch.Tensor, cp_size: int, dim: int = 2) -> torch.Tensor:
    """[.., cp*local, ..] gathered along `dim` in rank order -> global sequence order."""
    chunks = gathered.chunk(2 * cp_size, dim=dim)  # rank r contributed chunks (r, 2cp-1-r)
    order = [None] * (2 * cp_size)
    for r in range(cp_size):
        a, b = chunk_ids(r, cp_size)
        order[a], order[b] = chunks[2 * r], chunks[2 * r + 1]
    return torch.cat(order, dim=dim)


class ContextParallelAttention(nn.Module):
    """Drop-in for a causal SDPA `inner_attention(q, k, v, document_ids=None)` on
    [B, H, S_local, Dh] inputs whose sequence is head-tail sharded over `cp_mesh`
    (`document_ids` [B, S_local] sharded alike)."""

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        self.cp_mesh = cp_mesh

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        size = self.cp_mesh.size()
        # all_gather concatenates on dim 0: put the sequence there and back.
        flat = t.transpose(0, 2).contiguous()
        full = funcol.all_gather_tensor_autograd(flat, gather_dim=0, group=self.cp_mesh)
        return _unshuffle(full.transpose(0, 2), size)

    def _gather_document_ids(self, document_ids: torch.Tensor) -> torch.Tensor:
        """[B, S_local] shard -> [B, S] ids of the whole sequence (no autograd: integers)."""
        flat = document_ids.transpose(0, 1).contiguous()
        full = funcol.all_gather_tensor(flat, gather_dim=0, group=self.cp_mesh)
        return _unshuffle(full.transpose(0, 1), self.cp_mesh.size(), dim=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Local queries over the gathered keys: causal by sequence index and, given
        `document_ids`, within each query's document."""
        k_ids = self._gather_document_ids(document_ids) if document_ids is not None else None
        return attend_local_chunks(q, self._gather(k), self._gather(v), self.cp_mesh.get_local_rank(),
                                   self.cp_mesh.size(), document_ids=document_ids, key_document_ids=k_ids)


def visible_keys(chunk_index: int, chunk_len: int) -> int:
    """Keys a query chunk attends to under the causal mask: the sequence up to its chunk's end."""
    return (chunk_index + 1) * chunk_len


def _lower_right_causal(queries: int, keys: int) -> CausalBias:
    """The causal mask of `queries` rows that end where the `keys` end, as the tensor subclass
    the fused SDPA kernels read without materializing it. Built outside any dispatch mode
    (selective AC's policy, memory and FLOP counters): the subclass cannot be created inside one."""
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


@functools.cache
def _varlen_kernel():
    """torch's FlashAttention varlen entry point with causal GQA (`window_size`, `enable_gqa`),
    or None on builds without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if {"window_size", "enable_gqa"} <= inspect.signature(varlen_attn).parameters.keys() else None


def _runs_start(ids: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: where a run of one id starts in each row."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def varlen_chunk_attention(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, chunk_start: int,
                           document_ids: torch.Tensor, key_document_ids: torch.Tensor,
                           kernel=None) -> torch.Tensor:
    """Document-causal attention of one query chunk `q` [B, H, C, Dh] (global positions
    `chunk_start` to `chunk_start + C`, documents `document_ids` [B, C]) over the whole
    sequence's `k_full` / `v_full` [B, H_kv, S, Dh] (documents `key_document_ids` [B, S])
    through a varlen kernel: no mask is built. Each run of one document among the queries is
    a sequence of its own, over its document's keys up to its last query, causal from the
    lower right (as the kernel aligns queries shorter than their keys). Only the keys from
    the start of each row's first document to the chunk's end are copied (at most S per row).

    `kernel` defaults to torch's `varlen_attn` (tests pass a reference implementation)."""
    kernel = kernel or _varlen_kernel()
    bsz, heads, chunk, head_dim = q.shape
    end = chunk_start + chunk
    device = q.device
    # Where each row's first query document starts among the keys (it may start earlier).
    key_ids = key_document_ids[:, :end]
    index = torch.arange(end, device=device)
    first = torch.where(_runs_start(key_ids)[:, :chunk_start + 1], index[:chunk_start + 1], 0).amax(dim=1)
    key_lengths = end - first  # [B]: keys each row's segments read, one contiguous range per row
    # Query segments (flattened over rows) and, from their bounds, the keys' segments: a row's
    # first segment reads from its document's start, the others from their own first query.
    q_starts = _runs_start(document_ids).flatten().nonzero().flatten()
    rows, offsets = q_starts // chunk, q_starts % chunk
    row_base = torch.cat([key_lengths.new_zeros(1), key_lengths.cumsum(0)])  # keys before each row
    k_starts = row_base[rows] + torch.where(offsets == 0, 0, chunk_start + offsets - first[rows])
    cu_q = torch.cat([q_starts, q_starts.new_tensor([bsz * chunk])]).to(torch.int32)
    cu_k = torch.cat([k_starts, row_base[-1:]]).to(torch.int32)
    # The keys those segments read, packed row after row: [sum(key_lengths), H_kv, Dh].
    rows_of_keys = torch.repeat_interleave(torch.arange(bsz, device=device), key_lengths)
    positions = torch.arange(int(row_base[-1]), device=device) - row_base[rows_of_keys] + first[rows_of_keys]

    def packed(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2)[rows_of_keys, positions]

    flat_q = q.transpose(1, 2).reshape(bsz * chunk, heads, head_dim)
    out = kernel(flat_q, packed(k_full), packed(v_full), cu_q, cu_k, chunk, end, window_size=(-1, 0),
                 enable_gqa=k_full.shape[1] != heads)
    return out.reshape(bsz, chunk, heads, out.shape[-1]).transpose(1, 2)


def uses_varlen_chunks(q: torch.Tensor) -> bool:
    """Whether packed documents run through the varlen kernel under CP: CUDA, half precision
    and a torch that ships it; elsewhere each chunk builds its boolean mask."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel() is not None


def attend_local_chunks(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, cp_rank: int, cp_size: int,
                        *, document_ids: torch.Tensor | None = None,
                        key_document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries `q` [B, H, S / cp, Dh] (its head and tail
    chunks, in that order) over the whole sequence's `k_full` / `v_full` [B, H_kv, S, Dh] in
    global order; with `document_ids` [B, S / cp] and `key_document_ids` [B, S], only within
    each query's document. Each chunk attends to its visible prefix alone, so the work is the
    causal half and equal on every rank: (2 cp + 1) / 2 chunks of keys per chunk of queries."""
    chunk_len = q.shape[2] // 2
    outs = []
    for half, chunk_index in enumerate(chunk_ids(cp_rank, cp_size)):
        rows = slice(half * chunk_len, (half + 1) * chunk_len)
        visible = visible_keys(chunk_index, chunk_len)
        keys, values = k_full[:, :, :visible], v_full[:, :, :visible]
        if document_ids is not None and uses_varlen_chunks(q):
            outs.append(varlen_chunk_attention(q[:, :, rows], k_full, v_full, visible - chunk_len,
                                               document_ids[:, rows], key_document_ids))
            continue
        if document_ids is None:
            mask = _lower_right_causal(chunk_len, visible)
        else:
            causal = torch.ones(chunk_len, visible, dtype=torch.bool, device=q.device).tril(visible - chunk_len)
            same_doc = document_ids[:, rows, None] == key_document_ids[:, None, :visible]
            mask = (causal[None] & same_doc).unsqueeze(1)  # [B, 1, chunk, visible]
        outs.append(F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask,
                                                   enable_gqa=keys.shape[1] != q.shape[1]))
    return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, config) -> nn.Module:
    """Replace every attention kernel named by `plan.attention_modules` with the exact
    context-parallel attention over the 1-D "cp" `mesh`. The replaced kernels are assumed to
    be causal SDPA with the default scale (the contract's `inner_attention`)."""
    plan = sharding_plan(model)
    pattern = getattr(plan, "attention_modules", "layers.*.attention.inner_attention")
    found = match_modules(model, pattern)
    if not found and any(True for _ in getattr(model, "layers", {}).values()):
        raise ValueError(f"context parallel found no attention module matching {pattern!r}")
    for fqn, _ in found:
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ContextParallelAttention(mesh))
    model.register_forward_pre_hook(_positions_filler(mesh), with_kwargs=True)
    return model


def _positions_filler(cp_mesh: DeviceMesh):
    """A forward pre-hook that passes the model its shard's absolute `positions` when the
    caller did not: a pipeline schedule calls every stage with activations only, and RoPE must
    still see where this rank's head-tail chunks sit in the full sequence."""

    def fill_positions(module: nn.Module, args: tuple, kwargs: dict):
        given = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if given is not None or not args:
            return None
        size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        local_len = args[0].shape[1]
        kwargs = {**kwargs, "positions": shard_positions(local_len * size, rank, size, args[0].device)}
        return args, kwargs

    return fill_positions
