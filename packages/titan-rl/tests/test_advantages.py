"""Group advantages and the zero-variance filter, by hand."""

from __future__ import annotations

import pytest
import torch
from titan.rl.advantages import group_advantages, nonzero_variance_groups

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
