"""Conversion between titan DeepSeek-V3 state dicts and Hugging Face `DeepseekV3ForCausalLM`
ones (the Hub's layout: per-expert keys, `e_score_correction_bias`).

RoPE: DeepSeek's checkpoints lay the rotary channels out in interleaved pairs
(`rope_interleave: true`, every release), which is titan's convention, so no row moves. The
router's selection bias is titan's `expert_bias` under its Hub name. Multi-token-prediction
weights (the release's extra `model.layers.{num_hidden_layers}.*` block) are skipped on import
with a warning: titan trains the next-token model only. The release's fp8 weights (one scale
per 128 x 128 block, `quantization_config`) are dequantized to bf16 on import.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from titan.models.common.hf_config import (
    HF_LM_HEAD_KEY,
    HF_SCORE_KEY,
    OUTPUT_KEY,
    ScoreHeadKeys,
    hf_architecture,
    hf_config_differences,
    hf_num_labels,
    label_config,
)
from titan.models.common.hub_experts import ExpertStacker, split_experts
from titan.models.common.rope import YarnScaling
from titan.models.deepseek_v3.args import DeepseekV3Args

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# titan suffix (after "layers.i.") -> HF suffix (after "model.layers.i.").
_IN_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    # Dense blocks' SwiGLU and the MoE blocks' shared experts.
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
}
_FROM_HF_BLOCK = {hf: titan for titan, hf in _IN_BLOCK.items()}
_FROM_HF_TOP = {hf: titan for titan, hf in _TOP_LEVEL.items()}
_TITAN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_TITAN_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_DERIVED = re.compile(r".*rotary_emb\.inv_freq")
# DeepSeek-V3's <｜begin▁of▁sentence｜> and <｜end▁of▁sentence｜>, written when the vocabulary holds them.
_BOS_ID, _EOS_ID = 0, 1


class DeepseekV3StateDictAdapter(ScoreHeadKeys):
    """Maps DeepSeek-V3 weights to and from Hugging Face `DeepseekV3ForCausalLM`.

    `to_hf` maps keys one by one (a stacked expert tensor gives its E per-expert keys), so the
    engine's streaming export and a pipeline stage's partial state dict work. `from_hf` needs
    every expert of a layer it sees (a whole checkpoint, as `titan.ckpt` loads it). With a score
    head (`args.num_labels`) it is `DeepseekV3ForSequenceClassification` (`ScoreHeadKeys`).
    """

    def __init__(self, args: DeepseekV3Args) -> None:
        self.args = args
        self.skipped: list[str] = []

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """titan names/layout -> HF names/layout."""
        out = {}
        for key, value in state_dict.items():
            if (m := _TITAN_EXPERTS.fullmatch(key)) is not None:
                out.update(split_experts(*m.groups(), value))
                continue
            block = _TITAN_BLOCK.fullmatch(key)
            if key == OUTPUT_KEY:
                out[self.output_to_hf()] = value
            elif block is None and key in _TOP_LEVEL:
                out[_TOP_LEVEL[key]] = value
            elif block is not None and block.group(2) in _IN_BLOCK:
                out[f"model.layers.{block.group(1)}.{_IN_BLOCK[block.group(2)]}"] = value
            else:
                raise ValueError(f"{key!r} is not a DeepSeek-V3 parameter name; is this state dict from another model?")
        return out

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """HF names/layout -> titan names/layout (MTP weights and derived buffers dropped).

        The release's fp8 weights (`float8_e4m3fn`, each with a `weight_scale_inv` per 128 x 128
        block) are dequantized to bf16 on the way, as DeepSeek's own conversion does, so the
        Hub's checkpoint loads as it is published."""
        experts = ExpertStacker(self.args.n_routed_experts, "n_routed_experts")
        out: dict[str, Any] = {}
        self.skipped = []
        skipped_mtp = set()
        for key, value in dequantize_fp8_blocks(state_dict).items():
            if _HF_DERIVED.fullmatch(key):
                continue
            block = _HF_BLOCK.fullmatch(key)
            if block is not None and int(block.group(1)) >= self.args.n_layers:
                skipped_mtp.add(int(block.group(1)))  # the multi-token-prediction block(s)
                continue
            if experts.add(key, value):
                continue
            if key in (HF_SCORE_KEY, HF_LM_HEAD_KEY):
                titan_key = self.output_from_hf(key)
                if titan_key is not None:  # None: a language model's head under a score head
                    out[titan_key] = value
            elif block is None and key in _FROM_HF_TOP:
                out[_FROM_HF_TOP[key]] = value
            elif block is not None and block.group(2) in _FROM_HF_BLOCK:
                out[f"layers.{block.group(1)}.{_FROM_HF_BLOCK[block.group(2)]}"] = value
            else:
                raise ValueError(
                    f"{key!r} is not a DeepseekV3ForCausalLM parameter name; is this checkpoint another model?")
        if skipped_mtp:
            warnings.warn(
                f"skipped the checkpoint's layers {sorted(skipped_mtp)} (multi-token prediction, beyond "
                f"num_hidden_layers={self.args.n_layers}): titan's DeepSeek-V3 predicts the next token only",
                stacklevel=2,
            )
        return {**out, **experts.stacked()}

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A `config.json` dict for `DeepseekV3ForCausalLM` (`transformers.DeepseekV3Config(**d)` accepts it)."""
        a = self.args
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_scaling is not None:
            s = a.rope_scaling
            rope.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings,
                        beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=s.mscale, mscale_all_dim=s.mscale_all_dim,
                        truncate=s.truncate)
            if s.attention_factor is not None:
                rope["attention_factor"] = s.attention_factor
        cfg: dict[str, Any] = {
            "architectures": [hf_architecture(a, "DeepseekV3ForCausalLM")],
            "model_type": "deepseek_v3",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "moe_intermediate_size": a.moe_intermediate_size,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_parameters": rope,
            "rope_interleave": True,
            "q_lora_rank": a.q_lora_rank,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "n_routed_experts": a.n_routed_experts,
            "n_shared_experts": a.n_shared_experts,
            "num_experts_per_tok": a.num_experts_per_tok,
            "n_group": a.n_group,
            "topk_group": a.topk_group,
            "routed_scaling_factor": a.routed_scaling_factor,
            "norm_topk_prob": a.norm_topk_prob,
            "first_k_dense_replace": a.first_k_dense_replace,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": a.tie_word_embeddings,
            "num_nextn_predict_layers": 0,
            "aux_loss_alpha": a.router_aux_loss_coef,
            "seq_aux": True,
            "torch_dtype": torch_dtype,
        }
        if a.vocab_size > max(_BOS_ID, _EOS_ID):
            cfg.update(bos_token_id=_BOS_ID, eos_token_id=_EOS_ID)
        cfg.update(label_config(a))
        return cfg

    def config_differences(self, checkpoint_config: dict[str, Any]) -> list[str]:
        """How a checkpoint's `config.json` describes another model than this adapter's, one
        line per field (`titan.models.common.hf_config.hf_config_differences`)."""
        return hf_config_differences(self, checkpoint_config)

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]) -> DeepseekV3Args:
        """`DeepseekV3Args` for a HF DeepSeek-V3 `config.json` dict (the Hub's or transformers
        5's spelling). Raises for features titan's DeepSeek-V3 does not implement rather than
        load them wrongly."""
        _check_supported(cfg)
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        max_seq_len = cfg.get("max_position_embeddings", 4096)
        return DeepseekV3Args(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            ffn_hidden_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=_yarn_from_hf(rope, max_seq_len),
            max_seq_len=max_seq_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_labels=hf_num_labels(cfg),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            n_routed_experts=cfg.get("n_routed_experts") or cfg["num_local_experts"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            # A release's bias is used as trained; training it further is an explicit choice.
            load_balance_coeff=None,
            router_aux_loss_coef=float(cfg.get("aux_loss_alpha") or 0.0),
        )


FP8_BLOCK = (128, 128)
"""The block DeepSeek-V3's release scales its fp8 weights by (`weight_block_size`)."""
_SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_blocks(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with each fp8 weight that has a `<name>_scale_inv` (one float32 per
    `FP8_BLOCK` block, the last blocks partial) replaced by `weight * scale` in bfloat16 and
    the scales dropped; everything else as it is. A weight whose scales do not tile it in
    128 x 128 blocks, or a scale without its weight, is an error."""
    scales = {key[: -len(_SCALE_SUFFIX)]: value for key, value in state_dict.items() if key.endswith(_SCALE_SUFFIX)}
    if not scales:
        return state_dict
    missing = sorted(set(scales) - set(state_dict))
    if missing:
        raise ValueError(f"{missing[0]}{_SCALE_SUFFIX} has no weight {missing[0]!r} beside it: is the checkpoint complete?")
    out = {}
    for key, value in state_dict.items():
        if key.endswith(_SCALE_SUFFIX):
            continue
        out[key] = _dequantize(key, value, scales[key]) if key in scales else value
    return out


def _dequantize(key: str, weight: Any, scale: Any) -> Any:
    """One fp8 weight times its per-block scales, in bfloat16."""
    rows, cols = weight.shape
    block_rows, block_cols = FP8_BLOCK
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{key!r}: {tuple(scale.shape)} scales do not tile a {rows} x {cols} weight in "
                         f"{block_rows} x {block_cols} blocks ({expected} would)")
    per_element = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return (weight.float() * per_element).to(torch.bfloat16)


def _yarn_from_hf(rope: dict[str, Any], max_seq_len: int) -> YarnScaling | None:
    """`YarnScaling` from flat HF RoPE settings (None for plain RoPE), with transformers'
    defaults: a missing `factor` is max_position_embeddings / original_max_position_embeddings."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    original = rope.get("original_max_position_embeddings") or max_seq_len
    factor = rope.get("factor") or max_seq_len / original
    return YarnScaling(
        factor=factor, original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale") or 0.0, mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
        attention_factor=rope.get("attention_factor"), truncate=rope.get("truncate", True),
    )


def _is_release_fp8(quantization: dict[str, Any]) -> bool:
    """Whether a `quantization_config` is DeepSeek-V3's published fp8 scheme."""
    return (quantization.get("quant_method") == "fp8" and quantization.get("fmt", "e4m3") == "e4m3"
            and tuple(quantization.get("weight_block_size") or ()) == FP8_BLOCK)


def _check_supported(cfg: dict[str, Any]) -> None:
    """Refuse a DeepSeek-V3 config whose features this implementation lacks."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if kind not in ("default", "yarn"):
        problems.append(f"rope_type {kind!r} (only 'default' and 'yarn')")
    if cfg.get("rope_interleave", True) is False:
        problems.append("rope_interleave=false (the releases' interleaved RoPE layout only)")
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (projection biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only 'silu')")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func {cfg['scoring_func']!r} (DeepSeek-V3 routes with 'sigmoid')")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method {cfg['topk_method']!r} (DeepSeek-V3's 'noaux_tc')")
    if cfg.get("aux_loss_alpha") and cfg.get("seq_aux", True) is False:
        problems.append("aux_loss_alpha with seq_aux=false (a batch-wise balance loss; titan's is DeepSeek-V3's "
                        "sequence-wise one)")
    if cfg.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={cfg['moe_layer_freq']} (every block after the dense ones routes)")
    quantization = cfg.get("quantization_config")
    if quantization and not _is_release_fp8(quantization):
        problems.append(f"quantization_config {quantization} (only the release's: fp8 e4m3 in "
                        f"{FP8_BLOCK[0]} x {FP8_BLOCK[1]} blocks, dequantized to bf16 on import)")
    if (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
        problems.append("num_key_value_heads != num_attention_heads (MLA expands a key and value per head)")
    if problems:
        raise ValueError("this DeepSeek-V3 config uses features titan's deepseek_v3 does not implement: "
                         + "; ".join(problems))
