"""Every family builds its flavors through one function: unknown flavors and fields are
refused with the valid ones named, overrides replace fields."""

from __future__ import annotations

import pytest
import torch
from titan.models.llama3 import build_llama3
from titan.models.qwen3 import build_qwen3
from titan.models.qwen3_moe import build_qwen3_moe


@pytest.mark.parametrize("family,build", [("llama3", build_llama3), ("qwen3", build_qwen3),
                                          ("qwen3_moe", build_qwen3_moe)])
def test_flavors_overrides_and_refusals(family, build):
    with torch.device("meta"):
        model = build("debugmodel", n_layers=1, vocab_size=96)
    assert (model.args.n_layers, model.args.vocab_size) == (1, 96)
    with pytest.raises(ValueError, match=f"unknown {family} flavor 'nope'; choose one of: .*debugmodel"):
        build("nope")
    with pytest.raises(ValueError, match=r"unknown \w+Args fields \['n_layerz'\]; valid fields: .*n_layers"):
        build("debugmodel", n_layerz=1)
