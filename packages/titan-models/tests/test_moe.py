"""The shared MoE block: grouped experts vs a per-expert loop, router math by hand,
deterministic combine vs a dense reference, load-balancing bias, aux loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan.models.common.init import SeededInit
from titan.models.common.moe import (
    GroupedExperts,
    MoE,
    TokenChoiceRouter,
    expert_load_metrics,
    moe_aux_loss,
)
from torch import nn


def _experts(dim: int, hidden: int, n: int, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(dim, hidden, n)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.2)
    return experts


def _reference_experts(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Hand-written SwiGLU per expert, written independently of the module."""
    out, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        hidden = F.silu(rows @ experts.w1[e].T) * (rows @ experts.w3[e].T)
        out.append(hidden @ experts.w2[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_per_expert_loop_with_empty_experts(dtype):
    dim, hidden, counts = 16, 32, [3, 0, 5, 0, 1, 7]
    experts = _experts(dim, hidden, len(counts)).to(dtype)
    x = torch.randn(sum(counts), dim, dtype=dtype, requires_grad=True)
    n = torch.tensor(counts)
    upstream = torch.randn(sum(counts), dim, dtype=dtype)

    def run(grouped: bool):
        experts.use_grouped_mm = grouped
        experts.zero_grad()
        x.grad = None
        out = experts(x, n)
        (out * upstream).sum().backward()
        return out.detach(), x.grad.clone(), [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)]

    out_g, gx_g, gw_g = run(True)
    out_l, gx_l, gw_l = run(False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out_g, out_l, **tol)
    torch.testing.assert_close(gx_g, gx_l, **tol)
    for a, b in zip(gw_g, gw_l, strict=True):
        torch.testing.assert_close(a, b, **tol)
    # The empty experts got exactly zero gradient, and the loop matches a hand-written reference.
    assert gw_g[0][1].abs().max() == 0 and gw_g[0][3].abs().max() == 0
    if dtype == torch.float32:
        torch.testing.assert_close(out_l, _reference_experts(experts, x.detach(), counts))


def test_grouped_mm_path_actually_runs_and_loop_used_for_odd_dims(monkeypatch):
    calls = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, n = torch.randn(4, 16), torch.tensor([2, 2])
    _experts(16, 8, 2)(x, n)
    assert len(calls) == 3
    calls.clear()
    odd = _experts(6, 8, 2)  # dim 6 breaks the 16-byte row rule in fp32
    out = odd(torch.randn(4, 6), n)
    assert not calls and out.shape == (4, 6)


def test_grouped_mm_backward_with_stride0_gradient_and_uncounted_rows():
    experts = _experts(8, 8, 2)
    x = torch.randn(5, 8, requires_grad=True)
    out = experts(x, torch.tensor([1, 2]))  # rows 3, 4 belong to no expert
    assert torch.equal(out[3:], torch.zeros(2, 8))
    out.sum().backward()  # a stride-0 gradient reaches grouped_mm's backward
    assert torch.equal(x.grad[3:], torch.zeros(2, 8))


def test_softmax_router_by_hand():
    router = TokenChoiceRouter(4, 4, 2, norm_topk_prob=True)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, -1.0, 5.0]])
    weights, selected = router(x, None)
    assert selected.tolist() == [[1, 2], [3, 0]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights[0], e / e.sum())
    # Without normalization the weights are the raw softmax probabilities.
    router.norm_topk_prob = False
    weights, _ = router(x, None)
    torch.testing.assert_close(weights[0], torch.softmax(x[0], 0)[[1, 2]])


def test_sigmoid_group_limited_router_bias_changes_selection_not_weights():
    # 8 experts in 4 groups of 2; keep 2 groups; top 2 experts; scaled by 2.5.
    router = TokenChoiceRouter(8, 8, 2, score_func="sigmoid", n_groups=4, topk_groups=2, norm_topk_prob=True, route_scale=2.5)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(8))
    logits = torch.tensor([[0.1, 0.2, 3.0, -1.0, 0.5, 0.4, 2.0, -2.0]])
    s = torch.sigmoid(logits[0])
    # group sums of top-2: g0=s0+s1, g1=s2+s3, g2=s4+s5, g3=s6+s7 -> keep g1 and g2 (by hand).
    group = torch.stack([s[0] + s[1], s[2] + s[3], s[4] + s[5], s[6] + s[7]])
    assert sorted(group.topk(2).indices.tolist()) == [1, 2]
    weights, selected = router(logits, None)
    # Expert 6 has the second best score overall, but its group lost: 2 and 4 win.
    assert selected.tolist() == [[2, 4]]
    torch.testing.assert_close(weights[0], 2.5 * s[[2, 4]] / (s[2] + s[4]))
    # A bias large on expert 7 lifts group 3 and expert 7 into the selection; the weights
    # still come from the unbiased scores.
    bias = torch.zeros(8)
    bias[7] = 10.0
    weights, selected = router(logits, bias)
    assert selected.tolist() == [[7, 2]]
    torch.testing.assert_close(weights[0], 2.5 * s[[7, 2]] / (s[7] + s[2]))


def _dense_moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its experts one by one, in plain Python."""
    flat = x.reshape(-1, x.shape[-1])
    weights, selected = moe.router(flat, moe.expert_bias if moe.load_balance_coeff else None)
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(flat.shape[1])
        for j in range(moe.top_k):
            e = int(selected[t, j])
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            acc = acc + weights[t, j] * ((F.silu(flat[t] @ w1.T) * (flat[t] @ w3.T)) @ w2.T)
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view_as(x)


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, 8, 8, 2, **kw)
    moe.init_weights(SeededInit(moe, seed), 0.2, 0.2)
    return moe


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_forward_and_grads_match_dense_reference(shared):
    moe = _moe(n_shared_experts=shared, norm_topk_prob=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = moe(x)
    ref = _dense_moe_reference(moe, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad((out * g).sum(), x)
    (gx_ref,) = torch.autograd.grad((ref * g).sum(), x)
    torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)
    assert moe.tokens_per_expert.sum() == 2 * 5 * 2  # every token copy was counted
    # Bitwise deterministic: the same input gives the same output.
    assert torch.equal(moe(x), out)


def test_balancing_bias_moves_load_toward_uniform():
    moe = _moe(load_balance_coeff=0.02)
    # Skewed input: tokens share a common direction, so a few experts win most tokens.
    torch.manual_seed(1)
    x = torch.randn(1, 256, 16) + torch.randn(16) * 1.5
    imbalances = []
    with torch.no_grad():
        for _ in range(40):
            moe(x)
            moe.after_optimizer_step(lambda t: t)  # a single data-parallel rank
            c = moe.last_tokens_per_expert
            imbalances.append(float(c.max() / c.mean()))
    assert imbalances[0] > 3.0, imbalances[0]  # the input really is skewed
    # A fixed-size sign step ends oscillating around balance: compare the last 10 steps.
    assert sum(imbalances[-10:]) / 10 < imbalances[0] * 0.75, imbalances
    assert moe.tokens_per_expert.sum() == 0  # reset after the step
    assert "expert_bias" in moe.state_dict() and "tokens_per_expert" not in moe.state_dict()
    metrics = expert_load_metrics(torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": moe})}))
    assert metrics["moe/layers.0/imbalance"] == pytest.approx(imbalances[-1])


def test_after_optimizer_step_sums_counts_over_dp():
    moe = _moe(load_balance_coeff=1.0)
    moe.tokens_per_expert.copy_(torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 0]))
    # A fake second rank that routed everything to expert 1.
    moe.after_optimizer_step(lambda t: t.add_(torch.tensor([0.0, 4, 0, 0, 0, 0, 0, 0])))
    assert moe.last_tokens_per_expert.tolist() == [4, 4, 0, 0, 0, 0, 0, 0]
    assert moe.expert_bias.tolist() == [-1, -1, 1, 1, 1, 1, 1, 1]


def test_activation_checkpointing_counts_each_token_once():
    from torch.utils.checkpoint import checkpoint

    moe = _moe(aux_loss_coef=0.01)
    x = torch.randn(1, 6, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the forward reruns in backward
    assert moe.tokens_per_expert.sum() == 6 * 2
    assert moe.aux_loss is not None and moe.aux_loss.requires_grad


def test_eval_forward_does_not_count():
    moe = _moe()
    moe.eval()
    moe(torch.randn(1, 4, 16))
    assert moe.tokens_per_expert.sum() == 0


def test_aux_loss_matches_switch_formula_and_reaches_the_loss():
    moe = _moe(aux_loss_coef=0.01)
    x = torch.randn(1, 6, 16)
    moe(x)
    scores = torch.softmax(moe.router.gate(x[0]), -1)
    sel = scores.topk(2, -1).indices
    f = torch.bincount(sel.flatten(), minlength=8).float() / 6
    expected = 0.01 * 8 * (f * scores.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, expected)
    torch.testing.assert_close(moe_aux_loss(moe), expected)
    moe.aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0  # the aux loss trains the router


def test_sequence_wise_loss_is_deepseek_v3s_formula_per_sequence():
    """DeepSeek-V3's complementary balance loss (its paper's eqs. 17-20), by hand: per
    sequence, alpha * sum_e f_e P_e with f_e = E / (K T) x assignments and P_e the mean of the
    normalized sigmoid scores; averaged over sequences, padding left out of T and the sums."""
    moe = _moe(aux_loss_coef=0.01, aux_loss_kind="sequence", score_func="sigmoid", n_groups=2, topk_groups=1)
    x = torch.randn(3, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [False] * 5])  # a row of padding only
    moe(x, token_mask=mask)
    expected = []
    for row in range(2):  # the padding-only row has no tokens: not in the mean
        tokens = x[row][mask[row]]
        scores = torch.sigmoid(moe.router.gate(tokens))
        chosen = moe.router.select(scores, moe.expert_bias)
        f = torch.stack([(chosen == e).sum() for e in range(8)]).float() * 8 / (2 * len(tokens))
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        expected.append(0.01 * (f * p).sum())
    torch.testing.assert_close(moe.sequence_aux_loss, torch.stack(expected).mean())
    twin = _moe(aux_loss_coef=0.01, aux_loss_kind="sequence", score_func="sigmoid", n_groups=2, topk_groups=1)
    twin(x, token_mask=mask)  # the same weights (seeded): the same loss
    torch.testing.assert_close(moe_aux_loss(nn.ModuleList([moe, twin])), 2 * moe.sequence_aux_loss)  # layers add up
    assert moe.routing_statistics is None  # no Switch statistics beside it
    moe.sequence_aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_a_pipeline_stage_weights_its_pooled_loss_by_its_share_of_the_layers():
    """A stage pools the layers it holds and counts for its share of the model's MoE layers:
    two stages whose layers route alike add up to the whole model's loss."""
    layers = nn.ModuleList([_moe(aux_loss_coef=0.01, seed=1) for _ in range(4)])
    x = torch.randn(1, 6, 16)
    for layer in layers:
        layer(x)  # the same input and weights: every layer routes alike
    whole = moe_aux_loss(layers)
    first, second = (moe_aux_loss(nn.ModuleList(list(layers)[i : i + 2]), moe_layers_in_model=4) for i in (0, 2))
    torch.testing.assert_close(first + second, whole)
    torch.testing.assert_close(first, 0.5 * whole)
    torch.testing.assert_close(whole, layers[0].aux_loss)  # alike layers pool to one layer's loss


@pytest.mark.parametrize("grouped", [True, False])
def test_experts_with_no_tokens(grouped):
    # An expert-parallel rank may receive no tokens at all in a step.
    experts = _experts(16, 8, 2)
    experts.use_grouped_mm = grouped
    x = torch.zeros(0, 16, requires_grad=True)
    out = experts(x, torch.tensor([0, 0]))
    out.sum().backward()
    assert out.shape == (0, 16) and x.grad.shape == (0, 16)


def test_padding_stays_out_of_the_load_counts_and_the_aux_loss():
    """Routing is per token, so an MoE over real tokens plus padding marked by `token_mask`
    counts and balances exactly like the same MoE over the real tokens alone."""
    real = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(3))
    padding = torch.randn(1, 10, 16, generator=torch.Generator().manual_seed(4)) * 3  # skewed, many
    padded = torch.cat([real, padding], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 10])
    alone, masked, unmasked = (_moe(aux_loss_coef=0.01) for _ in range(3))
    out_alone = alone(real)
    out_masked = masked(padded, token_mask=mask)
    unmasked(padded)
    torch.testing.assert_close(out_masked[:, :6], out_alone)  # padding changes nothing for real tokens
    assert torch.equal(masked.tokens_per_expert, alone.tokens_per_expert) and masked.tokens_per_expert.sum() == 12
    torch.testing.assert_close(masked.aux_loss, alone.aux_loss)
    assert unmasked.tokens_per_expert.sum() == 32 and not torch.allclose(unmasked.aux_loss, alone.aux_loss)


def test_negative_document_ids_mark_padding_for_the_moe_layers():
    from titan.models.qwen3_moe import build_qwen3_moe

    model = build_qwen3_moe("debugmodel_tiny", vocab_size=64, max_seq_len=16)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 8 + [-1] * 4])
    model(tokens, document_ids=docs)
    moe = model.layers["1"].feed_forward
    assert moe.tokens_per_expert.sum() == 8 * moe.top_k  # the 4 padding tokens are not counted


def test_forced_load_balance_routes_round_robin_and_still_trains_the_gate():
    """`force_load_balance` (torchtitan's --debug.moe_force_load_balance): token t takes experts
    t*k .. t*k + k - 1 mod E, whatever the scores, which still weight the outputs (the gate
    gets a gradient)."""
    router = TokenChoiceRouter(4, 4, 2, norm_topk_prob=True, force_load_balance=True)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, -1.0, 5.0], [9.0, 0.0, 0.0, 0.0]], requires_grad=True)
    weights, selected = router(x, torch.tensor([0.0, 0.0, 0.0, 100.0]))  # a bias is ignored too
    assert selected.tolist() == [[0, 1], [2, 3], [0, 1]]
    p = torch.softmax(x[1].detach(), 0)[[2, 3]]
    torch.testing.assert_close(weights[1], p / p.sum())
    weights.square().sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    assert MoE(8, 16, 4, 2, force_load_balance=True).router.force_load_balance  # passed down
