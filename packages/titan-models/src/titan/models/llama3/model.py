"""The Llama 3 decoder, as plain single-device PyTorch."""

from __future__ import annotations

import dataclasses
import math

import torch
from titan.models.common.accounting import count_params, dense_flops_per_token
from titan.models.common.attention import GroupedQueryAttention
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import SeededInit
from titan.models.common.norm import RMSNorm
from titan.models.common.plan import ShardingPlan
from titan.models.common.rope import rope_cache
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from torch import nn

_INIT_STD = 0.02


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, then `h + feed_forward(norm(h))`."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Run the block on hidden states `x` [B, S, D] with RoPE rows `rope`."""
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init: SeededInit, std_out: float) -> None:
        """Init projections (`std_out` for the ones writing into the residual) and norms."""
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init, _INIT_STD, std_out)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(init, _INIT_STD, std_out)


class Llama3Model(nn.Module):
    """Llama 3 decoder: embedding, a ModuleDict of blocks, final norm, output projection.

    A pipeline stage deletes blocks from `layers` and sets `tok_embeddings` (not first stage)
    or `norm`/`output` (not last stage) to None; `forward` then takes or returns hidden states.
    """

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: it is derived from args, so checkpoints need not carry it.
        self.register_buffer("rope_cache", self._make_rope_cache(None), persistent=False)

    def _make_rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, S] (or hidden states [B, S, D] without `tok_embeddings`) to logits
        [B, S, V] (or hidden states without `output`).

        `positions` ([S] or [B, S]) are absolute token positions for RoPE; None means 0..S-1.
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self._rope_rows(h.shape[1], positions)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def _rope_rows(self, seq_len: int, positions: torch.Tensor | None) -> torch.Tensor:
        """RoPE rows for this forward: a slice for 0..S-1, else a gather of `positions`."""
        if positions is not None:
            return self.rope_cache[positions]
        if seq_len > self.rope_cache.shape[0]:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len {self.args.max_seq_len}; "
                "build the model with max_seq_len >= the training seq_len"
            )
        return self.rope_cache[:seq_len]

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, *, seed: int | None = None) -> None:
        """Fill every parameter and buffer (e.g. after `to_empty`).

        Values depend only on `seed` and each parameter's name (see `SeededInit`), so a
        sharded, tensor-parallel or pipelined copy starts from exactly the weights of a single
        process; `seed=None` draws it from torch's global generator. `buffer_device` is where
        the RoPE cache goes (default: where the buffer is now). Modules a pipeline stage set to
        None are skipped.
        """
        init = SeededInit(self, seed)
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._make_rope_cache(device)
        if self.tok_embeddings is not None:
            # Unit variance: the first norm rescales anyway, and a tiny std would leave the
            # residual stream dominated by the blocks' outputs.
            init.normal_(self.tok_embeddings.weight, std=1.0)
        # Projections writing into the residual stream are shrunk with depth so the stream's
        # variance stays O(1) however many blocks add to it.
        std_out = _INIT_STD / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(init, std_out)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            init.trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count of this module (of this stage, for a pipeline stage)."""
        return count_params(self, self.tok_embeddings if exclude_embedding else None)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at `seq_len`, for the blocks this module holds."""
        a = self.args
        n_params = self.num_params(exclude_embedding=True)
        return dense_flops_per_token(n_params, len(self.layers), a.n_heads, a.head_dim, seq_len)

    def sharding_plan(self) -> ShardingPlan:
        """Declarative TP/SP, FSDP, PP and CP plan for `titan.dist`."""
        return ShardingPlan(
            tensor_parallel={
                "tok_embeddings": "embedding",
                "layers.*.attention_norm": "norm",
                "layers.*.attention": "block_input",
                "layers.*.attention.wq": "colwise",
                "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise",
                "layers.*.attention.wo": "rowwise",
                "layers.*.ffn_norm": "norm",
                "layers.*.feed_forward": "block_input",
                "layers.*.feed_forward.w1": "colwise",
                "layers.*.feed_forward.w2": "rowwise",
                "layers.*.feed_forward.w3": "colwise",
                "norm": "norm",
                "output": "output",
            },
            # Embedding and output are separate units: each is a vocab x dim matrix as large
            # as several blocks, and separate units let FSDP prefetch them independently.
            fsdp_units=("tok_embeddings", "layers.*", "output"),
        )


def build_llama3(flavor: str, **overrides: object) -> Llama3Model:
    """Build the `flavor` model (a key of `LLAMA3_FLAVORS`), with fields of `Llama3Args`
    replaced by `overrides` (e.g. `vocab_size=`, `max_seq_len=`, `n_layers=`).

    Modules are created under the active device context; use `with torch.device("meta"):`
    and then `to_empty` + `init_weights` to avoid allocating twice.
    """
    if flavor not in LLAMA3_FLAVORS:
        raise ValueError(
            f"unknown llama3 flavor {flavor!r}; choose one of: {', '.join(LLAMA3_FLAVORS)}"
        )
    fields = {f.name for f in dataclasses.fields(Llama3Args)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown Llama3Args fields {unknown}; valid fields: {', '.join(sorted(fields))}"
        )
    return Llama3Model(dataclasses.replace(LLAMA3_FLAVORS[flavor], **overrides))
