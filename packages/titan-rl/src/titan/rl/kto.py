"""KTO (``titan kto``): :class:`~titan.rl.dpo.DPOTrainer`'s loop on unpaired, labelled completions.

Each example is a completion labelled desirable or not (:mod:`titan.rl.kto_data`), placed with
a twin: its prompt followed by another example's completion. The loss
(:func:`titan.rl.preference.kto_loss`) pushes a desirable completion's log-ratio to the
reference above the reference point ``z0`` and an undesirable one's below it, where ``z0`` is
the policy's KL from the reference estimated on the twins: the mean over the step's twins on
every data-parallel rank of ``log pi - log ref``, clamped at 0 and detached, from one no-grad
forward of the step's microbatches before its update (TRL computes it per batch over its
processes, in a forward of its own; here it is the whole global batch's, so it does not
change with the microbatch, pipeline or rank split). Everything else is DPO's: the reference is the
starting weights' log-probs of both sequences of every example, scored once before step 1 on
the same layout and checkpointed; the loss is divided by the examples of the global batch.

Metrics, TRL's names with ``_`` for ``/``: ``kl`` (``z0``, averaged over the logged steps),
``rewards_chosen`` / ``rewards_rejected`` (mean implicit reward ``beta (log pi - log ref)`` of
the desirable / undesirable examples), ``rewards_margins`` (their difference), ``logps_chosen``
/ ``logps_rejected``, ``count_chosen`` / ``count_rejected`` and ``pairs`` (the examples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from titan.rl.dpo import DPOTrainer, document_masked_training
from titan.rl.kto_data import KTODataConfig
from titan.rl.preference import KTO_LOSSES, kto_loss
from titan.train.config import RunConfig, TrainingConfig

KTO_STATS = ("examples", "count_chosen", "count_rejected", "rewards_chosen", "rewards_rejected", "logps_chosen",
             "logps_rejected", "kl", "kl_batches")
"""The step statistics: sums over examples (``kl``: over microbatches, ``kl_batches`` counts them)."""


@dataclass(kw_only=True)
class KTOSection:
    """``--kto.*``: the KTO loss (TRL's ``KTOConfig`` names)."""

    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: around the reference point (the policy's KL from the reference, from the twins);
    apo_zero_unpaired: desirable log-ratios pushed up and undesirable ones down with no
    reference point (no twin pass). TRL's names."""
    beta: float = 0.1
    """The implicit reward's scale, ``beta (log pi - log ref)``."""
    desirable_weight: float = 1.0
    """The weight of a desirable example's loss (raise it when desirable examples are fewer)."""
    undesirable_weight: float = 1.0
    """The weight of an undesirable example's loss."""

    def __post_init__(self) -> None:
        if self.loss_type not in KTO_LOSSES:
            raise ValueError(f"--kto.loss_type must be one of {', '.join(KTO_LOSSES)}, got {self.loss_type!r}")
        if not self.beta > 0:
            raise ValueError(f"--kto.beta must be > 0, got {self.beta}")
        for flag in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, flag) > 0:
                raise ValueError(f"--kto.{flag} must be > 0, got {getattr(self, flag)}")

    uses_reference = True
    """KTO always compares against the starting weights."""

    @property
    def uses_reference_point(self) -> bool:
        """The loss reads the reference point (the twins' pass runs before each update)."""
        return self.loss_type == "kto"


@dataclass(kw_only=True)
class KTOConfig(RunConfig):
    """A complete KTO run: the shared sections, the loss (``--kto.*``) and the labelled
    completions (``--kto_data.*``); document masking on (required)."""

    training: TrainingConfig = field(default_factory=document_masked_training)
    kto: KTOSection = field(default_factory=KTOSection)
    kto_data: KTODataConfig = field(default_factory=KTODataConfig)


class KTOTrainer(DPOTrainer):
    """KTO on the DPO loop (module docstring): the examples and their twins are DPO's pairs,
    the loss and statistics KTO's."""

    Config = KTOConfig
    command = "kto"
    method_section, data_section = "kto", "kto_data"
    unit = "examples (each with its twin)"

    _z0 = torch.zeros(())
    """The reference point of the microbatches being trained or scored (``before_pass``)."""

    def _new_stats(self) -> torch.Tensor:
        return torch.zeros(len(KTO_STATS), dtype=torch.float64, device=self.engine.device)

    def _pair_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], *, global_pairs: torch.Tensor,
                   global_chosen_tokens: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the microbatch's summed example losses (against the reference
        point ``before_pass`` set), and its statistics."""
        del global_chosen_tokens  # no NLL term
        kto = self.method
        sums, local = self._document_sums(logits, batch, extra=batch["desirable"])
        example, twin = sums[:, 0::2], sums[:, 1::2]
        example_tokens, twin_tokens = example[..., 1], twin[..., 1]
        valid = (example_tokens > 0) & (twin_tokens > 0)
        z0 = self._z0.to(example.dtype)
        policy, reference = example[..., 0][valid], example[..., 2][valid]
        desirable = example[..., 3][valid] > 0
        losses, rewards = kto_loss(policy, reference, desirable, z0, beta=kto.beta, loss_type=kto.loss_type,
                                   desirable_weight=kto.desirable_weight, undesirable_weight=kto.undesirable_weight)
        # Under context parallel each rank carries its token share of an example's loss.
        local_tokens = local[..., 1].detach()
        share = (local_tokens[:, 0::2] + local_tokens[:, 1::2])[valid] / (example_tokens + twin_tokens)[valid]
        loss = (losses * share.detach()).sum()
        self._add_stats(self._stats if stats is None else stats, rewards, policy.detach(), desirable, z0)
        return loss

    def before_pass(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """``z0`` for the microbatches about to train (or be scored): the mean over all of
        them, on every data-parallel rank, of the twins' log-ratio to the reference, clamped at
        0. One no-grad forward per microbatch (TRL runs its KL batch through the model too); a
        whole step's, so it does not depend on how the step is split into microbatches,
        pipeline microbatches or ranks. Collective. Nothing (z0 = 0) for a loss without it."""
        if not self.method.uses_reference_point:
            self._z0 = torch.zeros((), device=self.engine.device)
            return
        totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)

        def capture(logits, b):
            sums, _ = self._document_sums(logits, b)
            example, twin = sums[:, 0::2], sums[:, 1::2]
            valid = (example[..., 1] > 0) & (twin[..., 1] > 0)
            ratios = (twin[..., 0] - twin[..., 2])[valid]
            totals.add_(torch.stack([ratios.sum().double(), torch.tensor(float(ratios.numel()), dtype=torch.float64,
                                                                          device=ratios.device)]))
            return torch.zeros((), device=logits.device)

        training = self.engine.model_parts[0].training
        self.engine.train(False)
        try:
            for batch in microbatches:
                self.engine.forward_only(batch, capture)
        finally:
            self.engine.train(training)
        if self.parallel_dims.pp_enabled:
            totals = self.engine.sum_over(totals, "pp")  # only the last stage scored the twins
        # Tensor- and context-parallel peers hold the same sums: data-parallel ranks only.
        totals = self.engine.sum_over(totals, "dp")
        self._z0 = (totals[0] / totals[1].clamp(min=1)).clamp(min=0).float()

    @staticmethod
    def _add_stats(stats: torch.Tensor, rewards: torch.Tensor, logps: torch.Tensor, desirable: torch.Tensor,
                   z0: torch.Tensor) -> None:
        good, bad = desirable, ~desirable
        values = [torch.tensor(float(len(rewards)), device=rewards.device), good.sum(), bad.sum(), rewards[good].sum(),
                  rewards[bad].sum(), logps[good].sum(), logps[bad].sum(), z0, torch.ones((), device=rewards.device)]
        stats += torch.stack([v.double() for v in values])

    def reduce_stats(self, stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """``stats`` summed over the mesh: means per kind of example, the mean ``kl``."""
        if self.parallel_dims.pp_enabled:
            stats = self.engine.sum_over(stats, "pp")
        total = dict(zip(KTO_STATS, self.engine.sum_over(stats, "dp").tolist(), strict=True))
        good, bad = max(total["count_chosen"], 1), max(total["count_rejected"], 1)
        means = {"rewards_chosen": total["rewards_chosen"] / good, "rewards_rejected": total["rewards_rejected"] / bad,
                 "logps_chosen": total["logps_chosen"] / good, "logps_rejected": total["logps_rejected"] / bad}
        means["rewards_margins"] = means["rewards_chosen"] - means["rewards_rejected"]
        # z0 is the same on every data-parallel rank: their mean over microbatches
        means["kl"] = total["kl"] / max(total["kl_batches"], 1)
        counts = {"pairs": int(total["examples"]), "count_chosen": int(total["count_chosen"]),
                  "count_rejected": int(total["count_rejected"])}
        return {f"{prefix}{name}": value for name, value in {**counts, **means}.items()}

    def summary_line(self, record: dict[str, Any]) -> str:
        """The console line of a logged record's KTO statistics (and its held-out ones)."""
        held_out = ("" if "validation_loss" not in record else
                    f" | held-out: loss {record['validation_loss']:.4f}  margin {record['validation_rewards_margins']:.3f}")
        return (f"kl {record['kl']:.4f}  reward chosen {record['rewards_chosen']:.3f}  rejected "
                f"{record['rewards_rejected']:.3f}  margin {record['rewards_margins']:.3f} ({record['count_chosen']} + "
                f"{record['count_rejected']} examples){held_out}")


__all__ = ["KTOConfig", "KTOSection", "KTOTrainer", "KTO_STATS"]
