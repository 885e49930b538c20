"""Each GRPO-family loss against values computed by hand on a 2 x 3 example, and the gradients
where they say what the loss does (clipped tokens get none, truncated IS caps the weight)."""

from __future__ import annotations

import math

import pytest
import torch
from titan.rl.losses import (
    LOSS_TYPES,
    adapted_entropy_coef,
    document_totals,
    entropy_threshold,
    importance_weights,
    kl_estimate,
    loss_normalizer,
    off_policy_mask,
    policy_loss,
    row_totals,
    stat_means,
    token_entropy,
)

# Row 0: advantage +1, token ratios 1.5 / 0.9 / 1.0, all three tokens carry loss.
# Row 1: advantage -2, token ratios 0.5 / 1.1 and a masked third token (ratio 7, ignored).
RATIOS = [[1.5, 0.9, 1.0], [0.5, 1.1, 7.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    logp = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return logp, old


def test_grpo_by_hand():
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    # Row 0 (eps 0.2): -min(1.5, 1.2) = -1.2 (clipped), -0.9, -1.0 -> token mean -3.1 / 3.
    # Row 1: r=0.5, A=-2: -min(-1.0, 0.8 * -2) = 1.6 (clipped); r=1.1: 2.2 -> mean 3.8 / 2.
    assert loss.item() == pytest.approx(-3.1 / 3 + 3.8 / 2, abs=1e-6)
    assert stats["tokens"].item() == 5 and stats["clipped"].item() == 2
    assert loss_normalizer("grpo", MASK, max_new_tokens=3).item() == 2
    loss.backward()
    # d/dlogp of -r*A*w is -A*r*w where unclipped; 0 where the clipped branch was taken.
    want = torch.tensor([[0.0, -0.9 / 3, -1.0 / 3], [0.0, 2 * 1.1 / 2, 0.0]])
    torch.testing.assert_close(logp.grad, want)


def test_dapo_by_hand_asymmetric_clip_and_token_normalization():
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="dapo")
    # eps_high 0.28: the 1.5 ratio clips at 1.28; every token weighs 1.
    assert loss.item() == pytest.approx(-(1.28 + 0.9 + 1.0) + (1.6 + 2.2), abs=1e-6)
    assert loss_normalizer("dapo", MASK, max_new_tokens=3).item() == 5
    assert stat_means(stats)["clip_fraction"] == pytest.approx(2 / 5)


def test_dr_grpo_by_hand_has_no_length_normalization():
    logp, old = inputs()
    loss, _ = policy_loss(logp, old, ADV, MASK, loss_type="dr_grpo")
    assert loss.item() == pytest.approx(-(1.2 + 0.9 + 1.0) + (1.6 + 2.2), abs=1e-6)
    assert loss_normalizer("dr_grpo", MASK, max_new_tokens=16).item() == 2 * 16


def test_cispo_by_hand_clips_the_weight_never_the_update():
    """CISPO (MiniMax-M1): each token's loss is -sg(clip(r, 0, 1.28)) A log pi: its value is
    -clip(r) A, its gradient -clip(r) A on every loss token, the clipped ones included (the
    1.5 ratio weighs 1.28; grpo gives that token no gradient); tokens weigh alike."""
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="cispo")
    # Row 0: weights 1.28, 0.9, 1.0, A +1. Row 1: weights 0.5, 1.1 (no lower bound), A -2.
    assert loss.item() == pytest.approx(-(1.28 + 0.9 + 1.0) + 2 * (0.5 + 1.1), abs=1e-6)
    assert stats["clipped"].item() == 1 and loss_normalizer("cispo", MASK, max_new_tokens=3).item() == 5
    loss.backward()
    want = torch.tensor([[-1.28, -0.9, -1.0], [2 * 0.5, 2 * 1.1, 0.0]])
    torch.testing.assert_close(logp.grad, want)
    logp, old = inputs()  # a lower bound, when asked for: 0.5 weighs 0.8
    bounded, stats = policy_loss(logp, old, ADV, MASK, loss_type="cispo", clip_eps_low=0.2)
    assert bounded.item() == pytest.approx(-(1.28 + 0.9 + 1.0) + 2 * (0.8 + 1.1), abs=1e-6)
    assert stats["clipped"].item() == 2


def test_dual_clip_bounds_a_negative_advantages_loss_by_hand():
    """Dual-clip PPO (verl's clip_ratio_c, TRL's delta) at C = 1.05: row 1's ratio-1.1 token
    (A = -2) would lose 2.2; its loss is held at -C A = 2.1 with no gradient; the positive
    row and the 0.5 token (already clipped) are unchanged; the grpo loss otherwise equal."""
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="grpo", dual_clip=1.05)
    assert loss.item() == pytest.approx(-3.1 / 3 + (1.6 + 2.1) / 2, abs=1e-6)
    assert stats["clipped"].item() == 3
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.9 / 3, -1.0 / 3], [0.0, 0.0, 0.0]]))
    from titan.rl.config import RLSection

    with pytest.raises(ValueError, match="--rl.dual_clip 1.1 must exceed 1 \\+ --rl.clip_eps_high \\(1.2\\)"):
        RLSection(dual_clip=1.1)
    with pytest.raises(ValueError, match="cispo clips its weight"):
        RLSection(dual_clip=3.0, loss_type="cispo")
    assert RLSection(dual_clip=3.0).dual_clip == 3.0


def test_gspo_by_hand_sequence_ratio():
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="gspo")
    s0 = (1.5 * 0.9 * 1.0) ** (1 / 3)  # geometric mean of the token ratios
    s1 = (0.5 * 1.1) ** (1 / 2)  # the masked token does not count
    lo, hi = 3e-4, 4e-4
    want0 = -min(s0 * 1.0, min(max(s0, 1 - lo), 1 + hi) * 1.0)
    want1 = -min(s1 * -2.0, min(max(s1, 1 - lo), 1 + hi) * -2.0)
    assert loss.item() == pytest.approx(want0 + want1, abs=1e-6)
    assert stats["clipped"].item() == 5  # both sequences clipped: all their loss tokens count
    # GSPO gradient: one sequence weight for all of its tokens; both are clipped -> zero.
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_gspo_unclipped_gradient_is_the_sequence_ratio_spread_over_tokens():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # on-policy: s = 1, nothing clipped
    loss, _ = policy_loss(logp, old, torch.tensor([3.0]), torch.ones(1, 2), loss_type="gspo")
    loss.backward()
    # d(-s A)/dlogp_t = -A s / |o|.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_on_policy_grpo_is_the_policy_gradient():
    logp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = policy_loss(logp, logp.detach().clone(), torch.tensor([0.5]), mask, loss_type="grpo")
    assert loss.item() == pytest.approx(-0.5)  # -A * mean(r) with r = 1
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, -0.5 / 3, -0.5 / 3, 0.0]]))
    assert stats["clipped"].item() == 0


def test_truncated_importance_sampling_caps_value_and_gradient():
    old = torch.zeros(1, 1)
    logp = torch.tensor([[math.log(3.0)]], requires_grad=True)  # ratio 3, negative advantage
    adv = torch.tensor([-1.0])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 1), loss_type="dapo")
    loss.backward()
    # Without a cap the clipped surrogate keeps -r*A = 3 and the gradient -A*r = 3.
    assert loss.item() == pytest.approx(3.0) and logp.grad.item() == pytest.approx(3.0)
    logp.grad = None
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 1), loss_type="dapo", is_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.0) and logp.grad.item() == pytest.approx(2.0)


def test_a_cap_below_the_upper_clip_keeps_the_clip():
    """Ratio 1.5, advantage +1, eps 0.2, is_cap 1.1: PPO clipping takes the clipped branch
    (no gradient); capping the ratio first gave gradient -1.1 and clip fraction 0."""
    old = torch.zeros(1, 1)
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), loss_type="grpo", is_cap=1.1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logp.grad.item() == 0.0
    assert stat_means(stats)["clip_fraction"] == 1.0
    # Inside the clip band the cap still truncates: ratio 1.15 -> value 1.1, gradient -1.1.
    logp = torch.tensor([[math.log(1.15)]], requires_grad=True)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), loss_type="grpo", is_cap=1.1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1) and logp.grad.item() == pytest.approx(-1.1)
    assert stats["clipped"].item() == 0


def test_importance_weights_by_hand():
    # pi_old / pi_gen per token: row 0 = 3, 0.5, 1.25; row 1 = 0.1, 2.5 and a masked token.
    ratios = torch.tensor([[3.0, 0.5, 1.25], [0.1, 2.5, 9.0]])
    gen = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    old = gen + ratios.log()
    w, stats = importance_weights(old, gen, MASK, level="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.25], [0.1, 2.0, 0.0]]))
    assert stats["is_weight"].item() == pytest.approx(2 + 0.5 + 1.25 + 0.1 + 2)
    assert stats["is_capped"].item() == 2 and stats["is_masked"].item() == 0
    assert stats["is_weight_max"].item() == pytest.approx(3.0)
    # Masked IS with the band [0.2, 2.8]: 3 and 0.1 leave it and weigh 0; the cap still acts.
    w, stats = importance_weights(old, gen, MASK, level="token", cap=2.0, mask_low=0.2, mask_high=2.8)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.25], [0.0, 2.0, 0.0]]))
    assert stats["is_masked"].item() == 2 and stats["is_capped"].item() == 1
    # Sequence level: the product over the row's loss tokens (3 * 0.5 * 1.25 = 1.875; 0.25).
    w, _ = importance_weights(old, gen, MASK, level="sequence", cap=0.0)
    torch.testing.assert_close(w, torch.tensor([[1.875] * 3, [0.25, 0.25, 0.0]]))
    # Rows split across two ranks (context parallel: positions 0-1 here, 2 there): each
    # shard's row sums are completed by the other's (``sequence_sum``), giving the same weights.
    shards = [(slice(0, 2), slice(2, 3)), (slice(2, 3), slice(0, 2))]
    for mine, theirs in shards:
        other = ((old[:, theirs] - gen[:, theirs]) * MASK[:, theirs]).sum(-1, keepdim=True)
        w_shard, _ = importance_weights(old[:, mine], gen[:, mine], MASK[:, mine], level="sequence", cap=0.0,
                                        sequence_sum=lambda row, other=other: row + other)
        torch.testing.assert_close(w_shard, w[:, mine])


def test_importance_weights_scale_the_policy_term_only():
    logp, old = inputs()
    weights = torch.tensor([[2.0, 1.0, 0.5], [1.0, 0.0, 1.0]])
    base, _ = policy_loss(logp, old, ADV, MASK, loss_type="dapo")
    weighted, _ = policy_loss(logp, old, ADV, MASK, loss_type="dapo", is_weights=weights)
    # The per-token dapo losses are -1.28, -0.9, -1.0 | 1.6, 2.2 (test_dapo_by_hand...).
    assert base.item() == pytest.approx(-3.18 + 3.8, abs=1e-6)
    assert weighted.item() == pytest.approx(-(2 * 1.28 + 0.9 + 0.5 * 1.0) + 1.6, abs=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log p/q = 0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    with pytest.raises(ValueError, match="--rl.kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_kl_penalty_is_off_by_default_and_added_with_its_weights():
    logp, old = inputs()
    ref = old - 0.5  # log p/q = log r + 0.5 on every token
    base, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    logged, stats = policy_loss(logp, old, ADV, MASK, loss_type="grpo", ref_logprobs=ref)
    assert logged.item() == pytest.approx(base.item())  # kl_coef 0: measured, not added
    with_kl, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo", ref_logprobs=ref, kl_coef=0.1,
                             kl_estimator="k1")
    log_pq = torch.log(torch.tensor(RATIOS)) + 0.5
    per_row = [(log_pq[0] * MASK[0]).sum() / 3, (log_pq[1] * MASK[1]).sum() / 2]
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * float(sum(per_row)), abs=1e-6)
    k3 = torch.exp(-log_pq) - 1 + log_pq
    assert stats["kl"].item() == pytest.approx(float((k3 * MASK).sum()), abs=1e-6)


def test_entropy_bonus_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]]).reshape(1, 2, 2)
    entropy = token_entropy(logits)
    p = 0.75
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2), -(p * math.log(p) + (1 - p) * math.log(1 - p))]]))
    logp, old = inputs()
    ent = torch.full((2, 3), 2.0)
    base, _ = policy_loss(logp, old, ADV, MASK, loss_type="dapo")
    bonus, stats = policy_loss(logp, old, ADV, MASK, loss_type="dapo", entropy=ent, entropy_coef=0.01)
    assert bonus.item() == pytest.approx(base.item() - 0.01 * 2.0 * 5, abs=1e-6)
    assert stat_means(stats)["entropy"] == pytest.approx(2.0)


def test_per_token_advantages_equal_broadcast_ones():
    logp, old = inputs()
    a, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    b, _ = policy_loss(logp, old, ADV[:, None].expand(2, 3).clone(), MASK, loss_type="grpo")
    assert a.item() == pytest.approx(b.item())


def test_given_sequence_lengths_match_the_mask_count():
    """Under context parallel each token carries its completion's length; same result."""
    logp, old = inputs()
    lengths = MASK.sum(-1, keepdim=True).expand(2, 3) * MASK
    a, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    b, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo", sequence_lengths=lengths)
    assert a.item() == pytest.approx(b.item())


def test_unknown_loss_type_names_the_flag():
    logp, old = inputs()
    with pytest.raises(ValueError, match="--rl.loss_type"):
        policy_loss(logp, old, ADV, MASK, loss_type="ppo")


def test_entropy_threshold_is_torch_quantile():
    generator = torch.Generator().manual_seed(0)
    for values in (torch.tensor([0.7]), torch.tensor([2.0, 1.0]), torch.tensor([1.0, 3.0, 3.0, 3.0, 0.5, 2.0, 2.0]),
                   torch.rand(1001, generator=generator)):
        for q in (0.0, 0.2, 0.5, 0.8, 0.95, 1.0):
            want = torch.quantile(values.double(), q)
            assert entropy_threshold(values[torch.randperm(len(values), generator=generator)], q).item() == want.item()
    with pytest.raises(ValueError, match="non-empty 1-D"):
        entropy_threshold(torch.zeros(0), 0.8)


def test_policy_mask_drops_masked_tokens_from_the_policy_term_by_hand():
    """The kept tokens' grpo terms with their rows' full lengths (-1.2 and -1.0 of row 0's
    three tokens, 2.2 of row 1's two); no gradient reaches a dropped token; the KL term keeps
    every token."""
    logp, old = inputs()
    keep = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # row 1's third token has no loss anyway
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="grpo", policy_mask=keep)
    assert loss.item() == pytest.approx((-1.2 - 1.0) / 3 + 2.2 / 2, abs=1e-6)
    assert stats["policy_tokens"].item() == 3 and stats["tokens"].item() == 5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -1.0 / 3], [0.0, 2 * 1.1 / 2, 0.0]]))
    ref = old - 0.5
    with_kl, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo", policy_mask=keep, ref_logprobs=ref, kl_coef=0.1)
    base_kl, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo", ref_logprobs=ref, kl_coef=0.1)
    base, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    assert with_kl.item() - loss.item() == pytest.approx(base_kl.item() - base.item(), abs=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_mask_of_ones_changes_nothing_and_of_a_row_drops_that_row(loss_type):
    logp, old = inputs()
    plain, _ = policy_loss(logp, old, ADV, MASK, loss_type=loss_type)
    ones, _ = policy_loss(logp, old, ADV, MASK, loss_type=loss_type, policy_mask=torch.ones(2, 3))
    assert ones.item() == plain.item()
    row0_only, _ = policy_loss(logp, old, ADV, MASK, loss_type=loss_type,
                               policy_mask=torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    alone, _ = policy_loss(logp[:1], old[:1], ADV[:1], MASK[:1], loss_type=loss_type)
    assert row0_only.item() == pytest.approx(alone.item(), abs=1e-6)


def test_gspo_policy_mask_keeps_a_share_of_the_sequence_loss():
    """GSPO spreads a sequence's loss evenly over its tokens: keeping 2 of row 0's 3 tokens
    keeps 2/3 of its loss (and none of row 1's)."""
    logp, old = inputs()
    keep = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, old, ADV, MASK, loss_type="gspo", policy_mask=keep)
    alone, _ = policy_loss(logp[:1], old[:1], ADV[:1], MASK[:1], loss_type="gspo")
    assert loss.item() == pytest.approx(2 / 3 * alone.item(), abs=1e-6)


def test_off_policy_mask_by_hand():
    """Row 0 (advantage +1) drifted far and is kept: only bad samples are masked. Row 1
    (advantage -2): its two loss tokens' sampling-minus-current log-probs 0.3 and 0.5 average
    0.4 (the masked third token's 9 is not counted): masked above a 0.39 threshold, kept at 0.4."""
    current = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    sampling = current + torch.tensor([[5.0, 5.0, 5.0], [0.3, 0.5, 9.0]])
    masked = off_policy_mask(current, sampling, ADV, MASK, 0.39)
    torch.testing.assert_close(masked, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(off_policy_mask(current, sampling, ADV, MASK, 0.4001), torch.ones(2, 3))
    # Context parallel: each rank holds some positions of each row; the drift is the whole row's.
    mine, theirs = [0, 2], [1]
    theirs_drift = ((sampling - current)[:, theirs] * MASK[:, theirs]).sum(-1, keepdim=True)
    calls = iter([theirs_drift, MASK[:, theirs].sum(-1, keepdim=True)])  # the sums it takes: drift, tokens
    shard = off_policy_mask(current[:, mine], sampling[:, mine], ADV, MASK[:, mine], 0.39,
                            sequence_sum=lambda row: row + next(calls))
    torch.testing.assert_close(shard, masked[:, mine])


def test_off_policy_mask_drops_the_policy_term_of_its_sequences():
    logp, old = inputs()
    sampling = logp.detach() + torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    keep = off_policy_mask(logp, sampling, ADV, MASK, 0.5)
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="dapo", policy_mask=keep)
    assert loss.item() == pytest.approx(-(1.28 + 0.9 + 1.0), abs=1e-6) and stats["policy_tokens"].item() == 3


def test_kl_bias_correction_weights_each_tokens_kl_by_its_ratio():
    """k3 to a reference 0.5 nats below every token, times the token's ratio r (1.5, 0.9, 1.0 |
    0.5, 1.1), grpo's per-row token means; the gradient also flows through r."""
    logp, old = inputs()
    ref = logp.detach() - 0.5
    k3 = math.exp(-0.5) - 1 + 0.5
    base, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo")
    plain, _ = policy_loss(logp, old, ADV, MASK, loss_type="grpo", ref_logprobs=ref, kl_coef=0.1)
    corrected, stats = policy_loss(logp, old, ADV, MASK, loss_type="grpo", ref_logprobs=ref, kl_coef=0.1,
                                   kl_bias_correction=True)
    assert plain.item() - base.item() == pytest.approx(0.1 * k3 * 2, abs=1e-6)  # each row's mean k3 is k3
    assert corrected.item() - base.item() == pytest.approx(0.1 * k3 * ((1.5 + 0.9 + 1.0) / 3 + (0.5 + 1.1) / 2), abs=1e-6)
    assert stats["kl"].item() == pytest.approx(k3 * (1.5 + 0.9 + 1.0 + 0.5 + 1.1), abs=1e-6)
    (grad_plain,) = torch.autograd.grad(plain - base, logp, retain_graph=True)
    (grad_corrected,) = torch.autograd.grad(corrected - base, logp)
    # d(r k3)/dlogp = r (dk3/dlogp + k3), with dk3/dlogp = 1 - exp(ref - logp) = 1 - e^-0.5.
    ratio = torch.tensor(RATIOS) * MASK
    weights = MASK / MASK.sum(-1, keepdim=True)
    torch.testing.assert_close(grad_plain, 0.1 * weights * (1 - math.exp(-0.5)))
    torch.testing.assert_close(grad_corrected, 0.1 * weights * ratio * (1 - math.exp(-0.5) + k3))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def gate(r: float, tau: float) -> float:
    """sapo's gate by hand."""
    return _sigmoid(tau * (r - 1)) * 4 / tau


def slope(r: float, tau: float) -> float:
    """d gate(exp(logp - old)) / d logp by hand: r x 4 s (1 - s)."""
    return r * 4 * _sigmoid(tau * (r - 1)) * (1 - _sigmoid(tau * (r - 1)))


def test_sapo_by_hand_soft_gate_with_asymmetric_temperatures():
    """Each token's -sigmoid(tau (r - 1)) 4 / tau A, tau 1 for row 0 (A +1) and 1.05 for row 1
    (A -2), grpo's per-completion token means; at r = 1 the gradient is the surrogate's (-A w),
    elsewhere -A w r 4 s (1 - s) with s the sigmoid; nothing counts as clipped."""
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="sapo")
    row0 = [-gate(r, 1.0) for r in (1.5, 0.9, 1.0)]
    row1 = [2 * gate(r, 1.05) for r in (0.5, 1.1)]
    assert loss.item() == pytest.approx(sum(row0) / 3 + sum(row1) / 2, abs=1e-6)
    assert stats["clipped"].item() == 0 and loss_normalizer("sapo", MASK, max_new_tokens=3).item() == 2
    loss.backward()
    want = torch.tensor([[-slope(1.5, 1.0) / 3, -slope(0.9, 1.0) / 3, -1 / 3],
                         [2 * slope(0.5, 1.05) / 2, 2 * slope(1.1, 1.05) / 2, 0.0]])
    torch.testing.assert_close(logp.grad, want)
    other, _ = policy_loss(logp.detach(), old, ADV, MASK, loss_type="sapo", sapo_temperatures=(2.0, 3.0))
    assert other.item() == pytest.approx(-sum(gate(r, 2.0) for r in (1.5, 0.9, 1.0)) / 3
                                         + sum(2 * gate(r, 3.0) for r in (0.5, 1.1)) / 2, abs=1e-6)


def test_luspo_by_hand_weighs_each_sequence_by_its_length():
    """GSPO's sequence ratios (1.35^(1/3) and 0.55^(1/2)) clipped at 1 - 2e-3 / 1 + 2.5e-3: row 0
    (A +1) loses -1.0025 per token over 3 tokens, row 1 (A -2) 2 x 0.998 over 2; mean over
    completions. GSPO with the same clip takes each row's loss once."""
    logp, old = inputs()
    loss, stats = policy_loss(logp, old, ADV, MASK, loss_type="luspo")
    assert loss.item() == pytest.approx(-1.0025 * 3 + 1.996 * 2, abs=1e-5)
    assert stats["clipped"].item() == 5 and loss_normalizer("luspo", MASK, max_new_tokens=3).item() == 2
    gspo, _ = policy_loss(logp, old, ADV, MASK, loss_type="gspo", clip_eps_low=2e-3, clip_eps_high=2.5e-3)
    assert gspo.item() == pytest.approx(-1.0025 + 1.996, abs=1e-5)
    # The KL term is weighed alike: per token, not per token over the length.
    ref = old - 0.5
    with_kl, _ = policy_loss(logp, old, ADV, MASK, loss_type="luspo", ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1")
    log_pq = torch.log(torch.tensor(RATIOS)) + 0.5
    assert with_kl.item() - loss.item() == pytest.approx(0.1 * float((log_pq * MASK).sum()), abs=1e-5)


def test_adaptive_entropy_coefficient_by_hand():
    """Up by delta at or below the target (capped at high), down above it (floored at low)."""
    step = dict(target=0.2, delta=0.05, low=0.0, high=0.12)
    assert adapted_entropy_coef(0.1, 0.1, **step) == pytest.approx(0.12)
    assert adapted_entropy_coef(0.05, 0.2, **step) == pytest.approx(0.1)  # at the target: up
    assert adapted_entropy_coef(0.1, 0.3, **step) == pytest.approx(0.05)
    assert adapted_entropy_coef(0.02, 0.3, **step) == 0.0


def test_document_totals_score_packed_completions_as_one_per_row():
    """Two completions packed in one row (documents 0 and 1, then padding) get the same
    sequence-level loss, gradients and masks as the same completions one per row: GSPO's
    ratio, a sequence's importance weight and the off-policy mask's drift are each taken over
    the completion's own tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = (3, 5)
    logp = [(-1.0 + 0.3 * torch.randn(n, generator=g)) for n in lengths]
    old = [x + 0.05 * torch.randn(len(x), generator=g) for x in logp]
    gen = [x + 0.05 * torch.randn(len(x), generator=g) for x in logp]
    advantages = (0.7, -1.2)

    def unpacked():
        rows = torch.zeros(2, 6)
        rows_old, rows_gen, mask, adv = torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6)
        for i, n in enumerate(lengths):
            rows[i, :n], rows_old[i, :n], rows_gen[i, :n], mask[i, :n] = logp[i], old[i], gen[i], 1
            adv[i] = advantages[i]
        return rows.requires_grad_(), rows_old, rows_gen, mask, adv, row_totals()

    def packed():
        row, row_old, row_gen, mask, adv = (torch.zeros(1, 10) for _ in range(5))
        docs = torch.full((1, 10), -1)
        start = 0
        for i, n in enumerate(lengths):
            span = slice(start, start + n)
            row[0, span], row_old[0, span], row_gen[0, span], mask[0, span], adv[0, span] = (
                logp[i], old[i], gen[i], 1, advantages[i])
            docs[0, span] = i
            start += n
        return row.requires_grad_(), row_old, row_gen, mask, adv, document_totals(docs, slots=10)

    results = []
    for layout in (unpacked, packed):
        x, x_old, x_gen, mask, adv, totals = layout()
        weights, _ = importance_weights(x_old, x_gen, mask, level="sequence", cap=2.0, totals=totals)
        keep = off_policy_mask(x, x_gen, adv, mask, 0.0, totals=totals)
        loss, _ = policy_loss(x, x_old, adv, mask, loss_type="gspo", is_weights=weights, policy_mask=keep, totals=totals)
        loss.backward()
        on = mask > 0
        results.append((loss, x.grad[on], weights[on], keep[on]))
    (loss_a, grad_a, w_a, keep_a), (loss_b, grad_b, w_b, keep_b) = results
    assert torch.equal(keep_a, keep_b) and 0 < keep_a.sum() < keep_a.numel()  # one completion masked
    torch.testing.assert_close(w_b, w_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-6, atol=1e-9)
    # and the weights are per completion: each completion's tokens share one weight
    assert len(set(w_b[:3].tolist())) == 1 and len(set(w_b[3:].tolist())) == 1 and w_b[0] != w_b[3]
