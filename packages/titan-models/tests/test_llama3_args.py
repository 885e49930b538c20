"""Llama3Args validation, the published sizes, build_llama3 and FLOP accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from titan.models.common import RopeScaling
from titan.models.llama3 import LLAMA3_FLAVORS, Llama3Args, build_llama3

# Exact counts, worked out by hand from the published shapes (embedding + output are each
# vocab * dim; a block is 2*dim*dim + 2*dim*kv_dim (attention) + 3*dim*ffn + 2*dim (norms)).
# 8B/70B/405B match Meta's 8.03e9 / 70.55e9 / 405.8e9. 1B/3B tie the output to the embedding,
# as published (1.236e9 / 3.21e9): the shared vocab * dim matrix counts once.
PUBLISHED_PARAMS = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts(flavor):
    with torch.device("meta"):
        model = build_llama3(flavor)
    assert model.num_params() == PUBLISHED_PARAMS[flavor]


def test_published_counts_round_to_meta_numbers():
    approx = {"1B": 1.236e9, "3B": 3.21e9, "8B": 8.03e9, "70B": 70.55e9, "405B": 405.8e9}
    for flavor, published in approx.items():
        assert PUBLISHED_PARAMS[flavor] == pytest.approx(published, rel=1e-3)


def test_ffn_hidden_dims_follow_the_llama_rule():
    dims = {name: args.ffn_hidden_dim for name, args in LLAMA3_FLAVORS.items()}
    assert dims == {
        "debugmodel": 768,
        "debugmodel_tiny": 192,
        "debugmodel_tiny_tied": 192,
        "1B": 8192,
        "3B": 8192,
        "8B": 14336,
        "70B": 28672,
        "405B": 53248,
    }
    assert Llama3Args(ffn_dim=100).ffn_hidden_dim == 100


def test_flavors_carry_llama31_and_llama32_rope_scaling():
    for name in ("8B", "70B", "405B"):
        assert LLAMA3_FLAVORS[name].rope_scaling.factor == 8
    for name in ("1B", "3B"):
        assert LLAMA3_FLAVORS[name].rope_scaling.factor == 32
    for args in LLAMA3_FLAVORS.values():
        assert args.rope_theta == 500000
    debug = LLAMA3_FLAVORS["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.head_dim, debug.vocab_size, debug.max_seq_len) == (
        256,
        6,
        32,
        2048,
        2048,
    )


def test_debugmodel_is_a_few_million_params():
    with torch.device("meta"):
        assert 1e6 < build_llama3("debugmodel").num_params() < 1e7


def test_flops_per_token_formula():
    with torch.device("meta"):
        model = build_llama3("8B")
    non_embedding = 8_030_261_248 - 128256 * 4096
    assert model.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    assert model.flops_per_token(8192) == 57_914_449_920


def test_build_overrides_replace_fields_and_leave_flavors_alone():
    with torch.device("meta"):
        model = build_llama3("debugmodel", vocab_size=100, n_layers=2, max_seq_len=32)
    assert (model.args.vocab_size, len(model.layers), model.rope_cache.shape[0]) == (100, 2, 32)
    assert model.output.out_features == 100
    assert LLAMA3_FLAVORS["debugmodel"].vocab_size == 2048


def test_build_rejects_unknown_flavor_and_field():
    with pytest.raises(ValueError, match="debugmodel, debugmodel_tiny, 1B, 3B, 8B, 70B, 405B"):
        build_llama3("7B")
    with pytest.raises(ValueError, match="n_layer"):
        build_llama3("debugmodel", n_layer=2)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dim": 250}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "divisible by n_kv_heads"),
        ({"dim": 24, "n_heads": 8, "n_kv_heads": 4}, "must be even"),
        ({"n_layers": 0}, "n_layers must be > 0"),
        ({"vocab_size": -1}, "vocab_size must be > 0"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier"),
        ({"ffn_dim": 0}, "ffn_dim must"),
    ],
)
def test_args_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        Llama3Args(**fields)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        RopeScaling(factor=0.5)


def test_validation_also_runs_on_replace():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        dataclasses.replace(LLAMA3_FLAVORS["8B"], n_heads=33)
