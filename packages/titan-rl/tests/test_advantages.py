"""Group advantages and the zero-variance filter, by hand."""

from __future__ import annotations

import pytest
import torch
from titan.rl.advantages import (
    decoupled_advantages,
    discounted_returns,
    gae,
    group_advantages,
    nonzero_variance_groups,
    reinforce_pp_advantages,
    whiten_over_tokens,
)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])


def test_grpo_advantages_are_mean_centred_and_std_normalized():
    adv = group_advantages(REWARDS, eps=0.0 + 1e-12)
    # Group 0: mean 0.5, population std 0.5. Group 2: mean 0.75, std sqrt(3 * 0.75^2 + 2.25^2) / 2.
    std2 = ((2.25**2 + 3 * 0.75**2) / 4) ** 0.5
    want = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [2.25 / std2, -0.75 / std2, -0.75 / std2, -0.75 / std2]])
    torch.testing.assert_close(adv, want)


def test_dr_grpo_advantages_are_only_centred():
    adv = group_advantages(REWARDS, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [2.25, -0.75, -0.75, -0.75]]))


def test_zero_variance_groups_are_found():
    assert nonzero_variance_groups(REWARDS).tolist() == [True, False, True]
    assert nonzero_variance_groups(torch.tensor([[1.0, 1.0 + 1e-9]]), tol=1e-6).tolist() == [False]


def test_rewards_must_be_two_dimensional():
    with pytest.raises(ValueError, match="prompts, group"):
        group_advantages(torch.zeros(4))


def test_rloo_advantages_are_leave_one_out_by_hand():
    adv = group_advantages(REWARDS, normalize_std=False, estimator="rloo")
    # Group 0: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3. Group 2: 3 - 0 = 3; 0 - 1 = -1.
    want = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [3.0, -1.0, -1.0, -1.0]])
    torch.testing.assert_close(adv, want)
    with pytest.raises(ValueError, match="not divided by a std"):
        group_advantages(REWARDS, estimator="rloo")
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.ones(2, 1), normalize_std=False, estimator="rloo")


def test_sample_std_divides_by_group_minus_one():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=1e-12, std="sample")
    std = (4 * 0.25 / 3) ** 0.5  # sum of squared deviations / (G - 1)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / std)


def test_batch_std_scope_divides_every_group_by_one_std():
    """TRL's scale_rewards="batch": group means, one std over all 12 rewards (sum 13, sum of
    squares 27: squared deviations sum to 27 - 13^2/12 = 155/12; population std
    sqrt(155/144), sample sqrt(155/132)); the groups keep their relative scale, unlike the
    per-group std."""
    centred = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [2.25, -0.75, -0.75, -0.75]])
    for std, spread in (("population", (155 / 144) ** 0.5), ("sample", (155 / 132) ** 0.5)):
        adv = group_advantages(REWARDS, eps=1e-12, std=std, std_scope="batch")
        torch.testing.assert_close(adv, centred / spread)
    with pytest.raises(ValueError, match="--rl.advantage_std_scope must be group or batch"):
        group_advantages(REWARDS, std_scope="global")


def test_batch_scope_needs_a_std_to_scale():
    from titan.rl.config import RLSection

    assert RLSection(advantage_std_scope="batch").advantage_std_scope == "batch"
    with pytest.raises(ValueError, match="this run divides by none"):
        RLSection(advantage_std_scope="batch", loss_type="dr_grpo")


def test_gdpo_normalizes_each_reward_in_its_group_before_the_weighted_sum():
    """Reward a favours completion 0 of group 0, reward b (weight 0.5) completion 1 with a ten
    times wider spread. Each normalized in its group: a [1, -1] | [0, 0] (no spread), b [-1, 1]
    | [-1, 1]; weighted sum [0.5, -0.5] | [-0.5, 0.5]; over the batch (mean 0, std 0.5)
    [1, -1] | [-1, 1]. Summed first instead, b's spread decides group 0 alone: [-1, 1]."""
    terms = {"a": torch.tensor([[1.0, 0.0], [1.0, 1.0]]), "b": torch.tensor([[0.0, 10.0], [0.0, 4.0]])}
    weights = {"a": 1.0, "b": 0.5}
    adv = decoupled_advantages(terms, weights, eps=1e-12)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))
    summed = group_advantages(terms["a"] + 0.5 * terms["b"], eps=1e-12)
    torch.testing.assert_close(summed[0], torch.tensor([-1.0, 1.0]))
    # Only the groups that train make the batch: group 1 left out gets 0, group 0 alone [1, -1].
    kept = decoupled_advantages(terms, weights, keep=torch.tensor([True, False]), eps=1e-12)
    torch.testing.assert_close(kept, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    # Sample std (G - 1) in both places: group 0's a is [0.7071, -0.7071] before the batch step.
    sample = decoupled_advantages(terms, weights, eps=1e-12, std="sample")
    torch.testing.assert_close(sample, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]) * (0.75**0.5))
    with pytest.raises(ValueError, match=r"no weight for reward terms \['b'\]"):
        decoupled_advantages(terms, {"a": 1.0})


def test_reinforce_pp_returns_and_token_whitening_by_hand():
    """Scores 1 and 0, KL penalties 0.1, 0.2 | 0.3 per token: token rewards -0.1, 0.8 | -0.3,
    returns (gamma 1) 0.7, 0.8 | -0.3, whitened over the 3 tokens (mean 0.4, population std
    sqrt(0.74 / 3)); gamma 0.5 makes the first return -0.1 + 0.5 x 0.8 = 0.3."""
    penalties = [torch.tensor([0.1, 0.2]), torch.tensor([0.3])]
    std = (0.74 / 3) ** 0.5
    got = reinforce_pp_advantages([1.0, 0.0], penalties, eps=0.0)
    torch.testing.assert_close(torch.cat(got), torch.tensor([0.3, 0.4, -0.7], dtype=torch.float64) / std)
    torch.testing.assert_close(discounted_returns(torch.tensor([-0.1, 0.8]), 0.5), torch.tensor([0.3, 0.8], dtype=torch.float64))
    # gamma 0 (on-policy distillation): each token's return is its own reward.
    torch.testing.assert_close(discounted_returns(torch.tensor([-0.1, 0.8]), 0.0), torch.tensor([-0.1, 0.8], dtype=torch.float64))
    # A long completion weighs for its length: one value over 3 tokens against one over 1.
    whitened = whiten_over_tokens([torch.full((3,), 1.0), torch.full((1,), 0.0)], eps=0.0, std="sample")
    mean, spread = 0.75, (3 * 0.25**2 + 0.75**2) ** 0.5 / 3**0.5
    torch.testing.assert_close(whitened[0], torch.full((3,), 0.25 / spread, dtype=torch.float64))
    torch.testing.assert_close(whitened[1], torch.tensor([-mean / spread], dtype=torch.float64))


def test_discounted_returns_are_the_closed_form_sums_and_gae_at_lambda_1_subtracts_the_values():
    """Over a long completion: each return is ``sum_k gamma^k r_{t+k}`` computed directly, an
    empty completion has none, and GAE at lambda 1 is exactly the return minus the value."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(300, generator=generator, dtype=torch.float64)
    values = torch.randn(300, generator=generator, dtype=torch.float64)
    gamma = 0.97
    powers = gamma ** torch.arange(300, dtype=torch.float64)
    closed = torch.stack([(rewards[t:] * powers[: 300 - t]).sum() for t in range(300)])
    returns = discounted_returns(rewards, gamma)
    assert returns.dtype == torch.float64
    torch.testing.assert_close(returns, closed, rtol=1e-12, atol=1e-12)
    assert discounted_returns(torch.zeros(0), gamma).shape == (0,)
    torch.testing.assert_close(gae(rewards, values, gamma=gamma, lam=1.0), returns - values, rtol=1e-12, atol=1e-12)
