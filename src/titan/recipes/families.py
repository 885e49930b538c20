"""The model families titan can train, described for the trainer.

This is the one place where a model family (titan.models) meets the trainer (titan.train):
``titan.train`` never names a family, so the recipes layer hands it a ``ModelSpec``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from titan.models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DeepseekV3StateDictAdapter,
    build_deepseek_v3,
)
from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter, build_llama3
from titan.models.qwen3 import QWEN3_FLAVORS, Qwen3StateDictAdapter, build_qwen3
from titan.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeStateDictAdapter, build_qwen3_moe
from titan.train.model_spec import ModelSpec

MODEL_FAMILIES: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        flavors=LLAMA3_FLAVORS,
        build=build_llama3,
        adapter=lambda model: Llama3StateDictAdapter(model.args),
        hf_model_type="llama",
        args_from_hf_config=Llama3StateDictAdapter.args_from_hf_config,
    ),
    "qwen3": ModelSpec(
        name="qwen3",
        flavors=QWEN3_FLAVORS,
        build=build_qwen3,
        adapter=lambda model: Qwen3StateDictAdapter(model.args),
        hf_model_type="qwen3",
        args_from_hf_config=Qwen3StateDictAdapter.args_from_hf_config,
    ),
    "qwen3_moe": ModelSpec(
        name="qwen3_moe",
        flavors=QWEN3_MOE_FLAVORS,
        build=build_qwen3_moe,
        adapter=lambda model: Qwen3MoeStateDictAdapter(model.args),
        hf_model_type="qwen3_moe",
        args_from_hf_config=Qwen3MoeStateDictAdapter.args_from_hf_config,
    ),
    "deepseek_v3": ModelSpec(
        name="deepseek_v3",
        flavors=DEEPSEEK_V3_FLAVORS,
        build=build_deepseek_v3,
        adapter=lambda model: DeepseekV3StateDictAdapter(model.args),
        hf_model_type="deepseek_v3",
        args_from_hf_config=DeepseekV3StateDictAdapter.args_from_hf_config,
    ),
}


def model_spec(name: str) -> ModelSpec:
    """The registered family ``name``; a ValueError lists the known families otherwise."""
    try:
        return MODEL_FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"--model.name {name!r} is not a known model family; choose one of: {', '.join(MODEL_FAMILIES)}"
        ) from None


HF_FLAVOR = "hf"
"""``--model.flavor hf``: the architecture of the Hugging Face checkpoint the run starts from."""


def model_spec_for(config: Any) -> ModelSpec:
    """The spec of a run's family (``--model.name``); with ``--model.flavor hf`` it also holds
    that flavor, read from the ``config.json`` of ``--checkpoint.initial_load_path``."""
    spec = model_spec(config.model.name)
    if config.model.flavor != HF_FLAVOR:
        return spec
    return spec.with_flavor(HF_FLAVOR, hf_flavor_args(spec, config.checkpoint))


def family_of_folder(folder: str, default: ModelSpec) -> ModelSpec:
    """The family of the Hugging Face model in ``folder``, by its ``config.json``'s
    ``model_type`` (a distillation teacher may be of another family than the student: a
    Qwen3-MoE teacher of a dense Qwen3); ``default`` when the folder has no readable
    ``config.json`` (a Hub id not downloaded yet: the builder reports it) or a model type no
    family reads (the builder's check names the families)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return default
    if model_type == default.hf_model_type:
        return default
    return next((spec for spec in MODEL_FAMILIES.values()
                 if spec.hf_model_type == model_type and spec.args_from_hf_config is not None), default)


def hf_flavor_args(spec: ModelSpec, checkpoint: Any) -> Any:
    """The family's arguments for the Hugging Face checkpoint ``checkpoint`` starts from (its
    ``config.json``); a ValueError says what is missing or which family the file is."""
    folder = checkpoint.initial_load_path
    if not (checkpoint.initial_load_in_hf and folder):
        raise ValueError(
            f"--model.flavor {HF_FLAVOR} takes the architecture of the Hugging Face checkpoint the run "
            "starts from: add --checkpoint.initial_load_path HF_FOLDER --checkpoint.initial_load_in_hf"
        )
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            hf_config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--model.flavor {HF_FLAVOR} reads {path}: {err}") from None
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if model_type != spec.hf_model_type or spec.args_from_hf_config is None:
        families = {s.hf_model_type: name for name, s in MODEL_FAMILIES.items() if s.args_from_hf_config}
        fix = (f"run it with --model.name {families[model_type]}" if model_type in families else
               f"titan's families read model_type {', '.join(map(repr, families))}")
        raise ValueError(f"{path} is a {model_type!r} model, not --model.name {spec.name}'s: {fix}")
    try:
        return spec.args_from_hf_config(hf_config)
    except (KeyError, TypeError, ValueError) as err:
        detail = f"it has no {err}" if isinstance(err, KeyError) else str(err)
        raise ValueError(f"--model.flavor {HF_FLAVOR}: {path} is not a {spec.name} config titan can build: {detail}") from None
