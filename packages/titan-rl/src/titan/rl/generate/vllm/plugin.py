"""Registration of titan's model families with vLLM.

vLLM calls `register` through the ``vllm.general_plugins`` entry point of titan-rl in every
process it starts (its CPU and multiprocess workers are spawned, so a registration made only
in the caller's process would not reach them). Classes are named by import path, so nothing
here imports torch or vLLM's model code until vLLM builds a model.
"""

from __future__ import annotations

ARCHITECTURES: dict[str, str] = {
    "TitanLlama3ForCausalLM": "titan.rl.generate.vllm.models:TitanLlama3ForCausalLM",
    "TitanQwen3ForCausalLM": "titan.rl.generate.vllm.models:TitanQwen3ForCausalLM",
    "TitanQwen3MoeForCausalLM": "titan.rl.generate.vllm.models:TitanQwen3MoeForCausalLM",
    "TitanDeepseekV3ForCausalLM": "titan.rl.generate.vllm.models:TitanDeepseekV3ForCausalLM",
}
"""vLLM architecture name -> the class that runs it."""

FAMILY_ARCHITECTURES: dict[str, str] = {
    "llama3": "TitanLlama3ForCausalLM",
    "qwen3": "TitanQwen3ForCausalLM",
    "qwen3_moe": "TitanQwen3MoeForCausalLM",
    "deepseek_v3": "TitanDeepseekV3ForCausalLM",
}
"""titan model family (``--model.name``) -> its vLLM architecture name."""


def register() -> None:
    """Register every titan architecture with vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for name, path in ARCHITECTURES.items():
        if name not in supported:
            ModelRegistry.register_model(name, path)


__all__ = ["ARCHITECTURES", "FAMILY_ARCHITECTURES", "register"]
