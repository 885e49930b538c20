"""Hugging Face parity of Llama3StateDictAdapter against transformers.LlamaForCausalLM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan.models.llama3 import LLAMA3_FLAVORS, Llama3Model, Llama3StateDictAdapter

transformers = pytest.importorskip("transformers")

# Small original context so llama3 scaling changes frequencies that matter at seq 32.
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_config():
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(ROPE_SCALING),
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _randomize(model):
    # Perturb every weight (norms included) so a swapped name cannot go unnoticed.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return _randomize(transformers.LlamaForCausalLM(_hf_config())).eval()


@pytest.fixture(scope="module")
def adapter(hf_model):
    return Llama3StateDictAdapter(
        Llama3StateDictAdapter.args_from_hf_config(hf_model.config.to_dict())
    )


def _tokens():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))


def _titan_from(adapter, hf_state):
    model = Llama3Model(adapter.args)
    model.load_state_dict(adapter.from_hf(hf_state), strict=True)
    return model.eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_args_from_hf_config(adapter):
    a = adapter.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (64, 2, 4, 2, 128)
    assert a.ffn_hidden_dim == 192 and a.rope_theta == 10000.0 and a.max_seq_len == 256
    assert a.rope_scaling.original_max_position_embeddings == 64 and a.rope_scaling.factor == 8


def test_from_hf_logits_match(hf_model, adapter):
    tokens = _tokens()
    titan = _titan_from(adapter, hf_model.state_dict())
    with torch.no_grad():
        diff = (titan(tokens) - _hf_logits(hf_model, tokens)).abs().max()
    assert diff <= 1e-5


def test_parity_depends_on_rope_scaling(hf_model, adapter):
    # Guards the parity test itself: without scaling the logits must visibly differ.
    unscaled = Llama3StateDictAdapter(dataclasses.replace(adapter.args, rope_scaling=None))
    tokens = _tokens()
    with torch.no_grad():
        diff = (
            (_titan_from(unscaled, hf_model.state_dict())(tokens) - _hf_logits(hf_model, tokens))
            .abs()
            .max()
        )
    assert diff > 1e-3


def test_to_hf_logits_match(adapter):
    args = adapter.args
    torch.manual_seed(1)
    titan = Llama3Model(args)
    titan.init_weights()
    _randomize(titan)
    hf = transformers.LlamaForCausalLM(_hf_config()).eval()
    hf.load_state_dict(adapter.to_hf(titan.state_dict()), strict=True)
    tokens = _tokens()
    with torch.no_grad():
        diff = (titan.eval()(tokens) - _hf_logits(hf, tokens)).abs().max()
    assert diff <= 1e-5


def test_round_trip_is_bit_identical(hf_model, adapter):
    hf_state = hf_model.state_dict()
    back = adapter.to_hf(adapter.from_hf(hf_state))
    assert back.keys() == hf_state.keys()
    for key, value in hf_state.items():
        assert torch.equal(back[key], value), key


def test_q_and_k_are_permuted_and_others_are_not(hf_model, adapter):
    titan_state = adapter.from_hf(hf_model.state_dict())
    hf_state = hf_model.state_dict()
    assert not torch.equal(
        titan_state["layers.0.attention.wk.weight"],
        hf_state["model.layers.0.self_attn.k_proj.weight"],
    )
    assert torch.equal(
        titan_state["layers.0.attention.wv.weight"],
        hf_state["model.layers.0.self_attn.v_proj.weight"],
    )


def test_partial_state_dict_maps_key_by_key(hf_model, adapter):
    # A later pipeline stage holds layer 1, the final norm and the output only.
    full = adapter.from_hf(hf_model.state_dict())
    stage = {
        k: v
        for k, v in hf_model.state_dict().items()
        if not k.startswith(("model.layers.0.", "model.embed"))
    }
    converted = adapter.from_hf(stage)
    assert set(converted) == {k for k in full if not k.startswith(("layers.0.", "tok_embeddings"))}
    for key, value in converted.items():
        assert torch.equal(value, full[key]), key
    assert adapter.to_hf(converted).keys() == stage.keys()


def test_unknown_keys_are_rejected_and_derived_buffers_dropped(adapter):
    with pytest.raises(ValueError, match="not a Llama 3 parameter"):
        adapter.to_hf({"layers.0.attention.q_norm.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a LlamaForCausalLM parameter"):
        adapter.from_hf({"transformer.h.0.attn.c_attn.weight": torch.zeros(1)})
    assert adapter.from_hf({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}) == {}


def test_hf_config_builds_a_model_that_loads_converted_weights_strictly(hf_model, adapter):
    cfg = adapter.hf_config(torch_dtype="float32")
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is False
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    rebuilt.load_state_dict(adapter.to_hf(adapter.from_hf(hf_model.state_dict())), strict=True)
    tokens = _tokens()
    torch.testing.assert_close(
        _hf_logits(rebuilt, tokens), _hf_logits(hf_model, tokens), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("flavor", ["debugmodel", "1B", "8B", "405B"])
def test_flavor_config_round_trips(flavor):
    args = LLAMA3_FLAVORS[flavor]
    cfg = Llama3StateDictAdapter(args).hf_config()
    assert Llama3StateDictAdapter.args_from_hf_config(cfg) == args
    # ... and through transformers' own normalization (rope_parameters layout in v5).
    normalized = transformers.LlamaConfig(**cfg).to_dict()
    assert Llama3StateDictAdapter.args_from_hf_config(normalized) == args
    if args.vocab_size > 128001:
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (128000, 128001)


def test_unscaled_config_has_no_rope_scaling():
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], rope_scaling=None)
    cfg = Llama3StateDictAdapter(args).hf_config()
    assert cfg["rope_scaling"] is None
    assert (
        Llama3StateDictAdapter.args_from_hf_config(transformers.LlamaConfig(**cfg).to_dict())
        == args
    )


# ---- tied input/output embeddings (Llama 3.2 1B/3B layout) ---------------------------------


def _tied_hf_model():
    cfg = _hf_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(2)
    model = _randomize(transformers.LlamaForCausalLM(cfg)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # transformers really tied it
    return model


def _tied_adapter(hf_model):
    return Llama3StateDictAdapter(
        Llama3StateDictAdapter.args_from_hf_config(hf_model.config.to_dict())
    )


def _safetensors_weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_tied_config_is_read_and_written():
    hf_model = _tied_hf_model()
    args = _tied_adapter(hf_model).args
    assert args.tie_word_embeddings is True
    assert Llama3StateDictAdapter(args).hf_config()["tie_word_embeddings"] is True
    assert LLAMA3_FLAVORS["1B"].tie_word_embeddings and LLAMA3_FLAVORS["3B"].tie_word_embeddings
    assert not LLAMA3_FLAVORS["8B"].tie_word_embeddings


def test_tied_checkpoint_from_transformers_loads_with_equal_logits(tmp_path):
    hf_model = _tied_hf_model()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    weights = _safetensors_weights(tmp_path)
    assert "lm_head.weight" not in weights  # the Hub layout: the shared matrix is stored once
    adapter = _tied_adapter(hf_model)
    titan = Llama3Model(adapter.args)
    titan.load_state_dict(adapter.from_hf(weights), strict=True)
    assert titan.output.weight is titan.tok_embeddings.weight
    tokens = _tokens()
    with torch.no_grad():
        diff = (titan.eval()(tokens) - _hf_logits(hf_model, tokens)).abs().max()
    assert diff <= 1e-5


def test_tied_titan_model_exports_hub_layout_that_transformers_loads(tmp_path):
    import json

    from safetensors.torch import save_file

    adapter = _tied_adapter(_tied_hf_model())
    torch.manual_seed(3)
    titan = Llama3Model(adapter.args)
    titan.init_weights(seed=3)
    _randomize(titan)
    hf_state = adapter.to_hf(titan.state_dict())
    assert "lm_head.weight" not in hf_state and "model.embed_tokens.weight" in hf_state
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(torch_dtype="float32")))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    torch.testing.assert_close(hf.lm_head.weight, titan.output.weight, rtol=0, atol=0)
    tokens = _tokens()
    with torch.no_grad():
        diff = (titan.eval()(tokens) - _hf_logits(hf, tokens)).abs().max()
    assert diff <= 1e-5


def test_tied_round_trip_keeps_one_matrix():
    hf_model = _tied_hf_model()
    adapter = _tied_adapter(hf_model)
    hub = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    titan_state = adapter.from_hf(hub)
    assert titan_state["output.weight"] is titan_state["tok_embeddings.weight"]
    back = adapter.to_hf(titan_state)
    assert back.keys() == hub.keys()
    for key, value in hub.items():
        assert torch.equal(back[key], value), key
    # A piece holding the output but not the embedding still carries the shared matrix.
    assert adapter.to_hf({"output.weight": hub["model.embed_tokens.weight"]}).keys() == {
        "model.embed_tokens.weight"
    }


def test_untied_model_refuses_a_checkpoint_without_lm_head(adapter):
    hub = {k: v for k, v in _tied_hf_model().state_dict().items() if k != "lm_head.weight"}
    assert adapter.args.tie_word_embeddings is False
    with pytest.raises(ValueError, match="no lm_head.weight.*tie_word_embeddings=True"):
        adapter.from_hf(hub)


def test_tied_model_refuses_a_different_lm_head():
    hf_model = _tied_hf_model()
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        _tied_adapter(hf_model).from_hf(state)
