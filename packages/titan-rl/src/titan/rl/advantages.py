"""Group-relative advantages: each completion's reward against its prompt's group.

GRPO samples ``G`` completions per prompt and scores each against the others:
``A_ij = (r_ij - mean_j r_i) / (std_j r_i + eps)``. Dr.GRPO drops the division by the group
standard deviation (it overweights prompts that are almost always or almost never solved);
``normalize_std=False`` gives that. A group whose rewards are all equal carries no signal
(every advantage is 0) and only dilutes the batch; :func:`nonzero_variance_groups` finds the
ones to keep (DAPO's dynamic sampling filter).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages ``[N, G]`` of rewards ``[N, G]`` (N prompts, G completions each): rewards
    minus their group mean, divided by the group's population standard deviation plus
    ``eps`` when ``normalize_std`` (Dr.GRPO: ``normalize_std=False``)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {tuple(rewards.shape)}")
    rewards = rewards.double()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.float()


def nonzero_variance_groups(rewards: torch.Tensor, *, tol: float = 0.0) -> torch.Tensor:
    """Bool ``[N]``: groups whose rewards are not all equal (max - min > ``tol``)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > tol
