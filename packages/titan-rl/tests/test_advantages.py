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
