"""Every family builds its flavors through one function: unknown flavors and fields are
refused with the valid ones named, overrides replace fields."""

from __future__ import annotations

import pytest
import torch
from titan.models.deepseek_v3 import build_deepseek_v3
from titan.models.llama3 import build_llama3
from titan.models.qwen3 import build_qwen3
from titan.models.qwen3_moe import build_qwen3_moe


@pytest.mark.parametrize("family,build", [("llama3", build_llama3), ("qwen3", build_qwen3),
                                          ("qwen3_moe", build_qwen3_moe), ("deepseek_v3", build_deepseek_v3)])
def test_flavors_overrides_and_refusals(family, build):
    with torch.device("meta"):
        model = build("debugmodel", n_layers=1, vocab_size=96)
    assert (model.args.n_layers, model.args.vocab_size) == (1, 96)
    with pytest.raises(ValueError, match=f"unknown {family} flavor 'nope'; choose one of: .*debugmodel"):
        build("nope")
    with pytest.raises(ValueError, match=r"unknown \w+Args fields \['n_layerz'\]; valid fields: .*n_layers"):
        build("debugmodel", n_layerz=1)


def test_families_write_the_shared_config_keys_and_rope_in_both_spellings():
    """One function writes the keys the dense families share: RoPE for transformers 5
    (rope_parameters) and 4.x (rope_theta, rope_scaling) agree, for Llama 3's scaled RoPE too."""
    import dataclasses

    from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter
    from titan.models.qwen3 import QWEN3_FLAVORS, Qwen3StateDictAdapter

    llama = LLAMA3_FLAVORS["debugmodel"]
    scaled = Llama3StateDictAdapter(llama).hf_config()
    unscaled = Llama3StateDictAdapter(dataclasses.replace(llama, rope_scaling=None)).hf_config()
    qwen = Qwen3StateDictAdapter(QWEN3_FLAVORS["debugmodel"]).hf_config()
    assert scaled["rope_parameters"] == {**scaled["rope_scaling"], "rope_theta": scaled["rope_theta"]}
    assert scaled["rope_parameters"]["rope_type"] == "llama3"
    for cfg in (unscaled, qwen):
        assert cfg["rope_scaling"] is None
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    shared = set(qwen) & set(scaled)
    assert {"hidden_size", "head_dim", "rms_norm_eps", "tie_word_embeddings", "torch_dtype"} <= shared
    assert scaled["mlp_bias"] is False and qwen["use_sliding_window"] is False
