"""Shared blocks: RoPE, RMSNorm, grouped-query attention, sharding-plan globs."""

from __future__ import annotations

import copy

import pytest
import torch
from titan.models.common import (
    GroupedQueryAttention,
    RMSNorm,
    RopeScaling,
    ScaledDotProductAttention,
    SeededInit,
    ShardingPlan,
    apply_rope,
    glob_matches,
    rms_norm_reference,
    rope_cache,
    rope_inv_freq,
)


def test_llama3_scaling_matches_transformers_reference():
    # Independent reference: transformers' own llama3 frequency function at real 8B settings.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, **scaling.__dict__},
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(128, 500000.0)), (
        "scaling must change low frequencies"
    )


def test_scaling_leaves_high_frequencies_and_divides_low_ones():
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=64)
    plain, scaled = rope_inv_freq(16, 10000.0), rope_inv_freq(16, 10000.0, scaling)
    assert scaled[0] == plain[0]  # wavelength 2*pi: far shorter than 64 / 4
    assert torch.allclose(scaled[-1], plain[-1] / 8)  # wavelength > 64: fully scaled


def test_rope_of_absolute_positions_equals_slice_of_full_sequence():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 8)
    cache = rope_cache(8, 64, 10000.0, RopeScaling(original_max_position_embeddings=32))
    full = apply_rope(x, cache[:16])
    second_half = apply_rope(x[:, 8:], cache[torch.arange(8, 16)])
    torch.testing.assert_close(second_half, full[:, 8:], rtol=0, atol=0)
    batched = apply_rope(x[:, 8:], cache[torch.arange(8, 16).expand(2, 8)])
    torch.testing.assert_close(batched, full[:, 8:], rtol=0, atol=0)
    # The wrong positions must give something else, or this test proves nothing.
    assert not torch.allclose(apply_rope(x[:, 8:], cache[:8]), full[:, 8:])


def test_rope_rotates_interleaved_pairs():
    # One pair (x0, x1) at position p rotates by angle p * inv_freq[0] = p.
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    cache = rope_cache(4, 4, 10000.0)
    out = apply_rope(x.expand(1, 4, 1, 4).contiguous(), cache).view(4, 4)
    p = torch.arange(4.0)
    torch.testing.assert_close(out[:, 0], p.cos())
    torch.testing.assert_close(out[:, 1], p.sin())
    assert out[:, 2:].abs().max() == 0


def _rope_and_gradient(x: torch.Tensor, cache: torch.Tensor, rotate) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().requires_grad_()
    out = rotate(leaf, cache)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "odd_offset_slice"])
def test_eager_complex_rope_equals_the_real_rotation(dtype, layout):
    """Eager `apply_rope` multiplies complex pairs; its values and gradients equal the real
    formula's (the one compiled code runs) within one float32 rounding of each product
    (a kernel may fuse multiply and add): 2 eps of the largest |x| (|cos|, |sin| <= 1)."""
    from unittest import mock

    from titan.models.common import rope as rope_module

    torch.manual_seed(0)
    cache = rope_cache(16, 32, 10000.0).to(dtype)  # a model cast whole casts its table too
    wide = torch.randn(2, 32, 3, 17, dtype=dtype) * 4
    # An odd storage offset cannot be viewed as complex: the real formula must take over.
    x = wide[..., :16].contiguous() if layout == "contiguous" else wide[..., 1:]
    real = _rope_and_gradient(x, cache, lambda t, c: rope_module._rotate_real(t.float(), c.float().unsqueeze(-2)).to(t.dtype))
    if layout == "contiguous":  # prove the complex path ran: the real one is not called
        with mock.patch.object(rope_module, "_rotate_real", side_effect=AssertionError("real path")):
            ours = _rope_and_gradient(x, cache, apply_rope)
    else:
        ours = _rope_and_gradient(x, cache, apply_rope)
    bound = 2 * torch.finfo(torch.float32).eps * 4 * float(wide.abs().max())
    for got, want in zip(ours, real, strict=True):
        if dtype == torch.bfloat16:  # a float32 rounding apart may straddle one bf16 rounding
            bound = max(bound, torch.finfo(dtype).eps * float(want.abs().max()))
        torch.testing.assert_close(got, want, rtol=0, atol=bound)


def test_compiled_rope_uses_no_complex_numbers():
    """Under torch.compile the rotation is the real formula (inductor cannot generate code for
    complex operators and would fall back to eager kernels), with the eager values."""
    import warnings

    torch.manual_seed(0)
    x, cache = torch.randn(2, 8, 2, 8), rope_cache(8, 8, 10000.0)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(apply_rope, fullgraph=True)(x, cache)
    assert not [w for w in caught if "complex" in str(w.message)], [str(w.message) for w in caught]
    bound = 2 * torch.finfo(torch.float32).eps * float(x.abs().max())
    torch.testing.assert_close(compiled, apply_rope(x, cache), rtol=0, atol=bound)


def test_rmsnorm_normalizes_in_float32_and_scales():
    norm = RMSNorm(8, eps=0.0).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(2.0)
    x = torch.randn(3, 8, dtype=torch.bfloat16) * 100
    out = norm(x)
    assert out.dtype == torch.bfloat16
    rms = out.float().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.full((3,), 2.0), rtol=1e-2, atol=0)


def _norm_grads(norm, x, grad, forward) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    norm.zero_grad(set_to_none=True)
    out = forward(x)
    out.backward(grad)
    return out.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16_in_fp32_weight"])
def test_rmsnorm_handwritten_backward_equals_autograd(dtypes):
    """The eager RMSNorm's hand-written backward against autograd through the same formula
    (`rms_norm_reference`): the same values and dtypes, and gradients at least as close to a
    float64 computation as autograd's, within one rounding of the output dtype."""
    from unittest import mock

    from titan.models.common import norm as norm_module

    x_dtype, w_dtype = dtypes
    torch.manual_seed(0)
    norm = RMSNorm(64).to(w_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 16, 64) * 3).to(x_dtype)
    grad = torch.randn(4, 16, 64).to(torch.promote_types(x_dtype, w_dtype))
    with mock.patch.object(norm_module, "rms_norm_reference", side_effect=AssertionError("autograd path")):
        ours = _norm_grads(norm, x, grad, norm)  # the hand-written path ran
    reference = _norm_grads(norm, x, grad, lambda t: rms_norm_reference(t, norm.weight, norm.eps))
    exact_norm = RMSNorm(64).double()
    exact_norm.weight.data.copy_(norm.weight.double())
    exact = _norm_grads(exact_norm, x.double(), grad.double(), exact_norm)
    torch.testing.assert_close(ours[0], reference[0], rtol=0, atol=0)
    for got, autograd, want in zip(ours[1:], reference[1:], exact[1:], strict=True):
        assert got.dtype == autograd.dtype
        ulp = torch.finfo(got.dtype).eps * float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= 2 * float((autograd.double() - want).abs().max()) + ulp


def test_rmsnorm_keeps_less_for_backward_and_autograd_formula_under_compile():
    """The hand-written backward keeps the input and one float per row (autograd's chain keeps
    the normalized rows as well); compiled, the module runs the autograd formula, same values."""
    torch.manual_seed(0)
    norm, x = RMSNorm(64), torch.randn(4, 16, 64, requires_grad=True)

    def saved_bytes(forward) -> int:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            forward(x)
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in kept}.values() if t is not x)

    assert saved_bytes(norm) == 4 * 16 * 4 + 64 * 4  # beside the input: one float32 per row, the weight
    # autograd's chain keeps the normalized rows too: a second input-sized tensor
    assert saved_bytes(lambda t: rms_norm_reference(t, norm.weight, norm.eps)) >= saved_bytes(norm) + x.numel() * 4
    torch._dynamo.reset()
    from unittest import mock

    from titan.models.common import norm as norm_module

    # Compiled, the hand-written Function must not run (fullgraph: reaching it would fail).
    with mock.patch.object(norm_module._RMSNormFunction, "forward", side_effect=AssertionError("hand-written path")):
        compiled = torch.compile(norm, fullgraph=True)(x)
    torch.testing.assert_close(compiled, rms_norm_reference(x, norm.weight, norm.eps),
                               rtol=0, atol=2 * torch.finfo(torch.float32).eps * float(compiled.detach().abs().max()))


def _attention(n_heads=8, n_kv_heads=4, head_dim=8):
    torch.manual_seed(0)
    attn = GroupedQueryAttention(32, n_heads, n_kv_heads, head_dim)
    attn.init_weights(SeededInit(attn, seed=0), 0.2, 0.2)
    return attn


def test_inner_attention_gets_grouped_heads_and_can_be_replaced():
    attn, seen = _attention(), []

    class Recorder(torch.nn.Module):
        def forward(self, q, k, v):
            seen.append((q.shape, k.shape, v.shape))
            return q

    attn.inner_attention = Recorder()
    attn(torch.randn(2, 5, 32), rope_cache(8, 5, 10000.0))
    assert seen == [(torch.Size([2, 8, 5, 8]), torch.Size([2, 4, 5, 8]), torch.Size([2, 4, 5, 8]))]


def test_grouped_attention_equals_attention_over_repeated_heads():
    # Query head h must read kv head h // (H // Hkv): the grouping tensor parallel relies on.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )
    torch.testing.assert_close(ScaledDotProductAttention()(q, k, v), expected)


def test_attention_is_causal():
    attn, x = _attention(), torch.randn(1, 6, 32)
    rope = rope_cache(8, 6, 10000.0)
    prefix = attn(x[:, :3], rope[:3])
    torch.testing.assert_close(attn(x, rope)[:, :3], prefix)


def test_attention_splits_by_heads_like_tensor_parallel():
    # Emulate TP=2 by hand: each shard keeps half the q and kv heads and half of wo's columns;
    # the partial outputs must sum to the full one (heads inferred from shapes, groups aligned).
    attn, x = _attention(), torch.randn(2, 5, 32)
    rope = rope_cache(8, 5, 10000.0)
    total = 0
    for shard in range(2):
        part = copy.deepcopy(attn)
        q_rows, kv_rows = slice(32 * shard, 32 * (shard + 1)), slice(16 * shard, 16 * (shard + 1))
        part.wq.weight.data = attn.wq.weight.data[q_rows]
        part.wk.weight.data = attn.wk.weight.data[kv_rows]
        part.wv.weight.data = attn.wv.weight.data[kv_rows]
        part.wo.weight.data = attn.wo.weight.data[:, q_rows]
        total = total + part(x, rope)
    torch.testing.assert_close(total, attn(x, rope), rtol=1e-5, atol=1e-6)


def test_glob_star_is_one_name_part():
    assert glob_matches("layers.*.attention", "layers.12.attention")
    assert not glob_matches("layers.*.attention", "layers.1.attention.wq")
    assert not glob_matches("layers.*", "layers")


def test_sharding_plan_rejects_unknown_style():
    with pytest.raises(ValueError, match="unknown tensor-parallel styles"):
        ShardingPlan(tensor_parallel={"x": "diagonal"}, fsdp_units=())


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_kv_width_is_what_the_inner_attention_receives(family):
    """`kv_width` (what context parallelism gathers, which the layout planner counts) equals
    the K and V elements per token a forward hands every inner attention, for every family
    (Qwen3's heads are wider than dim / n_heads; MLA's per-head keys and values exceed dim)."""
    import importlib

    build = getattr(importlib.import_module(f"titan.models.{family}"), f"build_{family}")
    model = build("debugmodel")
    model.init_weights(seed=0)
    seen = {}

    def record(name):
        def hook(module, args):
            q, k, v = args[:3]
            seen[name] = k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]
        return hook

    widths = {}
    for name, layer in model.layers.items():
        layer.attention.inner_attention.register_forward_pre_hook(record(name))
        widths[name] = layer.attention.kv_width
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 16)))
    assert seen == widths and len(seen) == len(model.layers)
