"""Group-relative advantages: each completion's reward against its prompt's group.

GRPO samples ``G`` completions per prompt and scores each against the others:
``A_ij = (r_ij - mean_j r_i) / (std_j r_i + eps)``. Dr.GRPO drops the division by the group
standard deviation (it overweights prompts that are almost always or almost never solved);
``normalize_std=False`` gives that. A group whose rewards are all equal carries no signal
(every advantage is 0) and only dilutes the batch; :func:`nonzero_variance_groups` finds the
ones to keep (DAPO's dynamic sampling filter). RLOO (:func:`group_advantages` with
``estimator="rloo"``) compares each completion with the mean of the others instead.

With several rewards, GRPO normalizes their weighted sum; GDPO (:func:`decoupled_advantages`,
TRL's ``multi_objective_aggregation="normalize_then_sum"``) normalizes each reward within its
group first, so a reward with a wide spread cannot drown the others, then sums them with their
weights and normalizes the sum over the batch.

REINFORCE++ (verl's ``reinforce_plus_plus``; Hu 2025) has no group baseline: each token's
return (the reward at the completion's end, discounted by ``gamma`` per token, plus any
per-token KL penalty after it) is whitened over every token of the batch
(:func:`reinforce_pp_advantages`); ``reinforce_plus_plus_baseline`` subtracts the group mean
first and whitens the result over the batch's tokens (:func:`whiten_over_tokens`).

GAE (verl's ``gae``, PPO as in Ouyang et al. 2022) learns the baseline instead: a critic
predicts each token's value ``V_t`` (the return expected from the state before token ``t``),
and each token's advantage is the ``gamma * lam``-discounted sum of the TD errors
``delta_t = r_t + gamma V_{t+1} - V_t`` after it (:func:`gae_advantages`); the advantages are
whitened over the batch's tokens, the critic regresses on the returns ``A_t + V_t``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
"""The estimators :func:`group_advantages` computes (the others: :func:`reinforce_pp_advantages`,
:func:`whiten_over_tokens`)."""
AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
STD_SCOPES: tuple[str, ...] = ("group", "batch")


def group_advantages(
    rewards: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    estimator: str = "grpo",
    std: str = "population",
    std_scope: str = "group",
) -> torch.Tensor:
    """Advantages ``[N, G]`` of rewards ``[N, G]`` (N prompts, G completions each).

    ``estimator="grpo"``: rewards minus their group mean, divided by the group's standard
    deviation plus ``eps`` when ``normalize_std`` (Dr.GRPO: ``normalize_std=False``);
    ``std`` is ``"population"`` (divide by G, the default) or ``"sample"`` (by G - 1, as
    ``torch.std``'s default, which TRL and verl use); ``std_scope`` is ``"group"`` (each
    group's own std) or ``"batch"`` (one std over every reward of the batch, TRL's
    ``scale_rewards="batch"``: a group of nearly equal rewards is not blown up to unit
    scale). ``estimator="rloo"`` (REINFORCE
    leave-one-out): each reward minus the mean of the *other* G - 1 rewards of its group,
    ``G / (G - 1) * (r - mean)``, never divided by a std (``normalize_std`` must be False).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {tuple(rewards.shape)}")
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"group advantages are one of {', '.join(GROUP_ESTIMATORS)}, got {estimator!r}")
    if std not in ("population", "sample"):
        raise ValueError(f"--rl.advantage_std must be population or sample, got {std!r}")
    if std_scope not in STD_SCOPES:
        raise ValueError(f"--rl.advantage_std_scope must be group or batch, got {std_scope!r}")
    rewards = rewards.double()
    group = rewards.shape[1]
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        if group < 2:
            raise ValueError("RLOO advantages need --rl.group_size >= 2 (a completion is compared with the others)")
        if normalize_std:
            raise ValueError("RLOO advantages are not divided by a std: use normalize_std=False")
        return (centred * group / (group - 1)).float()
    if normalize_std:
        unbiased = std == "sample"
        spread = rewards.std(dim=1, unbiased=unbiased, keepdim=True) if std_scope == "group" \
            else rewards.flatten().std(unbiased=unbiased)
        centred = centred / (spread + eps)
    return centred.float()


def nonzero_variance_groups(rewards: torch.Tensor, *, tol: float = 0.0) -> torch.Tensor:
    """Bool ``[N]``: groups whose rewards are not all equal (max - min > ``tol``)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > tol


def decoupled_advantages(
    terms: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    *,
    keep: torch.Tensor | None = None,
    eps: float = 1e-6,
    std: str = "population",
) -> torch.Tensor:
    """GDPO's advantages ``[N, G]`` of several rewards, each ``[N, G]`` by label in ``terms``:
    each reward minus its group mean over its group std (``std``: population or sample) plus
    ``eps``, summed with ``weights`` (by label), then the sum minus its mean over the batch,
    over its batch std plus ``eps``. The batch is the groups in ``keep`` (bool ``[N]``; all by
    default): the groups that train; the others' advantages are 0."""
    if not terms:
        raise ValueError("decoupled advantages need each reward's own values (none were given)")
    missing = set(terms) - set(weights)
    if missing:
        raise ValueError(f"no weight for reward terms {sorted(missing)}")
    unbiased = std == "sample"
    total = None
    for label, values in terms.items():
        values = values.double()
        spread = values.std(dim=1, unbiased=unbiased, keepdim=True)
        normalized = (values - values.mean(dim=1, keepdim=True)) / (spread + eps) * weights[label]
        total = normalized if total is None else total + normalized
    keep = torch.ones(len(total), dtype=torch.bool) if keep is None else keep
    out = torch.zeros_like(total)
    if keep.any():
        kept = total[keep]
        out[keep] = (kept - kept.mean()) / (kept.flatten().std(unbiased=unbiased) + eps) if kept.numel() > 1 \
            else kept - kept.mean()
    return out.float()


def whiten_over_tokens(values: list[torch.Tensor], *, std: str = "population", eps: float = 1e-6) -> list[torch.Tensor]:
    """Per-token values (one 1-D tensor per completion) minus their mean over every token of
    all of them, over their std (``std``: population or sample) plus ``eps``: each token
    weighs the same, so a long completion counts for its length."""
    flat = torch.cat([v.double() for v in values]) if values else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return [v.double() for v in values]
    mean = flat.mean()
    spread = flat.std(unbiased=std == "sample") if flat.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return [(v.double() - mean) / (spread + eps) for v in values]


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """Each token's return: its reward plus ``gamma`` times the next token's return."""
    # On Python floats (IEEE doubles, as float64 tensors), as :func:`gae`: a per-element tensor
    # recursion costs microseconds a token.
    rewards = token_rewards.double().tolist()
    returns = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        returns[t] = running
    return torch.tensor(returns, dtype=torch.float64)


def reinforce_pp_advantages(scores: list[float], token_penalties: list[torch.Tensor], *, gamma: float = 1.0,
                            std: str = "population", eps: float = 1e-6) -> list[torch.Tensor]:
    """REINFORCE++'s per-token advantages of completions with outcome ``scores`` and per-token
    ``token_penalties`` (e.g. ``kl_coef x KL``, subtracted at each token): the token rewards
    ``-penalty_t`` plus the score at the last token, their ``gamma``-discounted returns, whitened
    over every token (:func:`whiten_over_tokens`). A completion without tokens gets none."""
    returns = []
    for score, penalty in zip(scores, token_penalties, strict=True):
        rewards = -penalty.double()
        if len(rewards):
            rewards[-1] += score
        returns.append(discounted_returns(rewards, gamma))
    return whiten_over_tokens(returns, std=std, eps=eps)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lam: float) -> torch.Tensor:
    """Generalized advantage estimates of one completion's tokens: ``A_t = delta_t + gamma lam
    A_{t+1}`` with ``delta_t = r_t + gamma V_{t+1} - V_t``, the state after the last token
    terminal (``V_T = 0``). ``lam`` 1 gives the discounted return minus ``V_t``, 0 the
    one-step TD error."""
    if token_rewards.shape != values.shape:
        raise ValueError(f"GAE needs one value per token reward, got {tuple(values.shape)} values for "
                         f"{tuple(token_rewards.shape)} rewards")
    # The recursion runs on Python floats (IEEE doubles, as float64 tensors): per-element tensor
    # ops cost ~13 us a token, seconds for a rollout of long completions.
    rewards, estimates = token_rewards.double().tolist(), values.double().tolist()
    advantages = [0.0] * len(rewards)
    running = next_value = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * next_value - estimates[t] + gamma * lam * running
        advantages[t], next_value = running, estimates[t]
    return torch.tensor(advantages, dtype=torch.float64)


def gae_advantages(scores: list[float], token_penalties: list[torch.Tensor], values: list[torch.Tensor], *,
                   gamma: float = 1.0, lam: float = 1.0, std: str = "population",
                   eps: float = 1e-6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO's ``(advantages, returns)`` per completion of outcome ``scores``: token rewards
    ``-penalty_t`` plus the score at the last token, the critic's per-token ``values``; the
    returns are ``A_t + V_t`` (the critic's targets) and the advantages are then whitened over
    every token of all completions (:func:`whiten_over_tokens`)."""
    advantages, returns = [], []
    for score, penalty, value in zip(scores, token_penalties, values, strict=True):
        rewards = -penalty.double()
        if len(rewards):
            rewards[-1] += score
        estimate = gae(rewards, value.double(), gamma=gamma, lam=lam)
        advantages.append(estimate)
        returns.append(estimate + value.double())
    return whiten_over_tokens(advantages, std=std, eps=eps), returns
