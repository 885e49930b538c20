"""The Hub's per-expert checkpoint layout, shared by the MoE families' adapters.

Hub checkpoints store each routed expert separately (`<prefix>.experts.{e}.gate_proj.weight`
[I, D], `up_proj` [I, D], `down_proj` [D, I]); titan holds a layer's experts stacked
(`experts.w1`/`w3` [E, I, D], `w2` [E, D, I]).
"""

from __future__ import annotations

import re
from typing import Any

import torch

EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""titan stacked expert weight -> the Hub's per-expert projection name."""
PROJ_EXPERT = {hf: titan for titan, hf in EXPERT_PROJ.items()}
HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
"""A Hub per-expert key: (layer, expert, projection)."""


def split_experts(layer: str, name: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hub keys and tensors of the experts of titan's stacked `name` (w1/w2/w3) in `layer`."""
    return {f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_PROJ[name]}.weight": stacked[e]
            for e in range(stacked.shape[0])}


class ExpertStacker:
    """Collects Hub per-expert tensors (`add`) and stacks each layer's (`stacked`), refusing
    a layer whose experts are not exactly 0..n_experts-1."""

    def __init__(self, n_experts: int, count_name: str) -> None:
        self.n_experts, self.count_name = n_experts, count_name
        self._by_layer: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def add(self, key: str, value: Any) -> bool:
        """Take `key` if it is a Hub per-expert key (True), else leave it (False)."""
        m = HF_EXPERT.fullmatch(key)
        if m is None:
            return False
        layer, e, proj = m.groups()
        self._by_layer.setdefault((layer, PROJ_EXPERT[proj]), {})[int(e)] = value
        return True

    def stacked(self) -> dict[str, torch.Tensor]:
        """titan keys (`layers.{i}.feed_forward.experts.w{1,2,3}`) and stacked tensors."""
        out = {}
        for (layer, name), by_index in self._by_layer.items():
            missing = sorted(set(range(self.n_experts)) - by_index.keys())
            if missing or len(by_index) != self.n_experts:
                raise ValueError(
                    f"layer {layer}: the checkpoint's {EXPERT_PROJ[name]} experts are "
                    f"{sorted(by_index)[:8]}...; expected 0..{self.n_experts - 1} "
                    f"(missing {missing[:8]}); is {self.count_name}={self.n_experts} right?"
                )
            out[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack(
                [by_index[e] for e in range(self.n_experts)])
        return out


__all__ = ["EXPERT_PROJ", "ExpertStacker", "HF_EXPERT", "PROJ_EXPERT", "split_experts"]
