"""Helpers of the Hugging Face parity tests: a `save_pretrained` folder read back as written,
the titan model imported from it through a family's adapter, and the error measure."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file


def load_folder(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, HF state dict) exactly as written on disk."""
    cfg = json.loads((folder / "config.json").read_text())
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return cfg, state


def titan_from_folder(folder, adapter_class, model_class):
    """(titan model in eval mode, its adapter, the HF state dict) imported from `folder`;
    every parameter must be filled (strict load)."""
    cfg, state = load_folder(folder)
    adapter = adapter_class(adapter_class.args_from_hf_config(cfg))
    model = model_class(adapter.args)
    model.load_state_dict(adapter.from_hf(state), strict=True)
    return model.eval(), adapter, state


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """A transformers causal LM's logits, without gradients."""
    with torch.no_grad():
        return model(tokens).logits


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||got - ref|| / ||ref||."""
    return float((got - ref).norm() / ref.norm())
