"""Qwen3Model: published sizes, QK-norm attention by hand, the plan, init, and Llama unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from titan.models.common.attention import GroupedQueryAttention
from titan.models.common.rope import apply_rope, rope_cache
from titan.models.llama3 import build_llama3
from titan.models.qwen3 import QWEN3_FLAVORS, Qwen3Args, build_qwen3

# (total, non-embedding) parameters of each release, in billions, as its model card states;
# the non-embedding count there excludes the output projection of untied sizes too.
PUBLISHED = {
    "0.6B": (0.6, 0.44), "1.7B": (1.7, 1.4), "4B": (4.0, 3.6),
    "8B": (8.2, 6.95), "14B": (14.8, 13.2), "32B": (32.8, 31.2),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_sizes_match_model_cards(flavor):
    with torch.device("meta"):
        model = build_qwen3(flavor)
    total, non_embedding = PUBLISHED[flavor]
    body = model.num_params(exclude_embedding=True)
    if not model.args.tie_word_embeddings:
        body -= model.output.weight.numel()
    assert model.num_params() / 1e9 == pytest.approx(total, abs=0.06)
    assert body / 1e9 == pytest.approx(non_embedding, abs=0.06)
    assert model.args.tie_word_embeddings is (flavor in ("0.6B", "1.7B", "4B"))
    assert model.layers["0"].attention.wq.weight.shape == (model.args.n_heads * 128, model.args.dim)


def test_qk_norm_attention_equals_a_hand_computation():
    torch.manual_seed(0)
    attn = GroupedQueryAttention(48, 4, 2, 16, qk_norm_eps=1e-6)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(2, 10, 48)
    rope = rope_cache(16, 10, 1e4)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q = rms(F.linear(x, attn.wq.weight).view(2, 10, 4, 16), attn.q_norm.weight)
    k = rms(F.linear(x, attn.wk.weight).view(2, 10, 2, 16), attn.k_norm.weight)
    v = F.linear(x, attn.wv.weight).view(2, 10, 2, 16)
    q, k = apply_rope(q, rope).transpose(1, 2), apply_rope(k, rope).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 64)
    expected = F.linear(out, attn.wo.weight)
    torch.testing.assert_close(attn(x, rope), expected, rtol=1e-5, atol=1e-5)


def test_llama_attention_has_no_qk_norm():
    # Llama's parameters (and thus its checkpoints and seeded init) are untouched.
    model = build_llama3("debugmodel_tiny")
    attention = model.layers["0"].attention
    assert attention.q_norm is None and attention.k_norm is None
    assert sorted(k for k in model.state_dict() if k.startswith("layers.0.attention.")) == [
        f"layers.0.attention.w{n}.weight" for n in "koqv"
    ]


def test_meta_build_init_and_forward():
    with torch.device("meta"):
        model = build_qwen3("debugmodel_tiny", vocab_size=128)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    assert torch.equal(model.layers["1"].attention.k_norm.weight, torch.ones(32))
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 128) and torch.isfinite(logits).all()
    # Layout-independent init: the same seed gives the same weights.
    again = build_qwen3("debugmodel_tiny", vocab_size=128)
    again.init_weights(seed=3)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_tied_flavor_shares_one_parameter():
    model = build_qwen3("debugmodel", n_layers=1, vocab_size=64)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.sharding_plan().tied_parameters == (("tok_embeddings.weight", "output.weight"),)


def test_sharding_plan_styles_the_head_norms():
    model = build_qwen3("debugmodel_tiny")
    plan = model.sharding_plan()
    assert plan.tensor_parallel["layers.*.attention.q_norm"] == "head_norm"
    assert plan.tensor_parallel["layers.*.attention.k_norm"] == "head_norm"
    assert plan.tensor_parallel["layers.*.attention.wq"] == "colwise"
    assert plan.tensor_parallel_divisible == {
        "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 128, "vocab_size": 2048,
    }


def test_flops_count_the_explicit_head_dim():
    model = build_qwen3("debugmodel_tiny")
    a = model.args
    attention = 12 * a.n_layers * a.n_heads * a.head_dim * 32
    assert model.flops_per_token(32) == 6 * model.num_params(exclude_embedding=True) + attention


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"n_heads": 6, "n_kv_heads": 4}, "n_kv_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"ffn_hidden_dim": 0}, "ffn_hidden_dim"),
    ],
)
def test_args_validation_names_the_field(fields, flag):
    with pytest.raises(ValueError, match=flag):
        Qwen3Args(**fields)


def test_unknown_flavor_and_override_are_refused():
    with pytest.raises(ValueError, match="0.6B"):
        build_qwen3("7B")
    with pytest.raises(ValueError, match="multiple_of"):
        build_qwen3("debugmodel", multiple_of=64)
    assert set(QWEN3_FLAVORS) >= {"debugmodel", "debugmodel_tiny", "0.6B", "1.7B", "4B", "8B", "14B", "32B"}
