"""Reward modeling (``titan reward``): a score head trained to rank chosen over rejected.

The model is the run's family with a one-column score head in place of its output projection
(``num_labels = 1``: a Hugging Face ``...ForSequenceClassification``, as TRL's ``RewardTrainer``
trains one). Start from a language model (``--checkpoint.initial_load_path``, titan's or Hugging
Face's): its body loads and the head starts from its initialization.

The loop is :class:`~titan.rl.dpo.DPOTrainer`'s (pairs packed whole, two documents a pair, any
layout) without a reference: the data (:mod:`titan.rl.reward_data`) encodes each side as the
reward model will be asked to score it, a sequence's reward ``r`` is the score at its last token,
and the loss per pair is the Bradley-Terry one,

    -log sigmoid(r_chosen - r_rejected - m)  [+ c (r_chosen + r_rejected)^2 with
                                                --reward.center_rewards_coefficient c]

with ``m`` the pair's margin when the rows have a margin column (TRL's ``margin``), else 0,

summed and divided by the pairs of the global batch. Under context parallel a document's last
token is on one rank: each rank scatters the scores of the last tokens it holds into per-pair
sums, summed over the ranks differentiably.

Metrics (TRL's ``accuracy`` and ``margin`` under DPO's names, so the two compare): ``pairs``,
``rewards_chosen``, ``rewards_rejected``, ``rewards_accuracies`` (the share of pairs ranked
right) and ``rewards_margins``, means over the pairs since the last log; with
``--validation.enable`` the same on held-out pairs. Export with
``--checkpoint.last_save_in_hf``: transformers loads the folder as
``AutoModelForSequenceClassification``, and ``titan rl --rl.rewards model --rl.reward_model
FOLDER`` scores with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from titan.rl.dpo import DPOTrainer, document_masked_training
from titan.rl.losses import document_sums
from titan.rl.reward_data import RewardDataConfig
from titan.train.config import RunConfig, TrainingConfig

REWARD_STATS = ("pairs", "rewards_chosen", "rewards_rejected", "rewards_accuracies", "rewards_margins")
"""The step statistics, summed over pairs (``pairs`` counts them); logged as means."""


@dataclass(kw_only=True)
class RewardSection:
    """``--reward.*``: the reward model's loss (TRL's ``RewardConfig`` names)."""

    center_rewards_coefficient: float = 0.0
    """Add this times ``(r_chosen + r_rejected)^2`` per pair, pulling the rewards' mean to 0
    (TRL's ``center_rewards_coefficient``, after Eisenstein et al. 2023); 0: off."""

    uses_reference = False
    """A reward model compares its own scores: no reference pass."""

    def __post_init__(self) -> None:
        if not self.center_rewards_coefficient >= 0:
            raise ValueError(f"--reward.center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}")


@dataclass(kw_only=True)
class RewardConfig(RunConfig):
    """A complete reward-model run: the shared sections, the loss (``--reward.*``) and the pairs
    (``--reward_data.*``); document masking on (required)."""

    training: TrainingConfig = field(default_factory=document_masked_training)
    reward: RewardSection = field(default_factory=RewardSection)
    reward_data: RewardDataConfig = field(default_factory=RewardDataConfig)


def with_score_head(model_spec: Any, flavor: str) -> Any:
    """``model_spec`` building every model with a one-column score head (``num_labels=1``);
    a family without score heads is refused by name."""
    args = model_spec.flavors.get(flavor)
    if args is not None and not hasattr(args, "num_labels"):
        raise ValueError(f"titan reward trains a score head, which the {model_spec.name} family does not have "
                         "(its args have no num_labels; llama3, qwen3, qwen3_moe and deepseek_v3 do): choose another "
                         "--model.name")
    family_build = model_spec.build

    def build(name: str, **overrides: Any):
        return family_build(name, **{**overrides, "num_labels": 1})

    return dataclasses.replace(model_spec, build=build)


def last_tokens(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` float: 1 on each document's last token (a document ends where the next
    position holds another document, or at the row's end), 0 elsewhere and on padding."""
    following = torch.cat([document_ids[:, 1:], torch.full_like(document_ids[:, :1], -1)], dim=1)
    return ((document_ids >= 0) & (following != document_ids)).float()


@dataclass
class PairRewards:
    """Per row and pair slot (``[B, slots]`` each) of a microbatch: what the loss reads."""

    chosen: torch.Tensor
    """The chosen sequence's reward (differentiable)."""
    rejected: torch.Tensor
    """The rejected sequence's reward (differentiable)."""
    margin: torch.Tensor
    """The pair's margin (0 without a margin column)."""
    valid: torch.Tensor
    """Whether the slot holds a pair."""
    share: torch.Tensor
    """This rank's share of the pair's tokens (1 without context parallel)."""


class RewardTrainer(DPOTrainer):
    """Reward modeling on the DPO loop (module docstring)."""

    Config = RewardConfig
    command = "reward"
    method_section, data_section = "reward", "reward_data"
    unit = "pairs"
    STATS = REWARD_STATS
    reference_table = False
    trains_score_head = True

    def _build(self, config: Any, model_spec: Any) -> None:
        super()._build(config, with_score_head(model_spec, config.model.flavor))

    def prepare_rows(self, batch: dict[str, torch.Tensor], table: Any) -> dict[str, torch.Tensor]:
        """A microbatch as the loss reads it: each token's row and, on each document's last
        token, a 1 (``last_token``; marked on whole rows, before any context-parallel split)."""
        del table  # no reference
        return {**self._with_rows(batch), "last_token": last_tokens(batch["document_ids"])}

    def pair_rewards(self, scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> PairRewards:
        """Per row and pair slot, from ``scores`` ``[B, S]``: the chosen and rejected rewards
        (each the score at its document's last token), the pair's margin, and this rank's share
        of its tokens; summed over the context-parallel ranks."""
        last = batch["last_token"].to(scores.dtype)
        margin = batch["margin"].to(scores.dtype) if "margin" in batch else torch.zeros_like(scores)
        columns = torch.stack([scores * last, last, (batch["document_ids"] >= 0).to(scores.dtype), margin * last],
                              dim=-1)
        local = document_sums(columns, batch["document_ids"], 2 * self.slots)
        sequence_sum = self.engine.sequence_sum
        sums = sequence_sum(local) if sequence_sum is not None else local
        chosen, rejected = sums[:, 0::2], sums[:, 1::2]
        tokens = chosen[..., 2] + rejected[..., 2]
        share = (local[:, 0::2, 2] + local[:, 1::2, 2]).detach() / tokens.detach().clamp(min=1)
        return PairRewards(chosen=chosen[..., 0], rejected=rejected[..., 0], margin=chosen[..., 3].detach(),
                           valid=(chosen[..., 1] > 0) & (rejected[..., 1] > 0), share=share)

    def _pair_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], *, global_pairs: torch.Tensor,
                   global_chosen_tokens: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the microbatch's summed pair losses, and the step statistics of
        its pairs."""
        del global_pairs, global_chosen_tokens  # the engine divides by the pairs; no token term
        pairs = self.pair_rewards(logits[..., 0].float(), batch)
        valid = pairs.valid
        chosen, rejected = pairs.chosen[valid], pairs.rejected[valid]
        losses = -F.logsigmoid(chosen - rejected - pairs.margin[valid])
        coefficient = self.config.reward.center_rewards_coefficient
        if coefficient:
            losses = losses + coefficient * (chosen + rejected) ** 2
        # Under context parallel each rank carries its token share of a pair's loss (the shares
        # sum to one pair loss; the sequence sum's backward brings every rank's gradient back).
        loss = (losses * pairs.share[valid]).sum()
        chosen, rejected = chosen.detach(), rejected.detach()
        values = [torch.tensor(float(len(chosen)), device=chosen.device), chosen.sum(), rejected.sum(),
                  (chosen > rejected).float().sum(), (chosen - rejected).sum()]
        (self._stats if stats is None else stats).add_(torch.stack([v.double() for v in values]))
        return loss

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[B, 2 * slots]`` the reward of every document of ``batch`` (a loader's rows; no
        grad, the model as it is now); None on pipeline stages without the head."""
        def rewards(logits, b):
            pairs = self.pair_rewards(logits[..., 0].float(), b)
            return torch.stack([pairs.chosen, pairs.rejected], dim=-1).flatten(1)

        return self.per_document(self.prepare_rows(batch, None), rewards)


__all__ = ["REWARD_STATS", "PairRewards", "RewardConfig", "RewardSection", "RewardTrainer", "last_tokens", "with_score_head"]
