"""Conversion between titan Qwen3-MoE state dicts and Hugging Face `Qwen3MoeForCausalLM` ones.

Hub checkpoints store each expert separately (`mlp.experts.{e}.gate_proj.weight` [I, D],
`up_proj` [I, D], `down_proj` [D, I]) and the router as `mlp.gate.weight` [E, D]; titan holds
a layer's experts stacked (`feed_forward.experts.w1`/`w3` [E, I, D], `w2` [E, D, I]). Everything
else (attention with QK norms, dense layers, embeddings) is Qwen3's mapping.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import torch
from titan.models.common.hf_config import hf_architecture
from titan.models.common.hub_experts import ExpertStacker, split_experts
from titan.models.qwen3.adapter import Qwen3StateDictAdapter
from titan.models.qwen3_moe.args import Qwen3MoeArgs

_TITAN_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_TITAN_ROUTER = re.compile(r"layers\.(\d+)\.feed_forward\.router\.gate\.weight")
_TITAN_BIAS = re.compile(r"layers\.(\d+)\.feed_forward\.expert_bias")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    """Maps Qwen3-MoE weights to and from Hugging Face `Qwen3MoeForCausalLM` (the Hub's
    per-expert layout), splitting and stacking the experts.

    `to_hf` maps keys one by one (a single stacked expert tensor gives its E per-expert keys),
    so the engine's streaming export works. `from_hf` needs every expert of a layer it sees
    (a whole checkpoint, as `titan.ckpt` loads it) and adds a zero `expert_bias` per MoE layer:
    the Hub model has no selection bias. `to_hf` drops the bias, so a model trained with
    titan's bias balancing (`load_balance_coeff`) routes slightly differently once exported;
    a warning says so when the bias is not zero.
    """

    args: Qwen3MoeArgs

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """titan names/layout -> HF names/layout."""
        rest, out = {}, {}
        for key, value in state_dict.items():
            if (m := _TITAN_EXPERTS.fullmatch(key)) is not None:
                out.update(split_experts(*m.groups(), value))
            elif (m := _TITAN_ROUTER.fullmatch(key)) is not None:
                out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = value
            elif _TITAN_BIAS.fullmatch(key) is not None:
                if torch.count_nonzero(value):
                    warnings.warn(
                        f"{key} is not zero (load-balancing bias); Hugging Face Qwen3-MoE has no "
                        "selection bias, so the export routes without it",
                        stacklevel=2,
                    )
            else:
                rest[key] = value
        return {**super().to_hf(rest), **out}

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """HF names/layout -> titan names/layout."""
        rest, out = {}, {}
        experts = ExpertStacker(self.args.num_experts, "num_experts")
        for key, value in state_dict.items():
            if experts.add(key, value):
                continue
            if (m := _HF_ROUTER.fullmatch(key)) is not None:
                out[f"layers.{m.group(1)}.feed_forward.router.gate.weight"] = value
                out[f"layers.{m.group(1)}.feed_forward.expert_bias"] = torch.zeros(value.shape[0], dtype=torch.float32)
            else:
                rest[key] = value
        return {**super().from_hf(rest), **out, **experts.stacked()}

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A `config.json` dict for `Qwen3MoeForCausalLM` (`transformers.Qwen3MoeConfig(**d)` accepts it)."""
        a = self.args
        cfg = super().hf_config(torch_dtype)
        cfg.update(
            architectures=[hf_architecture(a, "Qwen3MoeForCausalLM")],
            model_type="qwen3_moe",
            moe_intermediate_size=a.moe_intermediate_size,
            num_experts=a.num_experts,
            num_experts_per_tok=a.num_experts_per_tok,
            norm_topk_prob=a.norm_topk_prob,
            decoder_sparse_step=a.decoder_sparse_step,
            mlp_only_layers=list(a.mlp_only_layers),
            router_aux_loss_coef=a.router_aux_loss_coef,
            output_router_logits=False,
        )
        return cfg

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]) -> Qwen3MoeArgs:
        """`Qwen3MoeArgs` for a HF Qwen3-MoE `config.json` dict (the Hub's `num_experts` or
        transformers 5's `num_local_experts`)."""
        dense = super().args_from_hf_config(cfg)
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
        # Qwen3MoeConfig's default is untied (Qwen3Config's ties).
        fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
        return Qwen3MoeArgs(
            **fields,
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.0),
        )
