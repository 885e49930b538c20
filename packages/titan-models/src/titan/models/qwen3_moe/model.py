"""The Qwen3-MoE decoder: Qwen3's blocks with the feed-forward of the sparse layers replaced
by the shared MoE block."""

from __future__ import annotations

import dataclasses

from titan.models.common.flavors import build_flavor
from titan.models.common.moe import MoE, MoEModelReports
from titan.models.common.plan import ShardingPlan
from titan.models.qwen3.model import Qwen3Model
from titan.models.qwen3_moe.args import QWEN3_MOE_FLAVORS, Qwen3MoeArgs
from torch import nn


class Qwen3MoeModel(MoEModelReports, Qwen3Model):
    """Qwen3-MoE decoder. Block i is Qwen3's (QK-norm attention); in an MoE layer (see
    `Qwen3MoeArgs.is_moe_layer`) its `feed_forward` is a `MoE`: softmax router
    (`feed_forward.router.gate`), top-k, optional renormalization, no shared experts,
    grouped experts `feed_forward.experts.{w1,w2,w3}` of shape [E, ...].
    """

    args: Qwen3MoeArgs

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args)

    def build_block(self, layer_id: int) -> nn.Module:
        """Qwen3's block, with an MoE feed-forward in the sparse layers."""
        block = super().build_block(layer_id)
        a = self.args
        if a.is_moe_layer(layer_id):
            block.feed_forward = MoE(
                a.dim, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok,
                score_func="softmax", norm_topk_prob=a.norm_topk_prob,
                load_balance_coeff=a.load_balance_coeff, aux_loss_coef=a.router_aux_loss_coef,
                force_load_balance=a.moe_force_load_balance,
            )
        return block

    def sharding_plan(self) -> ShardingPlan:
        """Qwen3's plan plus the MoE layers: routers replicated over TP, experts split by
        expert parallel (never tensor-parallel), the expert count EP must divide."""
        plan = super().sharding_plan()
        # MoE layers are computed whole on every TP rank (expert parallel splits the experts);
        # dense layers keep Qwen3's column/row-parallel feed-forward.
        styles = {k: v for k, v in plan.tensor_parallel.items() if k != "layers.*.feed_forward"}
        for i in range(self.args.n_layers):
            moe = self.args.is_moe_layer(i)
            styles[f"layers.{i}.feed_forward"] = "replicated_block" if moe else "block_input"
        return dataclasses.replace(
            plan,
            tensor_parallel={**styles, "layers.*.feed_forward.router.gate": "replicate"},
            expert_modules="layers.*.feed_forward.experts",
            expert_parallel_divisible={"n_experts": self.args.num_experts},
            auxiliary_loss_modules="layers.*.feed_forward.router" if self.args.router_aux_loss_coef > 0 else None,
        )


def build_qwen3_moe(flavor: str, **overrides: object) -> Qwen3MoeModel:
    """Build the `flavor` model (a key of `QWEN3_MOE_FLAVORS`), with fields of `Qwen3MoeArgs`
    replaced by `overrides` (e.g. `vocab_size=`, `n_layers=`, `num_experts=`).

    Modules are created under the active device context; use `with torch.device("meta"):`
    and then `to_empty` + `init_weights` to avoid allocating twice.
    """
    return build_flavor("qwen3_moe", QWEN3_MOE_FLAVORS, Qwen3MoeModel, flavor, overrides)
