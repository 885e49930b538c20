"""Conversion between titan Qwen3 state dicts and Hugging Face `Qwen3ForCausalLM` ones.

RoPE: Hub checkpoints rotate the two halves of each head (rotate_half); titan rotates
interleaved channel pairs. As for Llama, the q/k projection rows are permuted per head on the
way, and so are the weights of the per-head q/k norms: the RMS statistic does not depend on the
channel order, so norm-then-rotate in titan's order equals the Hub's computation with every
head's channels permuted, which leaves the q.k attention scores unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from titan.models.common.hf_config import decoder_hf_config, hf_num_labels
from titan.models.llama3.adapter import (
    Llama3StateDictAdapter,
    half_split_to_interleaved,
    interleaved_to_half_split,
    is_rope_rotated,
)
from titan.models.qwen3.args import Qwen3Args

# The per-head norm weights ([head_dim]) follow the RoPE channel layout like wq/wk rows; the
# base adapter permutes wq/wk itself.
_HF_HEAD_NORM = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight")
_TITAN_HEAD_NORM = re.compile(r"layers\.\d+\.attention\.[qk]_norm\.weight")
# Qwen3 special tokens (<|endoftext|>, <|im_end|>), written only when the vocabulary holds them.
_BOS_ID, _EOS_ID = 151643, 151645


class Qwen3StateDictAdapter(Llama3StateDictAdapter):
    """Maps Qwen3 weights to and from Hugging Face `Qwen3ForCausalLM` names and layouts.

    The Llama 3 adapter with the q/k norm keys added (their weights permuted like the q/k
    rows, see the module docstring). Keys map one by one, so a pipeline stage's partial
    state dict converts too; tied embeddings are written once as `model.embed_tokens.weight`
    and fill `output.weight` on import, as for Llama.
    """

    args: Qwen3Args
    BLOCK_KEYS = {
        **Llama3StateDictAdapter.BLOCK_KEYS,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    FAMILY = "Qwen3"
    HF_MODEL = "Qwen3ForCausalLM"

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """titan names/layout -> HF names/layout."""
        out = super().to_hf(state_dict)
        for key, value in out.items():
            if _HF_HEAD_NORM.fullmatch(key):
                out[key] = interleaved_to_half_split(value, self.args.head_dim)
        return out

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """HF names/layout -> titan names/layout (derived buffers like `inv_freq` are dropped)."""
        out = super().from_hf(state_dict)
        for key, value in out.items():
            if _TITAN_HEAD_NORM.fullmatch(key):
                out[key] = half_split_to_interleaved(value, self.args.head_dim)
        return out

    def torchtitan_layout_keys(self, keys: Iterable[str]) -> list[str]:
        """The entries of `keys` (titan names) a torchtitan checkpoint holds in another layout:
        the q/k projection rows and the q/k norm weights. torchtitan's Qwen3 (every release)
        rotates the two halves of each head, as the Hub does; titan rotates interleaved pairs."""
        return [k for k in keys if is_rope_rotated(k) or _TITAN_HEAD_NORM.fullmatch(k)]

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Those entries (whole tensors, titan names) in titan's layout: the Hub's permutation,
        as in `from_hf`."""
        return {key: half_split_to_interleaved(value, self.args.head_dim) for key, value in state_dict.items()}

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A `config.json` dict for `Qwen3ForCausalLM` (`transformers.Qwen3Config(**d)` accepts it)."""
        cfg = decoder_hf_config(self.args, architecture="Qwen3ForCausalLM", model_type="qwen3",
                                torch_dtype=torch_dtype, special_ids=(_BOS_ID, _EOS_ID))
        cfg.update(attention_dropout=0.0, use_sliding_window=False, sliding_window=None)
        return cfg

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]) -> Qwen3Args:
        """`Qwen3Args` for a HF Qwen3 `config.json` dict (transformers 4 or 5 layout).

        Raises for features titan's Qwen3 does not implement (sliding-window attention,
        attention biases, RoPE scaling, another activation) rather than load them wrongly.
        """
        _check_supported(cfg)
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        fields = dict(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads,
            vocab_size=cfg["vocab_size"],
            ffn_hidden_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_seq_len=cfg.get("max_position_embeddings", 32768),
            # Qwen3Config's default ties; 8B and larger say false.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            num_labels=hf_num_labels(cfg),
        )
        return Qwen3Args(**fields)


def _check_supported(cfg: dict[str, Any]) -> None:
    """Refuse a Qwen3 config whose features this implementation lacks."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention)")
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (q/k/v/o biases)")
    if kind != "default":
        problems.append(f"rope_type {kind!r} (only plain RoPE, 'default')")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only 'silu')")
    if problems:
        raise ValueError(
            "this Qwen3 config uses features titan's qwen3 does not implement: "
            + "; ".join(problems)
            + ". Convert a checkpoint without them (e.g. drop a YaRN rope_scaling entry to "
            "train at the native context)"
        )

