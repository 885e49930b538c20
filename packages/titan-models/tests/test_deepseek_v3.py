"""DeepSeek-V3: logits parity with transformers.DeepseekV3ForCausalLM (tiny random configs
written with `save_pretrained`: the Hub's per-expert layout), the router's selection against
transformers' on negative biased scores, exports that `from_pretrained` loads, YaRN against
transformers' RoPE init, the MLA inference cache, sizes and the plan."""

from __future__ import annotations

import json
import math

import pytest
import torch
from titan.models.common.kv_cache import KVCache
from titan.models.common.moe import MoE
from titan.models.common.rope import YarnScaling, rope_inv_freq
from titan.models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DeepseekV3Model,
    DeepseekV3StateDictAdapter,
    build_deepseek_v3,
)
from titan_models_testlib import hf_logits, load_folder, rel_err, titan_from_folder

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

VOCAB = 256
REL_TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0}
CONFIGS = {
    # The tiny config: low-rank queries, YaRN with mscale == mscale_all_dim.
    "q_lora_yarn": {},
    # Direct queries, plain RoPE.
    "no_q_lora_plain_rope": {"q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    # YaRN whose cos/sin scale is not 1 (mscale != mscale_all_dim) and a wider ramp.
    "yarn_attention_factor": {"rope_parameters": {**YARN, "factor": 8.0, "original_max_position_embeddings": 32,
                                                  "mscale": 0.7, "mscale_all_dim": 1.0}},
}


def _hf_config(**changes):
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        rope_parameters=dict(YARN), attn_implementation="eager",
    )
    return transformers.DeepseekV3Config(**{**fields, **changes})


def _randomize(model):
    # Every weight perturbed (norms and router too) and the selection bias drawn wide enough
    # that biased scores go negative: a swapped name or a misused bias shows in the logits.
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if name.endswith("gate.weight") else 0.1
            param.add_(torch.randn_like(param) * scale)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias") or name.endswith("expert_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5 - 0.3)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def saved_hf(request, tmp_path_factory):
    """A random DeepseekV3ForCausalLM saved with save_pretrained, and its folder."""
    torch.manual_seed(0)
    model = _randomize(transformers.DeepseekV3ForCausalLM(_hf_config(**CONFIGS[request.param]))).eval()
    folder = tmp_path_factory.mktemp("deepseek_v3_hf")
    model.save_pretrained(folder)
    return model, folder


def _tokens(seq_len: int = 48):
    return torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(0))










def test_saved_layout_is_the_hub_layout(saved_hf):
    _, folder = saved_hf
    _, state = load_folder(folder)
    assert state["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert state["model.layers.2.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert state["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (64, 32)
    assert state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (16 + 8, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in state  # the dense first layer


def test_from_hf_builds_mla_and_the_moe_layers(saved_hf):
    _, folder = saved_hf
    model, adapter, _ = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    a = adapter.args
    assert (a.n_routed_experts, a.n_group, a.topk_group, a.first_k_dense_replace) == (8, 2, 1, 1)
    assert not isinstance(model.layers["0"].feed_forward, MoE)
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE) and moe.router.score_func == "sigmoid" and moe.shared_experts is not None
    assert torch.count_nonzero(moe.expert_bias) > 0  # the checkpoint's bias, loaded


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_from_hf_logits_match(saved_hf, grouped):
    hf_model, folder = saved_hf
    titan, _, _ = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    for i in ("1", "2"):
        titan.layers[i].feed_forward.experts.use_grouped_mm = grouped
    tokens = _tokens()
    with torch.no_grad():
        got = titan(tokens)
    assert rel_err(got, hf_logits(hf_model, tokens)) <= REL_TOL


def test_parity_needs_the_bias_and_the_yarn_scale(saved_hf):
    # Guards the parity test: routing without the checkpoint's selection bias, or attention
    # without YaRN's softmax multiplier, must change the logits.
    hf_model, folder = saved_hf
    tokens = _tokens()
    reference = hf_logits(hf_model, tokens)
    titan, _, _ = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    with torch.no_grad():
        for i in ("1", "2"):
            titan.layers[i].feed_forward.expert_bias.zero_()
        assert rel_err(titan(tokens), reference) > 1e-3
    titan, adapter, _ = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    if adapter.args.rope_scaling is not None:
        for layer in titan.layers.values():
            layer.attention.softmax_scale_multiplier = 1.0
        with torch.no_grad():
            assert rel_err(titan(tokens), reference) > 1e-4


def test_router_selection_equals_transformers_with_negative_biased_scores():
    cfg = _hf_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    hf_router = hf_ds.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        hf_router.weight.normal_(0, 1.0)
        # Sigmoid scores are in (0, 1): a bias below -1 makes every biased score of some experts negative.
        hf_router.e_score_correction_bias.copy_(torch.linspace(-1.5, 0.2, 16)[torch.randperm(16)])
    args = DeepseekV3StateDictAdapter.args_from_hf_config(cfg.to_dict())
    moe = build_deepseek_v3("debugmodel_tiny", **{k: getattr(args, k) for k in (
        "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok")}).layers["1"].feed_forward
    with torch.no_grad():
        moe.router.gate.weight.copy_(hf_router.weight)
        moe.expert_bias.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(512, 64)
    scores = moe.router.scores(x)
    biased = scores + moe.expert_bias
    assert (biased < 0).any(dim=-1).float().mean() > 0.5  # the case the issue names
    selected = moe.router.select(scores, moe.expert_bias)
    weights = moe.router.weights(scores, selected)
    _, hf_weights, hf_selected = hf_router(x)
    hf_order = hf_selected.sort(dim=-1)
    titan_order = selected.sort(dim=-1)
    assert torch.equal(titan_order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(-1, titan_order.indices),
                               hf_weights.gather(-1, hf_order.indices), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope", [CONFIGS["q_lora_yarn"], CONFIGS["yarn_attention_factor"]], ids=["yarn", "yarn_af"])
def test_yarn_frequencies_and_scales_equal_transformers(rope):
    cfg = _hf_config(**rope)
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(cfg)
    args = DeepseekV3StateDictAdapter.args_from_hf_config(cfg.to_dict())
    assert isinstance(args.rope_scaling, YarnScaling)
    ours = rope_inv_freq(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours, hf_rotary.inv_freq, rtol=1e-6, atol=0)
    assert args.rope_scaling.cos_sin_scale() == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)
    hf_scale = hf_ds.DeepseekV3Attention(cfg, 0).scaling
    ours_scale = args.rope_scaling.softmax_scale_multiplier() / math.sqrt(args.head_dim)
    assert ours_scale == pytest.approx(hf_scale, rel=1e-12)


def test_export_loads_with_from_pretrained(saved_hf, tmp_path):
    _, folder = saved_hf
    cfg, _ = load_folder(folder)
    args = DeepseekV3StateDictAdapter.args_from_hf_config(cfg)
    titan = DeepseekV3Model(args)
    titan.init_weights(seed=1)
    _randomize(titan).eval()
    adapter = DeepseekV3StateDictAdapter(args)
    hf_state = {k: v.contiguous() for k, v in adapter.to_hf(titan.state_dict()).items()}
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in hf_state
    assert not any("experts.w" in k for k in hf_state)
    safetensors_torch.save_file(hf_state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(torch_dtype="float32")))
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (loaded.config.n_routed_experts, loaded.config.q_lora_rank) == (8, args.q_lora_rank)
    bias = loaded.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, titan.layers["1"].feed_forward.expert_bias)
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(titan(tokens), hf_logits(loaded, tokens)) <= REL_TOL


def test_round_trip_is_bit_identical(saved_hf):
    _, folder = saved_hf
    _, adapter, state = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    back = adapter.to_hf(adapter.from_hf(state))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_mtp_weights_are_skipped_with_a_warning(saved_hf):
    _, folder = saved_hf
    _, adapter, state = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    state = {**state, "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
             "model.layers.3.enorm.weight": torch.ones(64)}
    with pytest.warns(UserWarning, match="multi-token prediction"):
        out = adapter.from_hf(state)
    assert not any(k.startswith("layers.3.") for k in out)


def test_unknown_key_and_missing_expert_are_errors(saved_hf):
    _, folder = saved_hf
    _, adapter, state = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    with pytest.raises(ValueError, match="not a DeepseekV3ForCausalLM parameter"):
        adapter.from_hf({**state, "model.layers.1.self_attn.q_proj.bias": torch.zeros(4)})
    with pytest.raises(ValueError, match="has no weight 'model.layers.1.self_attn.o_proj.bias' beside it"):
        adapter.from_hf({**state, "model.layers.1.self_attn.o_proj.bias_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match=r"\(2, 1\) scales do not tile a 64 x 64 weight in 128 x 128 blocks"):
        adapter.from_hf({**state, "model.layers.1.self_attn.o_proj.weight_scale_inv": torch.ones(2, 1)})
    del state["model.layers.2.mlp.experts.5.gate_proj.weight"]
    with pytest.raises(ValueError, match="missing \\[5\\]"):
        adapter.from_hf(state)


@pytest.mark.parametrize("change, message", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"aux_loss_alpha": 0.001, "seq_aux": False}, "seq_aux=false"),
])
def test_unsupported_configs_are_refused(change, message):
    cfg = {**_hf_config().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        DeepseekV3StateDictAdapter.args_from_hf_config(cfg)


def test_the_sequence_wise_balance_loss_comes_from_the_config_and_goes_back():
    """The release's `aux_loss_alpha` (with `seq_aux`) is the model's sequence-wise balance
    loss: read on import, written on export, and it leaves a loss in a training forward."""
    args = DeepseekV3StateDictAdapter.args_from_hf_config({**_hf_config().to_dict(), "aux_loss_alpha": 0.001,
                                                          "seq_aux": True})
    assert args.router_aux_loss_coef == 0.001
    exported = DeepseekV3StateDictAdapter(args).hf_config()
    assert (exported["aux_loss_alpha"], exported["seq_aux"]) == (0.001, True)
    model = DeepseekV3Model(args).train()
    model.init_weights(seed=0)  # the constructor leaves the weights uninitialized (NaN in some runs)
    model(torch.randint(0, args.vocab_size, (2, 8)))
    aux = model.aux_loss()
    assert aux is not None and aux.requires_grad
    per_layer = [model.layers[str(i)].feed_forward.sequence_aux_loss for i in range(args.first_k_dense_replace,
                                                                                   args.n_layers)]
    torch.testing.assert_close(aux, torch.stack(per_layer).sum())
    assert DeepseekV3StateDictAdapter.args_from_hf_config(_hf_config().to_dict()).router_aux_loss_coef == 0.0


def test_hf_config_round_trips_args():
    args = DeepseekV3StateDictAdapter.args_from_hf_config(_hf_config().to_dict())
    again = DeepseekV3StateDictAdapter.args_from_hf_config(DeepseekV3StateDictAdapter(args).hf_config())
    assert again == args
    cfg = transformers.DeepseekV3Config(**DeepseekV3StateDictAdapter(args).hf_config())
    assert (cfg.n_routed_experts, cfg.kv_lora_rank, cfg.rope_parameters["rope_type"]) == (8, 16, "yarn")


def test_cached_greedy_decoding_equals_full_forwards():
    # The MLA cache stores one latent and one rotated key part per token (not per-head K/V);
    # decoding token by token from it must give the logits of a full forward.
    torch.manual_seed(0)
    model = build_deepseek_v3("debugmodel_tiny", vocab_size=VOCAB)
    model.init_weights(seed=0)
    _randomize(model).eval()
    prompt = _tokens(12)
    cache = KVCache.for_model(model, batch_size=2, max_len=20)
    assert cache.k[0].shape == (2, 1, 20, model.args.kv_lora_rank)
    assert cache.v[0].shape == (2, 1, 20, model.args.qk_rope_head_dim)
    tokens = prompt
    with torch.no_grad():
        step_logits = model(prompt, kv_cache=cache)[:, -1]
        for _ in range(6):
            nxt = step_logits.argmax(-1, keepdim=True)
            full = model(tokens)[:, -1]
            torch.testing.assert_close(step_logits, full, rtol=1e-5, atol=1e-5)
            tokens = torch.cat([tokens, nxt], dim=1)
            step_logits = model(nxt, kv_cache=cache)[:, -1]


@pytest.mark.parametrize(
    "flavor, total, active",
    # DeepSeek-V3's report: 671B total, 37B activated (without the 14B MTP module).
    [("671B", 671.0e9, 37.5e9), ("16B", 15.7e9, 2.66e9)],
)
def test_published_sizes_and_plan(flavor, total, active):
    with torch.device("meta"):
        model = build_deepseek_v3(flavor)
    assert model.num_params() == pytest.approx(total, rel=0.01)
    assert model.num_active_params() == pytest.approx(active, rel=0.01)
    a = model.args
    # 6 x the active non-embedding parameters + attention, whose scores run over nope + rope
    # channels and whose weighted sum over v channels.
    attention = 6 * a.n_layers * a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * 4096
    assert model.flops_per_token(4096) == 6 * model.num_active_params(exclude_embedding=True) + attention
    plan = model.sharding_plan()
    n_experts = DEEPSEEK_V3_FLAVORS[flavor].n_routed_experts
    assert plan.expert_parallel_divisible == {"n_routed_experts": n_experts}
    assert plan.tensor_parallel["layers.*.attention.wkv_a"] == "replicate"
    assert plan.tensor_parallel["layers.*.attention.wkv_b"] == "colwise"
    first_moe = DEEPSEEK_V3_FLAVORS[flavor].first_k_dense_replace
    assert plan.tensor_parallel[f"layers.{first_moe}.feed_forward"] == "replicated_block"
    assert plan.tensor_parallel[f"layers.{first_moe - 1}.feed_forward"] == "block_input"


def test_the_hubs_config_layout_is_read():
    """The release's config.json spelling: `rope_scaling` with "type", `rope_theta` at top level,
    and the keys transformers does not use (MTP, scoring, top-k method)."""
    cfg = {**_hf_config().to_dict(), "rope_theta": 10000.0, "num_nextn_predict_layers": 1,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    cfg.pop("rope_parameters")
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    args = DeepseekV3StateDictAdapter.args_from_hf_config(cfg)
    assert args.rope_theta == 10000.0
    assert args.rope_scaling == YarnScaling(factor=40, original_max_position_embeddings=4096, mscale=1.0,
                                            mscale_all_dim=1.0)


def _quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, float32 scale per 128 x 128 block, the last ones partial): the
    release's scheme, written block by block as a reference."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def _dequantize_by_blocks(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(quantized.shape, dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = (quantized[rows, cols].float() * scale[i, j]).to(torch.bfloat16)
    return out


def test_the_release_fp8_checkpoint_is_dequantized_on_import(tmp_path):
    """The Hub's DeepSeek-V3 stores its projections in fp8 with one scale per 128 x 128 block
    (`quantization_config`): imported as bf16 weights equal to a block-by-block dequantization,
    and the model's logits equal transformers' on those weights. The dense FFN (200 wide) has
    partial blocks both ways."""
    torch.manual_seed(0)
    hf_model = _randomize(transformers.DeepseekV3ForCausalLM(_hf_config(intermediate_size=200))).eval()
    hf_model.save_pretrained(tmp_path / "bf16")
    config, state = load_folder(tmp_path / "bf16")
    released, dequantized = {}, {}
    for key, value in state.items():
        if key.endswith("proj.weight") and value.ndim == 2:  # every projection, as the release
            quantized, scale = _quantize_fp8_blocks(value)
            released[key], released[key + "_scale_inv"] = quantized, scale
            dequantized[key] = _dequantize_by_blocks(quantized, scale)
        else:
            released[key] = dequantized[key] = value
    assert released["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert released["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    folder = tmp_path / "fp8"
    folder.mkdir()
    safetensors_torch.save_file(released, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))

    titan, adapter, _ = titan_from_folder(folder, DeepseekV3StateDictAdapter, DeepseekV3Model)
    expected = adapter.from_hf(dequantized)
    for key, value in titan.state_dict().items():
        if key in expected:
            assert torch.equal(value, expected[key].to(value.dtype)), key
    assert adapter.from_hf(released)["layers.0.feed_forward.w1.weight"].dtype == torch.bfloat16
    reference = tmp_path / "dequantized"  # the same weights as transformers loads a Hub folder
    reference.mkdir()
    safetensors_torch.save_file({k: v.float().contiguous() for k, v in dequantized.items()},
                                str(reference / "model.safetensors"), metadata={"format": "pt"})
    (reference / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    hf_reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(reference), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(titan(tokens), hf_logits(hf_reference, tokens)) <= REL_TOL
