"""Llama3Model: meta build + init, pipeline stages, positions, sharding plan, DTensor init."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from titan.models.common import match_modules
from titan.models.common.rope import rope_cache
from titan.models.llama3 import build_llama3
from torch import nn

# Mirrors conftest.TINY (conftest cannot be imported under --import-mode=importlib).
TINY = dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq_len=64)


def _tokens(batch=2, seq=16, seed=1):
    return torch.randint(
        0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def test_meta_build_init_is_deterministic_and_complete(make_tiny):
    a, b = make_tiny(seed=3), make_tiny(seed=3)
    for (name, ta), tb in zip(
        a.state_dict(keep_vars=True).items(), b.state_dict().values(), strict=True
    ):
        assert ta.device.type == "cpu", name
        assert torch.isfinite(ta).all(), name
        assert torch.equal(ta, tb), name
    for name, buf in a.named_buffers():
        assert buf.device.type == "cpu" and torch.isfinite(buf).all(), name
    assert not torch.equal(a.output.weight, make_tiny(seed=4).output.weight)


def test_init_recomputes_rope_cache_after_to_empty(tiny_model):
    a = tiny_model.args
    expected = rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)
    assert torch.equal(tiny_model.rope_cache, expected)
    assert "rope_cache" not in tiny_model.state_dict()  # derived, never checkpointed


def test_init_scales_residual_projections_with_depth(tiny_model):
    layer = tiny_model.layers["0"]
    assert layer.attention.wo.weight.std() < 0.5 * layer.attention.wq.weight.std()
    assert layer.feed_forward.w2.weight.std() < 0.5 * layer.feed_forward.w1.weight.std()
    assert torch.equal(layer.ffn_norm.weight, torch.ones(TINY["dim"]))


def test_tiny_overrides_match_conftest(tiny):
    assert tiny == TINY


def test_forward_shapes_and_dtype(tiny_model):
    logits = tiny_model(_tokens())
    assert logits.shape == (2, 16, TINY["vocab_size"]) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model(_tokens(seq=TINY["max_seq_len"] + 1))


def _split_stage(model, keep, first, last):
    stage = copy.deepcopy(model)
    for key in list(stage.layers):
        if key not in keep:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = stage.output = None
    return stage


def test_pipeline_stages_chain_to_the_full_model(tiny_model):
    tokens = _tokens()
    first = _split_stage(tiny_model, {"0", "1"}, first=True, last=False)
    middle = _split_stage(tiny_model, {"2"}, first=False, last=False)
    last = _split_stage(tiny_model, {"3"}, first=False, last=True)
    hidden = first(tokens)
    assert hidden.shape == (2, 16, TINY["dim"]) and hidden.is_floating_point()
    hidden = middle(hidden)
    torch.testing.assert_close(last(hidden), tiny_model(tokens), rtol=0, atol=0)
    # A stage initializes, counts and reports FLOPs for what it holds only.
    middle.init_weights()
    assert middle.num_params() == sum(p.numel() for p in tiny_model.layers["2"].parameters())
    assert middle.flops_per_token(16) < tiny_model.flops_per_token(16)


def test_positions_default_and_explicit_agree(tiny_model):
    tokens = _tokens()
    default = tiny_model(tokens)
    torch.testing.assert_close(
        tiny_model(tokens, positions=torch.arange(16)), default, rtol=0, atol=0
    )
    batched = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(tiny_model(tokens, positions=batched), default, rtol=0, atol=0)


def test_positions_reach_queries_and_keys_alike(tiny_model):
    # RoPE scores depend only on position differences, so a uniform shift must not change the
    # logits, while scrambled positions must: together they show positions drive q and k.
    with torch.no_grad():  # sharpen attention so positions visibly matter
        for layer in tiny_model.layers.values():
            layer.attention.wq.weight.mul_(30)
            layer.attention.wk.weight.mul_(30)
    tokens = _tokens()
    default = tiny_model(tokens)
    shifted = tiny_model(tokens, positions=torch.arange(16) + 32)
    torch.testing.assert_close(shifted, default, rtol=1e-4, atol=1e-4)
    scrambled = tiny_model(tokens, positions=torch.arange(16).flip(0))
    assert (scrambled - default).abs().max() > 1e-2


def test_sharding_plan_globs_match_real_modules(tiny_model):
    plan = tiny_model.sharding_plan()
    n_layers = TINY["n_layers"]
    for glob, style in plan.tensor_parallel.items():
        names = match_modules(tiny_model, glob)
        assert names, f"{glob} matches nothing"
        if style in ("colwise", "rowwise", "output"):
            assert all(isinstance(tiny_model.get_submodule(n), nn.Linear) for n in names), glob
    for glob in plan.fsdp_units:
        assert match_modules(tiny_model, glob), glob
    assert len(match_modules(tiny_model, plan.attention_modules)) == n_layers
    assert isinstance(getattr(tiny_model, plan.layer_container), nn.ModuleDict)
    for name in plan.pipeline_first + plan.pipeline_last:
        assert getattr(tiny_model, name) is not None


def test_sharding_plan_covers_every_linear(tiny_model):
    plan = tiny_model.sharding_plan()
    covered = {n for glob in plan.tensor_parallel for n in match_modules(tiny_model, glob)}
    linears = {n for n, m in tiny_model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert linears <= covered, linears - covered


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_init_weights_on_dtensor_params(make_tiny):
    # fully_shard turns parameters into DTensors; a 1-rank gloo group is enough to check that
    # init_weights only uses DTensor-safe ops and matches the plain init bit for bit.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            model = build_llama3("debugmodel", **TINY)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model.output.weight, DTensor)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        reference = make_tiny(seed=0)
        for name, param in model.named_parameters():
            torch.testing.assert_close(
                param.full_tensor(), reference.get_parameter(name), rtol=0, atol=0
            )
    finally:
        dist.barrier()
        dist.destroy_process_group()
