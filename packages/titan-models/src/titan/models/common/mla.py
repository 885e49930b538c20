"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values are expanded from a
low-rank latent shared by all heads, and RoPE acts only on a decoupled slice of each head.

Per token:

    q            = wq(x)                       or  wq_b(q_norm(wq_a(x)))     (q_lora_rank set)
    q_nope, q_pe = split(q per head, [qk_nope_head_dim, qk_rope_head_dim])
    c_kv, k_pe   = split(wkv_a(x), [kv_lora_rank, qk_rope_head_dim])    (k_pe: one for all heads)
    k_nope, v    = split(wkv_b(kv_norm(c_kv)) per head, [qk_nope_head_dim, v_head_dim])
    scores       = [q_nope, rope(q_pe)] . [k_nope, rope(k_pe)] * softmax_scale

RoPE rotates interleaved channel pairs, as DeepSeek's checkpoints are laid out (titan's
`apply_rope` convention), so the adapter moves no rows. An inference cache holds only what MLA
needs per token: the normalized latent `kv_norm(c_kv)` and the rotated `k_pe`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from titan.models.common.attention import ScaledDotProductAttention
from titan.models.common.init import SeededInit
from titan.models.common.kv_cache import LayerKVCache
from titan.models.common.norm import RMSNorm
from titan.models.common.rope import apply_rope
from torch import nn


class SharedByHeads(nn.Identity):
    """Marks a tensor every attention head reads whole, MLA's rotated key part: the identity
    here. A sharding plan that splits the heads over ranks gives it a style summing its
    gradient over those ranks (each rank's heads contribute only their part of it)."""


class MultiHeadLatentAttention(nn.Module):
    """MLA with optional low-rank queries (see the module docstring for the computation).

    Parameters: `wq` [H*(nope+rope), D] without a query rank, else `wq_a` [q_lora_rank, D],
    `q_norm` and `wq_b` [H*(nope+rope), q_lora_rank]; `wkv_a` [kv_lora_rank + rope, D],
    `kv_norm`, `wkv_b` [H*(nope+v), kv_lora_rank]; `wo` [D, H*v]. Head counts are read from
    the projection outputs, so tensor parallelism shards `wq`/`wq_b`/`wkv_b` column-wise and
    `wo` row-wise (heads split over ranks) and replicates the low-rank projections and norms;
    `rope_key` (`SharedByHeads`) marks the rotated key part every head reads.

    `softmax_scale_multiplier` (YaRN's mscale squared) is folded into the queries, so the
    inner kernel stays causal SDPA with its default 1/sqrt(nope+rope) scale: context
    parallelism can replace it like any other.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float,
        softmax_scale_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale_multiplier = softmax_scale_multiplier
        q_out = n_heads * self.qk_head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(dim, q_out, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.rope_key = SharedByHeads()
        self.inner_attention = ScaledDotProductAttention()

    @property
    def kv_width(self) -> int:
        """Elements per token of the keys and values handed to `inner_attention` (what
        context parallelism all-gathers): per head nope + rope for a key (the shared rope part
        broadcast to every head) and v_head_dim for a value; this rank's heads under TP."""
        heads = self.wkv_b.out_features // (self.qk_nope_head_dim + self.v_head_dim)
        return heads * (self.qk_head_dim + self.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """Attend over `x` [B, S, D] with RoPE rows `rope` ([S, rope] or [B, S, rope]); with
        `document_ids` [B, S], only within each token's document. With `kv_cache` (inference)
        the latents of the new tokens are appended and the queries attend over every cached
        slot under the cache's mask."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], dim=-1)
        if self.softmax_scale_multiplier != 1.0:
            q = q * self.softmax_scale_multiplier
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_pe = self.rope_key(apply_rope(k_pe.unsqueeze(2), rope))  # [B, S, 1, rope]: one for all heads
        if kv_cache is not None:
            # The cache stores [B, 1, S, .] latents and rotated key parts, never per-head K/V.
            latent, k_pe = kv_cache.update(latent.unsqueeze(1), k_pe.transpose(1, 2))
            latent, k_pe = latent.squeeze(1), k_pe.transpose(1, 2)
        k, v = self._expand(latent, k_pe)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=kv_cache.mask)
        elif document_ids is None:
            out = self.inner_attention(q, k, v)
        else:
            out = self.inner_attention(q, k, v, document_ids=document_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, S, H, nope+rope] and values [B, S, H, v] from the normalized
        latents [B, S, kv_lora_rank] and the shared rotated key parts [B, S, 1, rope]."""
        bsz, seqlen, _ = latent.shape
        kv = self.wkv_b(latent).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return k, v

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Truncated-normal projections (`std_out`, depth-scaled by the caller, for `wo`);
        norms start as the identity scale."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                init.trunc_normal_(linear.weight, std_in)
        init.trunc_normal_(self.wo.weight, std_out)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()


__all__ = ["MultiHeadLatentAttention"]
