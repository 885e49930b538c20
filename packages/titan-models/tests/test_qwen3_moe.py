"""Qwen3-MoE: Hugging Face parity against transformers.Qwen3MoeForCausalLM (a tiny random
config written with `save_pretrained`: the Hub's per-expert layout), exports that
`from_pretrained` loads, sizes, the plan and the expert-load metrics."""

from __future__ import annotations

import json

import pytest
import torch
from titan.models.common.moe import MoE
from titan.models.qwen3_moe import (
    QWEN3_MOE_FLAVORS,
    Qwen3MoeModel,
    Qwen3MoeStateDictAdapter,
    build_qwen3_moe,
)
from titan_models_testlib import hf_logits, load_folder, rel_err, titan_from_folder

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 256
REL_TOL = 1e-5


def _hf_config(**changes):
    # Dims are multiples of 8 so transformers' grouped_mm expert kernel works on CPU; layer 0
    # dense (mlp_only_layers), layer 1 sparse.
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0], attn_implementation="eager",
    )
    return transformers.Qwen3MoeConfig(**{**fields, **changes})


def _randomize(model):
    # Every weight perturbed (norms and router too), and the router sharpened so the top-k
    # choice is far from ties: a swapped expert or name shows in the logits.
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if "gate." in name or name.endswith("router.gate.weight") else 0.1
            param.add_(torch.randn_like(param) * scale)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def saved_hf(request, tmp_path_factory):
    """A random Qwen3MoeForCausalLM saved with save_pretrained, and its folder."""
    torch.manual_seed(0)
    model = _randomize(transformers.Qwen3MoeForCausalLM(_hf_config(norm_topk_prob=request.param))).eval()
    folder = tmp_path_factory.mktemp("qwen3_moe_hf")
    model.save_pretrained(folder)
    return model, folder


def _tokens():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))










def test_saved_layout_is_the_hub_per_expert_layout(saved_hf):
    _, folder = saved_hf
    _, state = load_folder(folder)
    assert state["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert state["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (64, 32)
    assert state["model.layers.1.mlp.gate.weight"].shape == (8, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in state  # the dense layer


def test_from_hf_builds_the_moe_layers(saved_hf):
    _, folder = saved_hf
    model, adapter, _ = titan_from_folder(folder, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    a = adapter.args
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.mlp_only_layers) == (8, 2, 32, (0,))
    assert not isinstance(model.layers["0"].feed_forward, MoE)
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE) and moe.experts.w1.shape == (8, 32, 64) and moe.experts.w2.shape == (8, 64, 32)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_from_hf_logits_match(saved_hf, grouped):
    hf_model, folder = saved_hf
    titan, _, _ = titan_from_folder(folder, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    titan.layers["1"].feed_forward.experts.use_grouped_mm = grouped
    tokens = _tokens()
    with torch.no_grad():
        got = titan(tokens)
    assert rel_err(got, hf_logits(hf_model, tokens)) <= REL_TOL


def test_parity_needs_the_right_expert_order(saved_hf):
    # Guards the parity test: swapping two experts' weights must change the logits.
    hf_model, folder = saved_hf
    titan, _, _ = titan_from_folder(folder, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    with torch.no_grad():
        for w in (titan.layers["1"].feed_forward.experts.w1,):
            w[[0, 1]] = w[[1, 0]].clone()
        tokens = _tokens()
        assert rel_err(titan(tokens), hf_logits(hf_model, tokens)) > 1e-3


def test_training_loss_with_the_balancing_loss_is_transformers(tmp_path):
    """`router_aux_loss_coef` means what it means in the Hub's config: transformers' loss
    with `output_router_logits` (cross entropy + coef x `load_balancing_loss_func` over the
    router logits of every MoE layer, pooled before the product). Two MoE layers whose
    routing differs, so pooling and a per-layer sum disagree; loss and every gradient equal."""
    torch.manual_seed(0)
    config = _hf_config(num_hidden_layers=3, router_aux_loss_coef=0.05)
    hf_model = _randomize(transformers.Qwen3MoeForCausalLM(config))
    hf_model.save_pretrained(tmp_path)
    titan, _, _ = titan_from_folder(tmp_path, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    titan.train()
    assert titan.args.router_aux_loss_coef == 0.05
    tokens = _tokens()

    hf_out = hf_model(tokens, labels=tokens, output_router_logits=True)
    logits = titan(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    aux = titan.aux_loss()
    loss = ce + aux
    torch.testing.assert_close(aux, 0.05 * hf_out.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-6, atol=0)
    per_layer_sum = sum(titan.layers[i].feed_forward.aux_loss for i in ("1", "2"))
    assert abs(float(per_layer_sum.detach() - aux.detach())) > 100 * 1e-5 * float(aux.detach())  # pooling is what makes them equal

    hf_out.loss.backward()
    loss.backward()
    for i in (1, 2):
        hf_grad = hf_model.model.layers[i].mlp.gate.weight.grad
        grad = titan.layers[str(i)].feed_forward.router.gate.weight.grad
        assert rel_err(grad, hf_grad) <= REL_TOL
    assert rel_err(titan.tok_embeddings.weight.grad, hf_model.model.embed_tokens.weight.grad) <= REL_TOL


def test_export_loads_with_from_pretrained(saved_hf, tmp_path):
    _, folder = saved_hf
    cfg, _ = load_folder(folder)
    args = Qwen3MoeStateDictAdapter.args_from_hf_config(cfg)
    titan = Qwen3MoeModel(args)
    titan.init_weights(seed=1)
    _randomize(titan).eval()
    adapter = Qwen3MoeStateDictAdapter(args)
    hf_state = {k: v.contiguous() for k, v in adapter.to_hf(titan.state_dict()).items()}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in hf_state
    assert not any("expert_bias" in k or "experts.w" in k for k in hf_state)
    safetensors_torch.save_file(hf_state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(torch_dtype="float32")))
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.config.num_experts == 8 and list(loaded.config.mlp_only_layers) == [0]
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(titan(tokens), hf_logits(loaded, tokens)) <= REL_TOL


def test_round_trip_is_bit_identical(saved_hf):
    _, folder = saved_hf
    _, adapter, state = titan_from_folder(folder, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    back = adapter.to_hf(adapter.from_hf(state))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_streaming_export_maps_one_parameter_at_a_time():
    # The engine's full_state_dict(names="hf") calls to_hf with one parameter per call.
    args = QWEN3_MOE_FLAVORS["debugmodel_tiny"]
    adapter = Qwen3MoeStateDictAdapter(args)
    w2 = torch.randn(8, 64, 32)
    out = adapter.to_hf({"layers.1.feed_forward.experts.w2": w2})
    assert sorted(out) == sorted(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8))
    assert torch.equal(out["model.layers.1.mlp.experts.5.down_proj.weight"], w2[5])


def test_missing_expert_is_an_error(saved_hf):
    _, folder = saved_hf
    _, adapter, state = titan_from_folder(folder, Qwen3MoeStateDictAdapter, Qwen3MoeModel)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="missing \\[3\\]"):
        adapter.from_hf(state)


def test_hf_config_round_trips_args():
    args = Qwen3MoeStateDictAdapter.args_from_hf_config(_hf_config().to_dict())
    again = Qwen3MoeStateDictAdapter.args_from_hf_config(Qwen3MoeStateDictAdapter(args).hf_config())
    assert again == args
    cfg = transformers.Qwen3MoeConfig(**Qwen3MoeStateDictAdapter(args).hf_config())
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim) == (8, 32, 32)


@pytest.mark.parametrize(
    "flavor, total, active",
    [("30B-A3B", 30.5e9, 3.35e9), ("235B-A22B", 235.1e9, 22.2e9)],  # model cards: 30.5B / 3.3B, 235B / 22B
)
def test_published_sizes(flavor, total, active):
    with torch.device("meta"):
        model = build_qwen3_moe(flavor)
    assert model.num_params() == pytest.approx(total, rel=0.01)
    assert model.num_active_params() == pytest.approx(active, rel=0.01)
    plan = model.sharding_plan()
    assert plan.expert_modules == "layers.*.feed_forward.experts"
    assert plan.expert_parallel_divisible == {"n_experts": 128}
    assert plan.tensor_parallel["layers.*.feed_forward.router.gate"] == "replicate"


def test_expert_load_after_a_step_and_bias_checkpointed():
    model = build_qwen3_moe("debugmodel_tiny", load_balance_coeff=1e-3, vocab_size=VOCAB)
    model.init_weights(seed=0)
    model(_tokens()).sum().backward()
    assert model.expert_load() == {}  # nothing recorded before a step
    for module in model.modules():  # what the engine does after each optimizer step
        if hasattr(module, "after_optimizer_step"):
            module.after_optimizer_step(lambda t: t)
    load = model.expert_load()
    assert set(load) == {"moe/layers.1/imbalance", "moe/layers.1/max_load", "moe/imbalance_max"}
    assert 1.0 <= load["moe/layers.1/imbalance"] <= 8.0
    assert model.layers["1"].feed_forward.expert_bias.abs().sum() > 0
    assert "layers.1.feed_forward.expert_bias" in model.state_dict()


def test_expert_load_of_pipeline_stages_merges_into_the_whole_models():
    """Each pipeline stage reports its own layers; the merged record has all of them and the
    maximum imbalance over all of them, not the last stage's."""
    first = {"moe/layers.1/imbalance": 2.5, "moe/layers.1/max_load": 0.6, "moe/imbalance_max": 2.5}
    second = {"moe/layers.2/imbalance": 1.5, "moe/layers.2/max_load": 0.3, "moe/imbalance_max": 1.5}
    model = build_qwen3_moe("debugmodel_tiny", vocab_size=VOCAB)
    merged = model.merge_expert_load([first, second, {}])
    assert merged == {**first, **second, "moe/imbalance_max": 2.5}
    assert model.merge_expert_load([{}, {}]) == {}
