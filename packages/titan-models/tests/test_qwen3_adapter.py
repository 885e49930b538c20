"""Hugging Face parity of the Qwen3 family against transformers.Qwen3ForCausalLM.

The reference models come from a tiny random Qwen3Config written with `save_pretrained` and
read back from disk (the Hub layout), tied and untied; titan exports are loaded with
`from_pretrained`.
"""

from __future__ import annotations

import json

import pytest
import torch
from titan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter
from titan_models_testlib import hf_logits, load_folder, rel_err, titan_from_folder

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 256
REL_TOL = 1e-5


def _hf_config(tied: bool):
    # head_dim 32 with 4 heads on a width of 64: n_heads * head_dim != hidden_size, as in Qwen3.
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        attn_implementation="eager",
    )


def _randomize(model):
    # Perturb every weight, norms (q/k norms included) too, so a swapped name or a missing
    # permutation cannot go unnoticed.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved_hf(request, tmp_path_factory):
    """A random Qwen3ForCausalLM saved with save_pretrained, and its folder."""
    torch.manual_seed(0)
    model = _randomize(transformers.Qwen3ForCausalLM(_hf_config(request.param))).eval()
    folder = tmp_path_factory.mktemp("qwen3_hf")
    model.save_pretrained(folder)
    return model, folder, request.param


def _tokens():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))










def test_saved_layout_is_the_hub_layout(saved_hf):
    _, folder, tied = saved_hf
    _, state = load_folder(folder)
    assert "model.layers.0.self_attn.q_norm.weight" in state
    assert state["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert ("lm_head.weight" in state) is not tied


def test_args_from_saved_config(saved_hf):
    _, folder, tied = saved_hf
    model, adapter, _ = titan_from_folder(folder, Qwen3StateDictAdapter, Qwen3Model)
    a = adapter.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim) == (64, 2, 4, 2, 32)
    assert (a.ffn_hidden_dim, a.vocab_size, a.rope_theta, a.norm_eps) == (128, VOCAB, 1e6, 1e-6)
    assert a.tie_word_embeddings is tied
    assert (model.output.weight is model.tok_embeddings.weight) is tied


def test_from_hf_logits_match(saved_hf):
    hf_model, folder, _ = saved_hf
    titan, _, _ = titan_from_folder(folder, Qwen3StateDictAdapter, Qwen3Model)
    tokens = _tokens()
    with torch.no_grad():
        got = titan(tokens)
    assert rel_err(got, hf_logits(hf_model, tokens)) <= REL_TOL


def test_parity_needs_the_qk_norm_permutation(saved_hf):
    # Guards the parity test: loading the q/k norm weights without the RoPE-layout
    # permutation must visibly change the logits (the norms were randomized).
    hf_model, folder, _ = saved_hf
    titan, adapter, state = titan_from_folder(folder, Qwen3StateDictAdapter, Qwen3Model)
    raw = {k: v for k, v in state.items() if "_norm." in k and "self_attn" in k}
    with torch.no_grad():
        for key, value in raw.items():
            titan.get_parameter(adapter._titan_key(key)).copy_(value)
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(titan(tokens), hf_logits(hf_model, tokens)) > 1e-3


def test_export_loads_with_from_pretrained(saved_hf, tmp_path):
    _, folder, tied = saved_hf
    cfg, _ = load_folder(folder)
    args = Qwen3StateDictAdapter.args_from_hf_config(cfg)
    torch.manual_seed(1)
    titan = Qwen3Model(args)
    titan.init_weights(seed=1)
    _randomize(titan).eval()
    adapter = Qwen3StateDictAdapter(args)
    hf_state = {k: v.contiguous() for k, v in adapter.to_hf(titan.state_dict()).items()}
    assert ("lm_head.weight" in hf_state) is not tied
    safetensors_torch.save_file(hf_state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = adapter.hf_config(torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    loaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config.head_dim == 32 and loaded.config.tie_word_embeddings is tied
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(titan(tokens), hf_logits(loaded, tokens)) <= REL_TOL


def test_round_trip_is_bit_identical(saved_hf):
    _, folder, _ = saved_hf
    _, adapter, state = titan_from_folder(folder, Qwen3StateDictAdapter, Qwen3Model)
    back = adapter.to_hf(adapter.from_hf(state))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_hf_config_round_trips_args():
    args = Qwen3StateDictAdapter.args_from_hf_config(_hf_config(False).to_dict())
    again = Qwen3StateDictAdapter.args_from_hf_config(Qwen3StateDictAdapter(args).hf_config())
    assert again == args
    # transformers accepts the dict as is and reads the same shape back.
    cfg = transformers.Qwen3Config(**Qwen3StateDictAdapter(args).hf_config())
    assert (cfg.head_dim, cfg.rope_parameters["rope_theta"], cfg.tie_word_embeddings) == (32, 1e6, False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    cfg = {**_hf_config(False).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        Qwen3StateDictAdapter.args_from_hf_config(cfg)


def test_untied_model_refuses_a_tied_checkpoint():
    # A tied checkpoint has no lm_head.weight: an untied model must not get a random output.
    hub_state = {
        k: v for k, v in transformers.Qwen3ForCausalLM(_hf_config(True)).state_dict().items()
        if k != "lm_head.weight"  # save_pretrained writes a tied matrix once
    }
    args = Qwen3StateDictAdapter.args_from_hf_config(_hf_config(False).to_dict())
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        Qwen3StateDictAdapter(args).from_hf(hub_state)
