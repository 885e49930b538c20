"""The DeepSeek-V3 decoder: the shared decoder with multi-head latent attention in every
block and the shared MoE block (sigmoid, group-limited, shared experts) after the first
`first_k_dense_replace` dense blocks."""

from __future__ import annotations

import dataclasses

import torch
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.feed_forward import FeedForward
from titan.models.common.flavors import build_flavor
from titan.models.common.mla import MultiHeadLatentAttention
from titan.models.common.moe import MoE, MoEModelReports
from titan.models.common.plan import ShardingPlan
from titan.models.common.rope import YarnScaling, rope_cache
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepseekV3Args
from torch import nn


class DeepseekV3Model(MoEModelReports, Decoder):
    """DeepSeek-V3 decoder. Block i: `attention` is a `MultiHeadLatentAttention`
    (`wq` or `wq_a`/`q_norm`/`wq_b`, `wkv_a`/`kv_norm`/`wkv_b`, `wo`); `feed_forward` is a
    SwiGLU for i < `first_k_dense_replace`, else a `MoE` (`router.gate`, grouped
    `experts.{w1,w2,w3}` [E, ...], `shared_experts.{w1,w2,w3}`, `expert_bias` = the Hub's
    `e_score_correction_bias`, always used for selection).

    The RoPE table covers the `qk_rope_head_dim` channels only; YaRN's softmax-scale
    multiplier goes to every block's attention.
    """

    args: DeepseekV3Args

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__(args)

    def build_block(self, layer_id: int) -> nn.Module:
        """An MLA block; dense SwiGLU or MoE feed-forward by `is_moe_layer`."""
        a = self.args
        multiplier = a.rope_scaling.softmax_scale_multiplier() if isinstance(a.rope_scaling, YarnScaling) else 1.0
        attention = MultiHeadLatentAttention(
            a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim, norm_eps=a.norm_eps, softmax_scale_multiplier=multiplier,
        )
        if a.is_moe_layer(layer_id):
            feed_forward: nn.Module = MoE(
                a.dim, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                n_shared_experts=a.n_shared_experts, score_func="sigmoid", n_groups=a.n_group,
                topk_groups=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                route_scale=a.routed_scaling_factor, load_balance_coeff=a.load_balance_coeff,
                always_use_expert_bias=True, aux_loss_coef=a.router_aux_loss_coef, aux_loss_kind="sequence",
                force_load_balance=a.moe_force_load_balance,
            )
        else:
            feed_forward = FeedForward(a.dim, a.ffn_hidden_dim)
        return TransformerBlock(a, attention=attention, feed_forward=feed_forward)

    def _make_rope_cache(self, device: torch.device | None) -> torch.Tensor:
        a = self.args
        return rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """What an inference cache holds per layer and token: one "head" of the normalized
        latent (`kv_lora_rank` channels, stored as K) and the rotated shared key part
        (`qk_rope_head_dim`, stored as V)."""
        return 1, self.args.kv_lora_rank, self.args.qk_rope_head_dim

    def attention_head_dim(self) -> float:
        """Scores run over nope + rope channels, the weighted sum over v channels: the mean."""
        a = self.args
        return (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) / 2

    def sharding_plan(self) -> ShardingPlan:
        """The decoder's plan with MLA's projections: query and key/value up-projections
        column-parallel (heads split over TP ranks), `wo` row-parallel, the low-rank
        down-projections and their norms replicated; MoE blocks computed whole on every TP
        rank with their experts split by expert parallel."""
        plan = super().sharding_plan()
        a = self.args
        styles = {k: v for k, v in plan.tensor_parallel.items()
                  if not k.startswith("layers.*.attention.") and k != "layers.*.feed_forward"}
        styles.update({
            "layers.*.attention.wq": "colwise",
            "layers.*.attention.wq_a": "replicate",
            "layers.*.attention.q_norm": "replicate",
            "layers.*.attention.wq_b": "colwise",
            "layers.*.attention.wkv_a": "replicate",
            "layers.*.attention.kv_norm": "replicate",
            "layers.*.attention.wkv_b": "colwise",
            "layers.*.attention.rope_key": "shared_by_heads",
            "layers.*.attention.wo": "rowwise",
            "layers.*.feed_forward.router.gate": "replicate",
        })
        for i in range(a.n_layers):
            styles[f"layers.{i}.feed_forward"] = "replicated_block" if a.is_moe_layer(i) else "block_input"
        return dataclasses.replace(
            plan,
            tensor_parallel=styles,
            tensor_parallel_divisible={"n_heads": a.n_heads, "ffn_hidden_dim": a.ffn_hidden_dim,
                                       "vocab_size": a.vocab_size},
            expert_modules="layers.*.feed_forward.experts",
            expert_parallel_divisible={"n_routed_experts": a.n_routed_experts},
            auxiliary_loss_modules="layers.*.feed_forward.router" if a.router_aux_loss_coef > 0 else None,
        )


def build_deepseek_v3(flavor: str, **overrides: object) -> DeepseekV3Model:
    """Build the `flavor` model (a key of `DEEPSEEK_V3_FLAVORS`), with fields of
    `DeepseekV3Args` replaced by `overrides` (e.g. `vocab_size=`, `n_layers=`).

    Modules are created under the active device context; use `with torch.device("meta"):`
    and then `to_empty` + `init_weights` to avoid allocating twice.
    """
    return build_flavor("deepseek_v3", DEEPSEEK_V3_FLAVORS, DeepseekV3Model, flavor, overrides)
