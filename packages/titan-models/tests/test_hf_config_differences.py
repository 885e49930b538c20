"""A checkpoint's `config.json` against the run's model: same model, or each field that differs.

Matching tensor shapes do not prove the same model, so loading Hugging Face weights compares
the architecture too (`hf_config_differences`, through the adapters' `config_differences`).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import transformers
from titan.models.deepseek_v3.adapter import DeepseekV3StateDictAdapter
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titan.models.llama3.adapter import Llama3StateDictAdapter
from titan.models.llama3.args import LLAMA3_FLAVORS
from titan.models.qwen3.adapter import Qwen3StateDictAdapter
from titan.models.qwen3.args import QWEN3_FLAVORS
from titan.models.qwen3_moe.adapter import Qwen3MoeStateDictAdapter
from titan.models.qwen3_moe.args import QWEN3_MOE_FLAVORS

FAMILIES = {
    "llama3": (Llama3StateDictAdapter, LLAMA3_FLAVORS, transformers.LlamaConfig),
    "qwen3": (Qwen3StateDictAdapter, QWEN3_FLAVORS, transformers.Qwen3Config),
    "qwen3_moe": (Qwen3MoeStateDictAdapter, QWEN3_MOE_FLAVORS, transformers.Qwen3MoeConfig),
    "deepseek_v3": (DeepseekV3StateDictAdapter, DEEPSEEK_V3_FLAVORS, transformers.DeepseekV3Config),
}


def _adapter(family: str, **changes):
    adapter_class, flavors, _ = FAMILIES[family]
    return adapter_class(dataclasses.replace(copy.deepcopy(flavors["debugmodel"]), **changes))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_model_has_no_differences_in_either_spelling(family):
    adapter = _adapter(family)
    written = adapter.hf_config()
    assert adapter.config_differences(written) == []
    # transformers' own serialization of the same config (its defaults and key spellings)
    config_class = FAMILIES[family][2]
    assert adapter.config_differences(config_class(**written).to_dict()) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_different_rope_base_or_norm_epsilon_is_named(family):
    adapter = _adapter(family)
    other = _adapter(family, rope_theta=adapter.args.rope_theta * 2, norm_eps=adapter.args.norm_eps * 10)
    lines = adapter.config_differences(other.hf_config())
    assert [line.split(":")[0] for line in lines] == ["norm_eps", "rope_theta"]
    assert f"rope_theta: checkpoint {other.args.rope_theta!r}, this run {adapter.args.rope_theta!r}" in lines


@pytest.mark.parametrize("family", FAMILIES)
def test_the_run_own_settings_are_not_differences(family):
    """The context a run trains at (RoPE tables are built to it) and its balancing-loss
    settings are the run's to choose."""
    adapter = _adapter(family)
    config = adapter.hf_config()
    config["max_position_embeddings"] = 4 * adapter.args.max_seq_len
    if "router_aux_loss_coef" in config:
        config["router_aux_loss_coef"] = 0.25
    assert adapter.config_differences(config) == []


def test_sizes_and_the_ffn_width_are_named_not_the_rule_that_gives_it():
    adapter = _adapter("llama3")
    other = Llama3StateDictAdapter(dataclasses.replace(copy.deepcopy(LLAMA3_FLAVORS["debugmodel"]),
                                                       n_layers=2, ffn_dim=384))
    assert adapter.config_differences(other.hf_config()) == [
        "n_layers: checkpoint 2, this run 6",
        f"ffn_hidden_dim: checkpoint 384, this run {adapter.args.ffn_hidden_dim}",
    ]


def test_an_activation_the_family_does_not_run_is_named():
    adapter = _adapter("llama3")
    config = adapter.hf_config()
    config["hidden_act"] = "gelu"
    assert adapter.config_differences(config) == ["hidden_act: checkpoint 'gelu', this run 'silu'"]


def test_another_family_is_named_by_its_model_type_alone():
    adapter = _adapter("llama3")
    assert adapter.config_differences(_adapter("qwen3").hf_config()) == [
        "model_type: checkpoint 'qwen3', this run 'llama'"
    ]


def test_a_feature_the_family_lacks_raises_its_own_error():
    adapter = _adapter("qwen3")
    config = adapter.hf_config()
    config["use_sliding_window"] = True
    with pytest.raises(ValueError, match="sliding-window"):
        adapter.config_differences(config)
