"""Grouped-query self-attention with a swappable inner attention kernel."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from titan.models.common.init import SeededInit
from titan.models.common.kv_cache import LayerKVCache
from titan.models.common.norm import RMSNorm
from titan.models.common.rope import apply_rope
from torch import nn


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [B, 1, S, S] from `document_ids` [B, S]: True where a query may
    read a key, i.e. the key is not later in the row (causal) and carries the query's
    document id. It has no head axis, so it serves any number of (tensor-parallel sharded)
    heads; every query reads at least itself, so no row is fully masked.
    """
    seqlen = document_ids.shape[1]
    index = torch.arange(seqlen, device=document_ids.device)
    causal = index[:, None] >= index[None, :]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (causal[None] & same_doc).unsqueeze(1)


def document_segments(document_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative segment bounds (int32, [N + 1]) of the flattened [B, S] batch, where a
    segment is a run of one document id inside one row: the `cu_seqlens` of varlen kernels.
    """
    bsz, seqlen = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    flat_starts = starts.flatten().nonzero().flatten()
    end = torch.tensor([bsz * seqlen], device=document_ids.device, dtype=flat_starts.dtype)
    return torch.cat([flat_starts, end]).to(torch.int32)


@functools.cache
def _varlen_kernel():
    """torch's FlashAttention varlen entry point, or None on builds without it or with an
    older signature (before `window_size` / `enable_gqa`, which causal GQA needs)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"window_size", "enable_gqa"} <= params.keys() else None


def use_varlen_kernel(q: torch.Tensor) -> bool:
    """Whether document masking runs on the varlen kernel: CUDA, half precision (the
    FlashAttention kernel computes in fp16/bf16 only) and a torch that ships it. Everywhere
    else it runs SDPA with the boolean mask of `document_causal_mask`."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel() is not None


def varlen_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, kernel=None
) -> torch.Tensor:
    """Document-causal attention through a varlen kernel: the batch is flattened into one
    token stream and every (row, document) run becomes its own causal sequence, so no
    [S, S] mask is built and masked-out blocks cost nothing. Returns [B, H, S, Dh].

    `kernel` defaults to torch's `varlen_attn` (tests pass a reference implementation).
    """
    kernel = kernel or _varlen_kernel()
    bsz, n_heads, seqlen, head_dim = q.shape
    cu_seqlens = document_segments(document_ids)

    def flat(t: torch.Tensor) -> torch.Tensor:  # [B, H, S, Dh] -> [B*S, H, Dh]
        return t.transpose(1, 2).reshape(bsz * seqlen, t.shape[1], head_dim)

    # max_q = max_k = seqlen: an upper bound on every segment, so no host sync is needed.
    out = kernel(
        flat(q), flat(k), flat(v), cu_seqlens, cu_seqlens, seqlen, seqlen,
        window_size=(-1, 0), enable_gqa=k.shape[1] != n_heads,
    )
    return out.reshape(bsz, seqlen, n_heads, head_dim).transpose(1, 2)


class ScaledDotProductAttention(nn.Module):
    """Causal grouped-query SDPA: q [B, H, S, Dh] over k/v [B, Hkv, S, Dh].

    Query head h reads kv head h // (H // Hkv), which keeps each group on one TP shard. SDPA's
    `enable_gqa` does the grouping without materializing repeated K/V (less memory, and no
    gradient sums over the copies in backward).

    With `document_ids` [B, S] (packed documents), a query reads only keys of its own
    document: on CUDA in half precision through the FlashAttention varlen kernel, elsewhere
    through SDPA with a boolean [B, 1, S, S] mask. Without them it is plain `is_causal` SDPA.

    Kept as its own module so context parallelism can replace it (the plan names it in
    `attention_modules`) without touching the projections around it.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal (and, given `document_ids`, same-document) attention; returns [B, H, S, Dh]."""
        gqa = k.shape[1] != q.shape[1]
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if use_varlen_kernel(q):
            return varlen_document_attention(q, k, v, document_ids)
        mask = document_causal_mask(document_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class GroupedQueryAttention(nn.Module):
    """Multi-head attention where groups of query heads share one key/value head.

    Head counts are inferred from the projection outputs (`view(B, S, -1, head_dim)`), so tensor
    parallelism can shard wq/wk/wv column-wise and wo row-wise without changing this code.

    `head_dim` is independent of `dim` (Qwen3: 16 heads x 128 on a width of 1024). With
    `qk_norm_eps` set, q and k each get a per-head RMSNorm over `head_dim` (`q_norm`,
    `k_norm`, shared by all heads) after the head reshape and before RoPE, as Qwen3 does;
    None (Llama) creates no norm modules, so parameters and outputs are those of plain GQA.
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qk_norm_eps: float | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.inner_attention = ScaledDotProductAttention()

    @property
    def kv_width(self) -> int:
        """Elements per token of the keys and values handed to `inner_attention` (what
        context parallelism all-gathers): 2 x n_kv_heads x head_dim, this rank's share under TP."""
        return self.wk.out_features + self.wv.out_features

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """Attend over `x` [B, S, D] with RoPE rows `rope` ([S, Dh] or [B, S, Dh]); with
        `document_ids` [B, S], only within each token's document. With `kv_cache` (one
        layer's view of a `KVCache`, for inference), the new keys/values are appended to the
        cache and the queries attend over every cached slot under the cache's mask."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            # Inference only: SDPA over the cache with its causal + padding mask; the
            # training path below is untouched.
            k, v = kv_cache.update(k, v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=kv_cache.mask, enable_gqa=k.shape[1] != q.shape[1]
            )
        elif document_ids is None:  # the bare (q, k, v) call keeps 3-argument kernels valid
            out = self.inner_attention(q, k, v)
        else:
            out = self.inner_attention(q, k, v, document_ids=document_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Truncated-normal init; `std_out` (wo) is depth-scaled by the caller; QK norms
        start as the identity scale."""
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std_in)
        init.trunc_normal_(self.wo.weight, std_out)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
