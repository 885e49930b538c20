"""Preference-optimization losses (DPO and its variants) as pure functions of sequence log-probs.

Each example is a prompt with a ``chosen`` and a ``rejected`` completion. The losses compare
the policy's and a frozen reference's log-probability of each completion (summed over its
tokens): with ``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))``, the log-ratio margin,

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log sigmoid(beta h)``; with label smoothing
  ``eps`` (cDPO: the preference label is wrong with probability ``eps``)
  ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
- ``robust`` (rDPO, Chowdhury et al. 2024): the unbiased form under that label noise,
  ``(-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)``;
- ``hinge`` (SLiC): ``max(0, 1 - beta h)``;
- ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, on log-probs averaged over each
  completion's tokens (the caller passes means for it, as TRL does);
- ``exo_pair`` (EXO, Ji et al. 2024): the reverse KL from the label distribution
  ``(1 - eps, eps)`` to the policy's ``(sigmoid(beta h), sigmoid(-beta h))``, with
  ``eps = label_smoothing`` (1e-3 when 0, as the KL needs it above zero);
- ``nca_pair`` (NCA, Chen et al. 2024): with the implicit rewards ``rc = beta (log pi(c) -
  log ref(c))`` and ``rr`` alike, ``-log sigmoid(rc) - (log sigmoid(-rc) + log sigmoid(-rr)) / 2``:
  absolute rewards, so the chosen likelihood is pushed up, not only the margin;
- ``sppo_hard`` (SPPO with hard labels, Wu et al. 2024): the chosen log-ratio regressed to
  ``1 / (2 beta)`` and the rejected one to ``-1 / (2 beta)`` (squared errors, summed);
- ``apo_zero`` / ``apo_down`` (APO, D'Oosterlinck et al. 2024): ``apo_zero`` raises the chosen
  log-ratio and lowers the rejected one, each through a sigmoid: ``(1 - sigmoid(beta lc)) +
  sigmoid(beta lr)`` (for chosen answers better than the model's own); ``apo_down``
  ``sigmoid(beta lc) + (1 - sigmoid(beta h))`` lowers both, the rejected more (chosen answers
  worse than the model's own);
- ``discopop`` (DiscoPOP, Chris Lu et al. 2024): a blend of the logistic and the exponential
  loss of ``beta h``, weighted by ``sigmoid(beta h / tau)`` (``discopop_tau``).

Two losses need no reference (the reference arguments are ignored; pass zeros) and compare
log-probs averaged over each completion's tokens, as their papers do:

- ``simpo`` (SimPO, Meng et al. 2024): ``-log sigmoid(beta (mc - mr) - gamma)`` of the mean
  log-probs ``mc``, ``mr``, with the target margin ``gamma`` (``simpo_gamma``; cDPO's label
  smoothing applies as for ``sigmoid``);
- ``orpo`` (ORPO, Hong et al. 2024): the odds-ratio term ``-beta log sigmoid(log odds(c) - log
  odds(r))`` with ``log odds(y) = m - log(1 - exp(m))``; ORPO's objective adds the chosen
  completions' NLL, which the caller owns (it is a token mean over the batch).

Each returns the per-example losses (the caller averages them over the global batch) and the
implicit rewards ``beta (log pi - log ref)`` of both completions, whose difference's sign is
the preference accuracy. Names follow TRL's ``DPOConfig.loss_type``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES: tuple[str, ...] = ("sigmoid", "robust", "hinge", "ipo", "exo_pair", "nca_pair", "sppo_hard",
                                      "apo_zero", "apo_down", "discopop", "simpo", "orpo")
REFERENCE_FREE_LOSSES: tuple[str, ...] = ("simpo", "orpo")
"""The losses that read no reference."""
MEAN_LOGPROB_LOSSES: tuple[str, ...] = ("ipo", "simpo", "orpo")
"""The losses of log-probs averaged over each completion's tokens (not summed)."""
LABEL_SMOOTHING_LOSSES: tuple[str, ...] = ("sigmoid", "robust", "exo_pair", "simpo")
"""The losses that read ``label_smoothing``."""
EXO_DEFAULT_EPS = 1e-3
"""EXO's label smoothing when none is given (its KL needs both labels above zero)."""


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-example losses ``[B]`` of ``loss_type`` (module docstring) from the policy's and
    the reference's sequence log-probs of the chosen and rejected completions (each ``[B]``),
    and ``{"chosen_rewards", "rejected_rewards"}`` (``[B]`` each, detached)."""
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"the DPO loss_type must be one of {', '.join(PREFERENCE_LOSSES)}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"the DPO beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"the DPO label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type not in LABEL_SMOOTHING_LOSSES:
        raise ValueError(f"the DPO label_smoothing is read by {', '.join(LABEL_SMOOTHING_LOSSES)}, not {loss_type}")
    if loss_type in REFERENCE_FREE_LOSSES:  # the policy's own log-probs are the "ratios"
        reference_chosen, reference_rejected = torch.zeros_like(policy_chosen), torch.zeros_like(policy_rejected)
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    margin = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "exo_pair":
        eps = eps or EXO_DEFAULT_EPS
        z = beta * margin
        losses = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log(1 - eps))
                  + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    elif loss_type == "nca_pair":
        rc, rr = beta * chosen_ratio, beta * rejected_ratio
        losses = -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
    elif loss_type == "sppo_hard":
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * margin))
    elif loss_type == "simpo":
        z = beta * margin - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss_type == "orpo":
        log_odds = margin - (_log1m_exp(policy_chosen) - _log1m_exp(policy_rejected))
        losses = -beta * F.logsigmoid(log_odds)
    else:  # discopop
        if discopop_tau <= 0:
            raise ValueError(f"the DiscoPOP tau must be > 0, got {discopop_tau}")
        z = beta * margin
        weight = torch.sigmoid(z / discopop_tau)
        losses = -F.logsigmoid(z) * (1 - weight) + torch.exp(-z) * weight
    rewards = {"chosen_rewards": (beta * chosen_ratio).detach(), "rejected_rewards": (beta * rejected_ratio).detach()}
    return losses, rewards


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for log-probs ``x < 0``, stable near 0 (through ``expm1``); a mean
    log-prob of exactly 0 (probability 1) is held a hair below it."""
    return torch.log(-torch.expm1(x.clamp(max=-1e-6)))


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, *, mean: bool = False) -> torch.Tensor:
    """Each row's log-probability of its completion ``[B]``: the masked sum of its tokens'
    log-probs ``[B, S]`` (their mean with ``mean``, for ipo)."""
    mask = mask.to(token_logprobs.dtype)
    summed = (token_logprobs * mask).sum(-1)
    return summed / mask.sum(-1).clamp(min=1) if mean else summed



KTO_LOSSES: tuple[str, ...] = ("kto", "apo_zero_unpaired", "bco")
"""The unpaired losses :func:`kto_loss` computes (TRL's ``KTOConfig.loss_type``, and BCO: TRL's
``BCOTrainer`` without its prompt-distribution matching)."""


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024) per-example losses ``[B]`` of unpaired completions, and
    their implicit rewards ``beta (log pi - log ref)`` (detached). With the log-ratio
    ``r = log pi(y) - log ref(y)`` and the reference point ``kl`` (a detached scalar: the
    policy's KL from the reference, estimated on mismatched prompt/completion pairs and
    clamped at 0), a desirable completion (``desirable`` true) costs
    ``desirable_weight (1 - sigmoid(beta (r - kl)))``, an undesirable one
    ``undesirable_weight (1 - sigmoid(beta (kl - r)))``: each is pushed away from the
    reference point on its own side. ``loss_type="apo_zero_unpaired"`` (APO-zero, unpaired):
    ``1 - sigmoid(beta r)`` and ``sigmoid(beta r)``, no reference point (``kl`` unread).
    ``loss_type="bco"`` (Jung et al. 2024, BCO): the implicit reward as a binary classifier's
    logit around a baseline, ``-log sigmoid(beta (r - kl))`` and ``-log sigmoid(beta (kl - r))``
    (weighted as KTO's), where ``kl`` is then the running mean of every trained example's
    log-ratio so far (TRL's ``delta`` is ``beta`` times it). TRL's ``KTOConfig`` names."""
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"the KTO loss_type must be one of {', '.join(KTO_LOSSES)}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"the KTO beta must be > 0, got {beta}")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"the KTO weights must be > 0, got {desirable_weight} and {undesirable_weight}")
    ratio = policy - reference
    kl = kl.detach() if loss_type in ("kto", "bco") else torch.zeros_like(kl)
    desirable = desirable.bool()
    if loss_type == "bco":
        losses = torch.where(desirable, -desirable_weight * F.logsigmoid(beta * (ratio - kl)),
                             -undesirable_weight * F.logsigmoid(beta * (kl - ratio)))
        return losses, (beta * ratio).detach()
    if loss_type == "apo_zero_unpaired":
        losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * ratio)),
                             undesirable_weight * torch.sigmoid(beta * ratio))
        return losses, (beta * ratio).detach()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, (beta * ratio).detach()


__all__ = ["LABEL_SMOOTHING_LOSSES", "MEAN_LOGPROB_LOSSES", "PREFERENCE_LOSSES", "REFERENCE_FREE_LOSSES", "KTO_LOSSES", "kto_loss",
           "preference_loss", "sequence_logprobs"]
