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

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the block on hidden states `x` [B, S, D] with RoPE rows `rope`; `document_ids`
        [B, S] keep attention within each packed document."""
        h = x + self.attention(self.attention_norm(x), rope, document_ids)
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

    With `args.tie_word_embeddings`, `output.weight` IS `tok_embeddings.weight` (one Parameter,
    named `tok_embeddings.weight` by `named_parameters`; `state_dict` lists it under both names).
    """

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_output()
        # Not persistent: it is derived from args, so checkpoints need not carry it.
        self.register_buffer("rope_cache", self._make_rope_cache(None), persistent=False)

    def _tie_output(self) -> None:
        """Make the output projection use the embedding's Parameter (tied models only)."""
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # nn.Module._apply (behind to_empty, to, cuda, half) gives each module a new Parameter
        # when it cannot convert in place (meta -> a real device, plain or DTensor), which
        # would leave the output with a copy of its own: share the embedding's again. Under
        # FSDP2 this runs before FSDP re-reads its sharded parameters, so it sees the tie.
        module = super()._apply(fn, recurse)
        self._tie_output()
        return module

    def _make_rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, S] (or hidden states [B, S, D] without `tok_embeddings`) to logits
        [B, S, V] (or hidden states without `output`).

        `positions` ([S] or [B, S]) are token positions for RoPE; None means 0..S-1. With
        packed documents they restart at 0 at each document start. `document_ids` [B, S]
        (equal ids = same document) restrict attention to causal AND same-document pairs;
        None is plain causal attention over the whole row.
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self._rope_rows(h.shape[1], positions)
        for layer in self.layers.values():
            h = layer(h, rope) if document_ids is None else layer(h, rope, document_ids)
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
        tied = self._check_tie()
        if self.tok_embeddings is not None and not tied:
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
            # A tied matrix is drawn once, here, with the output's init: unit-variance rows
            # would make the first logits' std sqrt(dim) (the final norm leaves unit-RMS
            # states), a loss far above log(vocab). The cost of the small rows on the input
            # side is milder: blocks' outputs weigh more in the early residual stream, but
            # every block normalizes its input. dim**-0.5 is ~0.02 at 1B/3B widths, the
            # initializer range the published tied checkpoints use.
            init.trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def _check_tie(self) -> bool:
        """Whether this module holds a tied embedding/output pair; raises when the args ask
        for a tie that a transformation broke (two different Parameters would train apart)."""
        if not (self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None):
            return False
        if self.output.weight is not self.tok_embeddings.weight:
            raise RuntimeError(
                "tie_word_embeddings is set but output.weight is no longer tok_embeddings.weight; "
                "a transformation replaced one of them (re-share it, or build the model untied)"
            )
        return True

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count of this module (of this stage, for a pipeline stage); a tied
        embedding/output matrix counts once, and `exclude_embedding` excludes it."""
        return count_params(self, self.tok_embeddings if exclude_embedding else None)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at `seq_len`, for the blocks this module holds."""
        a = self.args
        n_params = self.num_params(exclude_embedding=True)
        if self._check_tie():
            # Excluding the embedding excluded the shared matrix, but the output matmul with it
            # still runs: count its FLOPs like an untied output's.
            n_params += self.output.weight.numel()
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
            # as several blocks, and separate units let FSDP prefetch them independently. A
            # tied matrix cannot be in two units: it stays in the root unit (gathered for the
            # whole forward, which needs it at both ends anyway).
            fsdp_units=("layers.*",)
            if self.args.tie_word_embeddings
            else ("tok_embeddings", "layers.*", "output"),
            tensor_parallel_divisible={
                "n_heads": self.args.n_heads,
                "n_kv_heads": self.args.n_kv_heads,
                "ffn_hidden_dim": self.args.ffn_hidden_dim,
                "vocab_size": self.args.vocab_size,
            },
            tied_parameters=(("tok_embeddings.weight", "output.weight"),)
            if self.args.tie_word_embeddings
            else (),
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
