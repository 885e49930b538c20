"""A checkpoint's `config.json` against the run's model: same model, or each field that differs.

Matching tensor shapes do not prove the same model, so loading Hugging Face weights compares
the architecture too (`hf_config_differences`, through the adapters' `config_differences`).
"""

from __future__ import annotations

import copy
import dataclasses
import re

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


@pytest.mark.parametrize("key, value, named", [
    ("hidden_act", "gelu", "hidden_act 'gelu' (only 'silu')"),
    ("attention_bias", True, "attention_bias=true"),
    ("mlp_bias", True, "mlp_bias=true"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
])
def test_a_llama_feature_titan_does_not_implement_is_refused_by_name(key, value, named):
    """Not a difference a flavor could fix: the family's own error says what it lacks."""
    adapter = _adapter("llama3")
    config = adapter.hf_config()
    config[key] = value
    if key == "rope_scaling":
        config.pop("rope_parameters")
    with pytest.raises(ValueError, match=f"features titan's llama3 does not implement: {re.escape(named)}"):
        adapter.config_differences(config)


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


# The published Hub config.json files of these releases (their architecture keys, as the Hub
# serves them: transformers 4 spellings, rope_scaling "type" and "rope_type", extra keys).
PUBLISHED = {
    "Llama-3.1-8B": (Llama3StateDictAdapter, LLAMA3_FLAVORS["8B"], {"architectures":["LlamaForCausalLM"],"attention_bias":False,"attention_dropout":0.0,"bos_token_id":128000,"eos_token_id":128001,"hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,"intermediate_size":14336,"max_position_embeddings":131072,"mlp_bias":False,"model_type":"llama","num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,"pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},"rope_theta":500000.0,"tie_word_embeddings":False,"torch_dtype":"bfloat16","transformers_version":"4.43.0.dev0","use_cache":True,"vocab_size":128256}),
    "Llama-3.2-1B": (Llama3StateDictAdapter, LLAMA3_FLAVORS["1B"], {"architectures":["LlamaForCausalLM"],"attention_bias":False,"attention_dropout":0.0,"bos_token_id":128000,"eos_token_id":128001,"head_dim":64,"hidden_act":"silu","hidden_size":2048,"initializer_range":0.02,"intermediate_size":8192,"max_position_embeddings":131072,"mlp_bias":False,"model_type":"llama","num_attention_heads":32,"num_hidden_layers":16,"num_key_value_heads":8,"pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},"rope_theta":500000.0,"tie_word_embeddings":True,"torch_dtype":"bfloat16","transformers_version":"4.45.0.dev0","use_cache":True,"vocab_size":128256}),
    "Qwen3-0.6B": (Qwen3StateDictAdapter, QWEN3_FLAVORS["0.6B"], {"architectures":["Qwen3ForCausalLM"],"attention_bias":False,"attention_dropout":0.0,"bos_token_id":151643,"eos_token_id":151645,"head_dim":128,"hidden_act":"silu","hidden_size":1024,"initializer_range":0.02,"intermediate_size":3072,"max_position_embeddings":40960,"max_window_layers":28,"model_type":"qwen3","num_attention_heads":16,"num_hidden_layers":28,"num_key_value_heads":8,"rms_norm_eps":1e-06,"rope_scaling":None,"rope_theta":1000000,"sliding_window":None,"tie_word_embeddings":True,"torch_dtype":"bfloat16","transformers_version":"4.51.0","use_cache":True,"use_sliding_window":False,"vocab_size":151936}),
    "Qwen3-30B-A3B": (Qwen3MoeStateDictAdapter, QWEN3_MOE_FLAVORS["30B-A3B"], {"architectures":["Qwen3MoeForCausalLM"],"attention_bias":False,"attention_dropout":0.0,"bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151645,"head_dim":128,"hidden_act":"silu","hidden_size":2048,"initializer_range":0.02,"intermediate_size":6144,"max_position_embeddings":40960,"max_window_layers":48,"mlp_only_layers":[],"model_type":"qwen3_moe","moe_intermediate_size":768,"norm_topk_prob":True,"num_attention_heads":32,"num_experts":128,"num_experts_per_tok":8,"num_hidden_layers":48,"num_key_value_heads":4,"output_router_logits":False,"rms_norm_eps":1e-06,"rope_scaling":None,"rope_theta":1000000.0,"router_aux_loss_coef":0.001,"sliding_window":None,"tie_word_embeddings":False,"torch_dtype":"bfloat16","transformers_version":"4.51.0","use_cache":True,"use_sliding_window":False,"vocab_size":151936}),
    "DeepSeek-V3": (DeepseekV3StateDictAdapter, DEEPSEEK_V3_FLAVORS["671B"], {"architectures":["DeepseekV3ForCausalLM"],"attention_bias":False,"attention_dropout":0.0,"aux_loss_alpha":0.001,"bos_token_id":0,"eos_token_id":1,"ep_size":1,"first_k_dense_replace":3,"hidden_act":"silu","hidden_size":7168,"initializer_range":0.02,"intermediate_size":18432,"kv_lora_rank":512,"max_position_embeddings":163840,"model_type":"deepseek_v3","moe_intermediate_size":2048,"moe_layer_freq":1,"n_group":8,"n_routed_experts":256,"n_shared_experts":1,"norm_topk_prob":True,"num_attention_heads":128,"num_experts_per_tok":8,"num_hidden_layers":61,"num_key_value_heads":128,"num_nextn_predict_layers":1,"q_lora_rank":1536,"qk_nope_head_dim":128,"qk_rope_head_dim":64,"rms_norm_eps":1e-06,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,"mscale_all_dim":1.0,"original_max_position_embeddings":4096,"type":"yarn"},"rope_theta":10000,"routed_scaling_factor":2.5,"scoring_func":"sigmoid","seq_aux":True,"tie_word_embeddings":False,"topk_group":4,"topk_method":"noaux_tc","torch_dtype":"bfloat16","transformers_version":"4.33.1","use_cache":True,"v_head_dim":128,"vocab_size":129280}),
}


@pytest.mark.parametrize("release", PUBLISHED)
def test_the_published_releases_are_the_flavors_a_recipe_trains(release):
    """No false refusal: each release's own config.json is its titan flavor (with the
    recipe's vocabulary and a training context shorter than the release's)."""
    adapter_class, flavor, config = PUBLISHED[release]
    run = dataclasses.replace(copy.deepcopy(flavor), vocab_size=config["vocab_size"], max_seq_len=4096)
    assert adapter_class(run).config_differences(config) == []
