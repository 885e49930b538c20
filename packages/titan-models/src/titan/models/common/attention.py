"""Grouped-query self-attention with a swappable inner attention kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from titan.models.common.init import SeededInit
from titan.models.common.rope import apply_rope
from torch import nn


class ScaledDotProductAttention(nn.Module):
    """Causal grouped-query SDPA: q [B, H, S, Dh] over k/v [B, Hkv, S, Dh].

    Query head h reads kv head h // (H // Hkv), which keeps each group on one TP shard. SDPA's
    `enable_gqa` does the grouping without materializing repeated K/V (less memory, and no
    gradient sums over the copies in backward).

    Kept as its own module so context parallelism can replace it (the plan names it in
    `attention_modules`) without touching the projections around it.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q over k/v; returns [B, H, S, Dh]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class GroupedQueryAttention(nn.Module):
    """Multi-head attention where groups of query heads share one key/value head.

    Head counts are inferred from the projection outputs (`view(B, S, -1, head_dim)`), so tensor
    parallelism can shard wq/wk/wv column-wise and wo row-wise without changing this code.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.inner_attention = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Attend over `x` [B, S, D] with RoPE rows `rope` ([S, Dh] or [B, S, Dh])."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.inner_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Truncated-normal init; `std_out` (wo) is depth-scaled by the caller."""
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, std_in)
        init.trunc_normal_(self.wo.weight, std_out)
