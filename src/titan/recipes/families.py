"""The model families titan can train, described for the trainer.

This is the one place where a model family (titan.models) meets the trainer (titan.train):
``titan.train`` never names a family, so the recipes layer hands it a ``ModelSpec``.
"""

from __future__ import annotations

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
    ),
    "qwen3": ModelSpec(
        name="qwen3",
        flavors=QWEN3_FLAVORS,
        build=build_qwen3,
        adapter=lambda model: Qwen3StateDictAdapter(model.args),
    ),
    "qwen3_moe": ModelSpec(
        name="qwen3_moe",
        flavors=QWEN3_MOE_FLAVORS,
        build=build_qwen3_moe,
        adapter=lambda model: Qwen3MoeStateDictAdapter(model.args),
    ),
    "deepseek_v3": ModelSpec(
        name="deepseek_v3",
        flavors=DEEPSEEK_V3_FLAVORS,
        build=build_deepseek_v3,
        adapter=lambda model: DeepseekV3StateDictAdapter(model.args),
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
