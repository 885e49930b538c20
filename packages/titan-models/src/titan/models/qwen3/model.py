"""The Qwen3 dense decoder: the shared decoder with QK-norm attention and explicit head_dim."""

from __future__ import annotations

import dataclasses

from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.flavors import build_flavor
from titan.models.common.plan import ShardingPlan
from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from torch import nn


class Qwen3Model(Decoder):
    """Qwen3 decoder: Llama 3's structure (`Decoder`) whose blocks normalize q and k per head
    (`layers.i.attention.q_norm` / `k_norm`, RMSNorms over head_dim) before RoPE.

    Parameter names, pipeline stages, tied embeddings, init, accounting and the sharding plan
    are the shared decoder's; the plan adds the per-head norms as "head_norm" TP modules.
    """

    args: Qwen3Args

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)

    def build_block(self, layer_id: int) -> nn.Module:
        """A pre-norm block whose attention has per-head QK norms."""
        return TransformerBlock(self.args, qk_norm=True)

    def sharding_plan(self) -> ShardingPlan:
        """The decoder's plan plus the per-head q/k norms, which see TP-sharded heads."""
        plan = super().sharding_plan()
        head_norms = {
            "layers.*.attention.q_norm": "head_norm",
            "layers.*.attention.k_norm": "head_norm",
        }
        return dataclasses.replace(plan, tensor_parallel={**plan.tensor_parallel, **head_norms})


def build_qwen3(flavor: str, **overrides: object) -> Qwen3Model:
    """Build the `flavor` model (a key of `QWEN3_FLAVORS`), with fields of `Qwen3Args`
    replaced by `overrides` (e.g. `vocab_size=`, `max_seq_len=`, `n_layers=`).

    Modules are created under the active device context; use `with torch.device("meta"):`
    and then `to_empty` + `init_weights` to avoid allocating twice.
    """
    return build_flavor("qwen3", QWEN3_FLAVORS, Qwen3Model, flavor, overrides)
