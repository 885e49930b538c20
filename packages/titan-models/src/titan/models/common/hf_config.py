"""The Hugging Face `config.json` keys every titan decoder family writes alike."""

from __future__ import annotations

import dataclasses
from typing import Any

# Fields of a family's args that a run sets for itself rather than inherit from a checkpoint:
# the context it trains at (RoPE tables are built to it) and its balancing-loss settings.
# A score head (num_labels) is also the run's: a reward model starts from a language model's body.
RUN_SETTINGS = frozenset({"max_seq_len", "router_aux_loss_coef", "load_balance_coeff", "moe_force_load_balance",
                          "num_labels"})
# Llama's inputs to its FFN width rule: compared through the width they give (ffn_hidden_dim).
_FFN_RULE = frozenset({"multiple_of", "ffn_dim_multiplier", "ffn_dim"})
# config.json keys that change the function but are not fields of the args (the adapters
# write their one supported value): compared as written when the checkpoint's config has them.
FUNCTION_KEYS = ("model_type", "hidden_act", "attention_bias", "mlp_bias")


def decoder_hf_config(args: Any, *, architecture: str, model_type: str, torch_dtype: str,
                      special_ids: tuple[int, int], rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shared part of a dense decoder's `config.json`: sizes, norm, activation, tying,
    dtype, and RoPE in both spellings (transformers 5 reads ``rope_parameters``; 4.x reads
    ``rope_theta`` and ``rope_scaling``, None when scaling is off). ``special_ids`` (bos, eos) are
    written when the vocabulary holds them. A family adds its own keys to the result."""
    rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
    cfg: dict[str, Any] = {
        "architectures": [hf_architecture(args, architecture)],
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
    cfg.update(label_config(args))
    return cfg


def label_config(args: Any) -> dict[str, Any]:
    """The ``config.json`` keys of a score head's labels (``id2label``, ``label2id``: transformers
    derives ``num_labels`` from them, as its own configs write them); none for a language model."""
    num_labels = getattr(args, "num_labels", 0)
    if not num_labels:
        return {}
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
            "label2id": {f"LABEL_{i}": i for i in range(num_labels)}}


OUTPUT_KEY, HF_SCORE_KEY, HF_LM_HEAD_KEY = "output.weight", "score.weight", "lm_head.weight"
"""titan's output projection, and its Hub names in a sequence classifier and a language model."""


class ScoreHeadKeys:
    """Adapter mixin for the output of a model with a score head (``args.num_labels``): titan's
    ``output.weight`` is the Hub's ``score.weight`` (``...ForSequenceClassification``); a language
    model's ``lm_head.weight`` has no place in it and is skipped (listed in ``skipped``), the head
    then keeping its initialization (``keeps_init_when_absent``), as transformers does."""

    args: Any
    skipped: list[str]
    """Checkpoint keys the last ``from_hf`` had no place for (a language model's head)."""

    @property
    def _scores(self) -> bool:
        """Whether the model has a sequence-classification head (``num_labels``)."""
        return bool(getattr(self.args, "num_labels", 0))

    def keeps_init_when_absent(self, key: str) -> bool:
        """Whether titan entry ``key`` may stay at its initialization when a checkpoint lacks
        it (or holds it in another shape): the score head, when starting from a language model."""
        return self._scores and key == OUTPUT_KEY

    def output_to_hf(self) -> str:
        """The Hub's name of titan's ``output.weight``."""
        return HF_SCORE_KEY if self._scores else HF_LM_HEAD_KEY

    def output_from_hf(self, key: str) -> str | None:
        """titan's name for the Hub's output ``key`` (``score.weight`` or ``lm_head.weight``),
        or None for one this model skips; a score head is refused by a language model."""
        if key == HF_SCORE_KEY and not self._scores:
            raise ValueError(f"{key!r} is the score head of a sequence-classification model (a reward model); "
                             "this model is a language model: build it with num_labels to load it")
        if key == HF_LM_HEAD_KEY and self._scores:
            self.skipped.append(key)
            return None
        return OUTPUT_KEY



def hf_architecture(args: Any, causal_lm: str) -> str:
    """The transformers class of a model with ``args``: ``causal_lm`` (``LlamaForCausalLM``), or
    its ``...ForSequenceClassification`` twin when the model has a score head (``num_labels``)."""
    if getattr(args, "num_labels", 0):
        return causal_lm.removesuffix("ForCausalLM") + "ForSequenceClassification"
    return causal_lm


def hf_num_labels(cfg: dict[str, Any]) -> int:
    """The score head's width a ``config.json`` describes: 0 for a language model; for a
    ``...ForSequenceClassification`` its labels (``id2label``, else ``num_labels``; transformers'
    default 2)."""
    if not any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        return 0
    return len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))


def hf_config_differences(adapter: Any, checkpoint_config: dict[str, Any]) -> list[str]:
    """How the architecture a checkpoint's ``config.json`` describes differs from the model
    ``adapter`` converts for (``adapter.args``), one ``"name: checkpoint X, this run Y"`` line
    per difference; empty when they are the same model.

    Matching shapes do not prove the same model: a different ``rope_theta``, ``rms_norm_eps``,
    RoPE scaling or activation loads without a shape error and computes another function.
    Both sides go through the family's ``args_from_hf_config`` (the run's via its own
    ``hf_config()``), so equal architectures written differently (an explicit FFN width or
    the flavor's rule; transformers 4 or 5 RoPE keys) compare equal. A config the family
    cannot represent raises the family's ValueError, which names the feature."""
    run_config = adapter.hf_config()
    lines = [
        f"{key}: checkpoint {checkpoint_config[key]!r}, this run {run_config.get(key)!r}"
        for key in FUNCTION_KEYS
        if key in checkpoint_config and checkpoint_config[key] != run_config.get(key, False)
    ]
    if checkpoint_config.get("model_type", run_config["model_type"]) != run_config["model_type"]:
        return lines[:1]  # another family (FUNCTION_KEYS' first): its fields do not compare
    theirs = adapter.args_from_hf_config(checkpoint_config)
    ours = adapter.args_from_hf_config(run_config)
    names = [f.name for f in dataclasses.fields(ours) if f.name not in RUN_SETTINGS | _FFN_RULE]
    if "ffn_hidden_dim" not in names:  # Llama's is a property of the rule's fields
        names.append("ffn_hidden_dim")
    for name in names:
        mine, other = getattr(ours, name), getattr(theirs, name)
        if mine != other:
            lines.append(f"{name}: checkpoint {other!r}, this run {mine!r}")
    return lines


__all__ = ["RUN_SETTINGS", "ScoreHeadKeys", "decoder_hf_config", "hf_architecture", "hf_config_differences",
           "hf_num_labels", "label_config"]
