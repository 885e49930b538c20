"""Conversion between titan Llama 3 state dicts and Hugging Face `LlamaForCausalLM` ones."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from titan.models.common.hf_config import (
    HF_LM_HEAD_KEY,
    HF_SCORE_KEY,
    ScoreHeadKeys,
    decoder_hf_config,
    hf_config_differences,
    hf_num_labels,
)
from titan.models.common.rope import RopeScaling
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args

# Non-block parameters: titan name -> HF name.
_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Parameters inside block i: titan suffix (after "layers.i.") -> HF suffix (after "model.layers.i.").
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROTATED = ("attention.wq.weight", "attention.wk.weight")  # rows follow the RoPE layout
_EMBED, _OUTPUT, _NORM = "tok_embeddings.weight", "output.weight", "norm.weight"
_TITAN_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some older HF checkpoints saved; they are recomputed, never loaded.
_HF_DERIVED = re.compile(r".*rotary_emb\.inv_freq")
# Llama 3 special tokens, written to the config only when the vocabulary holds them.
_BOS_ID, _EOS_ID = 128000, 128001


def interleaved_to_half_split(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder q/k projection rows from pairs (x0, y0, x1, y1, ...) to halves (x0, x1, ..., y0, y1, ...).

    Works per head, with the head count read from the shape, so it serves q and GQA's k alike.
    """
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def half_split_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half_split`."""
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


class Llama3StateDictAdapter(ScoreHeadKeys):
    """Maps Llama 3 weights to and from Hugging Face `LlamaForCausalLM` names and layouts.

    Keys are mapped one by one, so a pipeline stage's partial state dict converts too.
    titan rotates interleaved channel pairs (Meta layout); HF rotates the two halves of each
    head, so wq and wk rows are permuted on the way.

    Tied embeddings (`args.tie_word_embeddings`): the Hub layout stores the shared matrix once,
    as `model.embed_tokens.weight`, with no `lm_head.weight`; `to_hf` writes that layout and
    `from_hf` gives `output.weight` the embedding's tensor. A checkpoint without `lm_head.weight`
    for an untied model is an error, never a silently random output projection.

    A model with a score head (`args.num_labels`) maps to `LlamaForSequenceClassification`:
    `output.weight` is its `score.weight`. Loading a language model's checkpoint into it
    reads the body and leaves the head at its initialization (`keeps_init_when_absent`): the
    checkpoint's `lm_head.weight` has no place in it and is skipped, as transformers does.
    """

    def __init__(self, args: Llama3Args) -> None:
        self.args = args
        self.skipped: list[str] = []

    @property
    def _tied(self) -> bool:
        """Whether the output projection is the embedding (never for a score head)."""
        return bool(self.args.tie_word_embeddings) and not self._scores

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """titan names/layout -> HF names/layout."""
        out = {}
        for key, value in state_dict.items():
            if self._scores and key == _OUTPUT:
                out[self.output_to_hf()] = value
                continue
            if self._tied and key == _OUTPUT:
                if _EMBED in state_dict:
                    continue  # the same matrix, written once as the embedding
                key = _EMBED  # a piece holding only the output still carries the shared matrix
            if is_rope_rotated(key):
                value = interleaved_to_half_split(value, self.args.head_dim)
            out[self._hf_key(key)] = value
        return out

    def from_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """HF names/layout -> titan names/layout (derived buffers like `inv_freq` are dropped)."""
        out = {}
        self.skipped = []
        for key, value in state_dict.items():
            if _HF_DERIVED.fullmatch(key):
                continue
            if key in (HF_SCORE_KEY, HF_LM_HEAD_KEY):
                titan_key = self.output_from_hf(key)
                if titan_key is not None:  # None: a language model's head under a score head
                    out[titan_key] = value
                continue
            titan_key = self._titan_key(key)
            if is_rope_rotated(titan_key):
                value = half_split_to_interleaved(value, self.args.head_dim)
            out[titan_key] = value
        self._fill_tied_output(out)
        return out

    def _fill_tied_output(self, out: dict[str, Any]) -> None:
        """Give `output.weight` the embedding's tensor when the checkpoint ties them.

        The final norm and the output live on the same (last) pipeline stage, so a state dict
        holding `norm.weight` without `output.weight` is a tied checkpoint, never a partial one.
        """
        tied = self._tied
        if self._scores:
            return  # a score head is never the embedding; a checkpoint without one leaves it at init
        if tied and _OUTPUT in out and _EMBED in out and not _same_values(out[_OUTPUT], out[_EMBED]):
            raise ValueError(
                "this model ties the output projection to the embedding (tie_word_embeddings), "
                "but the checkpoint's lm_head.weight differs from model.embed_tokens.weight; "
                "build the model with tie_word_embeddings=False to load both"
            )
        if _OUTPUT in out or _NORM not in out:
            return
        if not tied:
            raise ValueError(
                "the checkpoint has no lm_head.weight: it ties the output projection to "
                "model.embed_tokens.weight (tie_word_embeddings in its config.json), but this "
                "model is untied (tie_word_embeddings=False). Build it with "
                f"tie_word_embeddings=True ({type(self).__name__}.args_from_hf_config reads it)"
            )
        if _EMBED not in out:
            raise ValueError(
                "the checkpoint has neither lm_head.weight nor model.embed_tokens.weight; "
                "the output projection of this tied model cannot be filled"
            )
        out[_OUTPUT] = out[_EMBED]

    BLOCK_KEYS: dict[str, str] = _IN_BLOCK
    """Parameters inside block i: titan suffix -> HF suffix (a family adds its own)."""
    FAMILY: str = "Llama 3"
    """The family's name in errors about titan keys."""
    HF_MODEL: str = "LlamaForCausalLM"
    """The transformers class the checkpoints belong to (named in errors about HF keys)."""

    @classmethod
    def _hf_key(cls, key: str) -> str:
        block = _TITAN_BLOCK.fullmatch(key)
        if block is None and key in _TOP_LEVEL:
            return _TOP_LEVEL[key]
        if block is not None and block.group(2) in cls.BLOCK_KEYS:
            return f"model.layers.{block.group(1)}.{cls.BLOCK_KEYS[block.group(2)]}"
        raise ValueError(
            f"{key!r} is not a {cls.FAMILY} parameter name; is this state dict from another model?"
        )

    @classmethod
    def _titan_key(cls, key: str) -> str:
        block = _HF_BLOCK.fullmatch(key)
        if block is None and key in _FROM_HF_TOP:
            return _FROM_HF_TOP[key]
        from_hf_block = {hf: titan for titan, hf in cls.BLOCK_KEYS.items()}
        if block is not None and block.group(2) in from_hf_block:
            return f"layers.{block.group(1)}.{from_hf_block[block.group(2)]}"
        raise ValueError(
            f"{key!r} is not a {cls.HF_MODEL} parameter name; is this checkpoint another model?"
        )

    def hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A `config.json` dict for `LlamaForCausalLM` (`transformers.LlamaConfig(**d)` accepts it)."""
        cfg = decoder_hf_config(self.args, architecture="LlamaForCausalLM", model_type="llama",
                                torch_dtype=torch_dtype, special_ids=(_BOS_ID, _EOS_ID),
                                rope_scaling=_rope_scaling_to_hf(self.args.rope_scaling))
        cfg["mlp_bias"] = False
        return cfg

    def config_differences(self, checkpoint_config: dict[str, Any]) -> list[str]:
        """How a checkpoint's `config.json` describes another model than this adapter's, one
        line per field (`titan.models.common.hf_config.hf_config_differences`)."""
        return hf_config_differences(self, checkpoint_config)

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]) -> Llama3Args:
        """`Llama3Args` for a HF Llama `config.json` dict (transformers 4 or 5 layout).

        Raises for features titan's Llama does not implement (q/k/v/o or MLP biases, another
        activation, a RoPE type other than plain and Llama 3's) rather than load them wrongly.
        """
        _check_supported(cfg)
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or dim // n_heads
        if head_dim * n_heads != dim:
            raise ValueError(
                f"head_dim {head_dim} * num_attention_heads {n_heads} != hidden_size {dim}; unsupported"
            )
        rope = _rope_params_from_hf(cfg)
        return Llama3Args(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling_from_hf(rope),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            # LlamaConfig's default is untied; Llama 3.2 1B/3B configs say true.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_labels=hf_num_labels(cfg),
            **_ffn_fields(dim, cfg["intermediate_size"]),
        )


def _check_supported(cfg: dict[str, Any]) -> None:
    """Refuse a Llama config whose features this implementation lacks."""
    problems = []
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (q/k/v/o biases)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (feed-forward biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only 'silu')")
    kind = _rope_params_from_hf(cfg)
    kind = kind.get("rope_type", kind.get("type", "default"))
    if kind not in ("default", "llama3"):
        problems.append(f"rope_type {kind!r} (only plain RoPE, 'default', and Llama 3's, 'llama3')")
    if problems:
        raise ValueError(
            "this Llama config uses features titan's llama3 does not implement: " + "; ".join(problems)
        )


def is_rope_rotated(titan_key: str) -> bool:
    """Whether the rows of this titan parameter follow the RoPE channel layout (wq, wk)."""
    block = _TITAN_BLOCK.fullmatch(titan_key)
    return block is not None and block.group(2) in _ROTATED


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two checkpoint tensors hold the same matrix (cheap when they share storage)."""
    if a is b or (a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()):
        return True
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


_FROM_HF_TOP = {hf: titan for titan, hf in _TOP_LEVEL.items()}


def _rope_scaling_to_hf(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """HF `rope_scaling` entry for `scaling` (None when scaling is off)."""
    if scaling is None:
        return None
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def _rope_params_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """One flat dict of RoPE settings: transformers 5 nests them in `rope_parameters`,
    older configs put `rope_theta` at top level and scaling in `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def _rope_scaling_from_hf(rope: dict[str, Any]) -> RopeScaling | None:
    """`RopeScaling` from flat HF RoPE settings; only "default" and "llama3" are supported."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(
            f"rope_type {kind!r} is not supported by llama3; expected 'llama3' or 'default'"
        )
    names = [f.name for f in dataclasses.fields(RopeScaling)]
    return RopeScaling(**{name: rope[name] for name in names})


def _ffn_fields(dim: int, intermediate_size: int) -> dict[str, Any]:
    """FFN fields reproducing `intermediate_size`: a published flavor's rule when one fits,
    so a round trip gives back the flavor exactly, else an explicit `ffn_dim`."""
    for flavor in LLAMA3_FLAVORS.values():
        if flavor.dim == dim and flavor.ffn_hidden_dim == intermediate_size:
            return {
                "multiple_of": flavor.multiple_of,
                "ffn_dim_multiplier": flavor.ffn_dim_multiplier,
            }
    return {"ffn_dim": intermediate_size}
