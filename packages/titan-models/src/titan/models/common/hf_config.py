"""The Hugging Face `config.json` keys every titan decoder family writes alike."""

from __future__ import annotations

from typing import Any


def decoder_hf_config(args: Any, *, architecture: str, model_type: str, torch_dtype: str,
                      special_ids: tuple[int, int], rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shared part of a dense decoder's `config.json`: sizes, norm, activation, tying,
    dtype, and RoPE in both spellings (transformers 5 reads ``rope_parameters``; 4.x reads
    ``rope_theta`` and ``rope_scaling``, None when scaling is off). ``special_ids`` (bos, eos) are
    written when the vocabulary holds them. A family adds its own keys to the result."""
    rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "rope_scaling": None if rope_scaling is None else dict(rope_scaling),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": torch_dtype,
    }
    bos, eos = special_ids
    if args.vocab_size > max(bos, eos):
        cfg.update(bos_token_id=bos, eos_token_id=eos)
    return cfg


__all__ = ["decoder_hf_config"]
