"""A dense pre-norm decoder shared by the model families (Llama 3, Qwen3, ...).

A family configures it, never copies it: it passes an args object with the fields of
`DecoderArgs` and overrides `build_block` (another block, e.g. QK-norm attention or an MoE
feed-forward) or `sharding_plan` (extra tensor-parallel styles) where it differs.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from titan.models.common.accounting import count_params, dense_flops_per_token
from titan.models.common.attention import GroupedQueryAttention
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import SeededInit
from titan.models.common.kv_cache import KVCache, LayerKVCache
from titan.models.common.moe import inactive_expert_params
from titan.models.common.norm import RMSNorm
from titan.models.common.plan import ShardingPlan
from titan.models.common.rope import RopeScaling, rope_cache
from torch import nn

INIT_STD = 0.02
"""Std of the truncated-normal init of the projections reading the residual stream."""


class DecoderArgs(Protocol):
    """The fields `Decoder` and `TransformerBlock` read from a family's args dataclass."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_seq_len: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size."""


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, then `h + feed_forward(norm(h))`.

    `qk_norm` adds per-head RMSNorms on q and k (Qwen3); without it the block is Llama's.
    A family passes its own `attention` (same call signature as `GroupedQueryAttention`,
    e.g. multi-head latent attention) or `feed_forward` (e.g. an MoE) to replace the defaults.
    """

    def __init__(
        self,
        args: DecoderArgs,
        *,
        qk_norm: bool = False,
        attention: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        if attention is None:
            attention = GroupedQueryAttention(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                qk_norm_eps=args.norm_eps if qk_norm else None,
            )
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """Run the block on hidden states `x` [B, S, D] with RoPE rows `rope`; `document_ids`
        [B, S] keep attention within each packed document; `kv_cache` is this block's view of
        an inference `KVCache`."""
        if kv_cache is None:
            h = x + self.attention(self.attention_norm(x), rope, document_ids)
        else:
            h = x + self.attention(self.attention_norm(x), rope, document_ids, kv_cache=kv_cache)
        return h + self._feed_forward(self.ffn_norm(h), document_ids)

    def _feed_forward(self, x: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """The feed-forward; one that routes tokens (an MoE) learns which are padding
        (negative document ids) so they stay out of its balancing statistics."""
        if document_ids is not None and getattr(self.feed_forward, "accepts_token_mask", False):
            return self.feed_forward(x, token_mask=document_ids >= 0)
        return self.feed_forward(x)

    def init_weights(self, init: SeededInit, std_out: float) -> None:
        """Init projections (`std_out` for the ones writing into the residual) and norms."""
        self.attention_norm.reset_parameters()
        self.attention.init_weights(init, INIT_STD, std_out)
        self.ffn_norm.reset_parameters()
        self.feed_forward.init_weights(init, INIT_STD, std_out)


class Decoder(nn.Module):
    """Decoder-only LM: embedding, a ModuleDict of blocks, final norm, output projection.

    A pipeline stage deletes blocks from `layers` and sets `tok_embeddings` (not first stage)
    or `norm`/`output` (not last stage) to None; `forward` then takes or returns hidden states.

    With `args.tie_word_embeddings`, `output.weight` IS `tok_embeddings.weight` (one Parameter,
    named `tok_embeddings.weight` by `named_parameters`; `state_dict` lists it under both names).

    With `args.num_labels` n >= 1 (a family whose args have the field), `output` is a score
    head, `Linear(dim, n)`: the forward returns n scores per position, and a sequence's score is
    the one at its last token (Hugging Face's `...ForSequenceClassification`; a reward model
    has n = 1). The head is never tied: `tie_word_embeddings` then has no effect.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        if self.num_labels < 0:
            raise ValueError(f"num_labels must be >= 0 (0: a language model), got {self.num_labels}")
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, self.num_labels or args.vocab_size, bias=False)
        self._tie_output()
        # Not persistent: it is derived from args, so checkpoints need not carry it.
        self.register_buffer("rope_cache", self._make_rope_cache(None), persistent=False)

    @property
    def num_labels(self) -> int:
        """Scores per position of a sequence-classification head; 0 for a language model."""
        return int(getattr(self.args, "num_labels", 0))

    @property
    def ties_output(self) -> bool:
        """Whether the output projection shares the embedding's matrix (never a score head)."""
        return bool(self.args.tie_word_embeddings) and not self.num_labels

    def build_block(self, layer_id: int) -> nn.Module:
        """Block `layer_id` (families override this to change the block, e.g. per layer)."""
        return TransformerBlock(self.args)

    def _tie_output(self) -> None:
        """Make the output projection use the embedding's Parameter (tied models only)."""
        if self.ties_output and self.tok_embeddings is not None and self.output is not None:
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
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Token ids [B, S] (or hidden states [B, S, D] without `tok_embeddings`) to logits
        [B, S, V] (or hidden states without `output`).

        `positions` ([S] or [B, S]) are token positions for RoPE; None means 0..S-1. With
        packed documents they restart at 0 at each document start. `document_ids` [B, S]
        (equal ids = same document) restrict attention to causal AND same-document pairs;
        None is plain causal attention over the whole row. A negative id marks padding: an
        MoE layer leaves it out of its load-balancing statistics and aux loss.

        `kv_cache` (inference): the tokens are appended to the cache and attend over
        everything cached before them; positions default to each row's count of real
        (non-padding) tokens so far. Not combinable with `document_ids`.
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids cannot be combined with kv_cache (left-pad instead)")
            cache_positions = kv_cache.begin(h.shape[1])
            rope = self._rope_rows(h.shape[1], cache_positions if positions is None else positions)
            for index, layer in enumerate(self.layers.values()):
                h = layer(h, rope, kv_cache=kv_cache.layer(index))
        else:
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
        std_out = INIT_STD / math.sqrt(2 * self.args.n_layers)
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
        if not (self.ties_output and self.tok_embeddings is not None and self.output is not None):
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

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: `num_params` less the routed experts it is not sent to
        (equal to `num_params` for a dense model)."""
        return self.num_params(exclude_embedding) - inactive_expert_params(self)

    def attention_head_dim(self) -> float:
        """Channels of each of attention's two matmuls per head (scores, weighted sum), for
        the FLOP count; a family whose values are narrower than its keys returns the mean."""
        return self.args.head_dim

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, K channels, V channels) an inference `KVCache` holds per layer and token."""
        return self.args.n_kv_heads, self.args.head_dim, self.args.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at `seq_len`: 6 x the active non-embedding parameters +
        attention, for the blocks this module holds."""
        n_params = self.num_active_params(exclude_embedding=True)
        if self._check_tie():
            # Excluding the embedding excluded the shared matrix, but the output matmul with it
            # still runs: count its FLOPs like an untied output's.
            n_params += self.output.weight.numel()
        return dense_flops_per_token(n_params, len(self.layers), self.args.n_heads, self.attention_head_dim(), seq_len)

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
                # A score head's few columns are not split: each rank reads the whole sequence.
                "output": "score" if self.num_labels else "output",
            },
            # Embedding and output are separate units: each is a vocab x dim matrix as large
            # as several blocks, and separate units let FSDP prefetch them independently. A
            # tied matrix cannot be in two units: it stays in the root unit (gathered for the
            # whole forward, which needs it at both ends anyway).
            fsdp_units=("layers.*",)
            if self.ties_output
            else ("tok_embeddings", "layers.*", "output"),
            tensor_parallel_divisible={
                "n_heads": self.args.n_heads,
                "n_kv_heads": self.args.n_kv_heads,
                "ffn_hidden_dim": self.args.ffn_hidden_dim,
                "vocab_size": self.args.vocab_size,
            },
            tied_parameters=(("tok_embeddings.weight", "output.weight"),)
            if self.ties_output
            else (),
        )
