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

``--kto.loss_type bco`` is BCO (TRL's ``BCOTrainer``, without its prompt-distribution
matching): each completion's implicit reward is a binary classifier's logit around the baseline
``delta``, the running mean of the implicit rewards of every example trained so far, this
step's included (TRL's ``RunningMoments`` over its processes): the same no-grad forward before
the update scores the step's examples (not their twins) on every data-parallel rank. The
baseline is checkpointed (``kto_bco_baseline``); validation reads it without moving it.

Metrics, TRL's names with ``_`` for ``/``: ``kl`` (``z0``, averaged over the logged steps; BCO
logs ``delta`` instead, the baseline in reward units),
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

    loss_type: Literal["kto", "apo_zero_unpaired", "bco"] = "kto"
    """kto: around the reference point (the policy's KL from the reference, from the twins);
    apo_zero_unpaired: desirable log-ratios pushed up and undesirable ones down with no
    reference point (no twin pass). TRL's names. bco: TRL's BCOTrainer, the implicit reward
    as a classifier's logit around the running mean of the rewards trained on (no twin pass)."""
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

    @property
    def uses_baseline(self) -> bool:
        """The loss reads BCO's running baseline (the examples' pass runs before each update)."""
        return self.loss_type == "bco"


class RunningBaseline:
    """BCO's baseline: the mean log-ratio to the reference of every example trained so far
    (their sum and count, float64, the same on every rank; checkpointed)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        # On the training device: adding a step's sums never waits for the device.
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, total: torch.Tensor, count: torch.Tensor) -> None:
        """Count a step's examples: the sum of their log-ratios and how many they are."""
        self.total += total.detach().double()
        self.count += count.detach().double()

    @property
    def mean(self) -> torch.Tensor:
        """The mean log-ratio so far (0 before any example)."""
        return self.total / self.count.clamp(min=1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sum and the count (replicated: stored once)."""
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the sum and the count."""
        self.total.copy_(state["total"])
        self.count.copy_(state["count"])


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
    """The reference point of the microbatches being trained or scored (``before_pass``): KTO's
    z0, or BCO's baseline as a log-ratio."""

    def __init__(self, config: KTOConfig, *, model_spec) -> None:
        super().__init__(config, model_spec=model_spec)
        # BCO's running baseline (None for the other losses, which never read one).
        self.baseline = RunningBaseline(self.engine.device) if config.kto.uses_baseline else None
        if self.baseline is not None:
            self.engine.add_state("kto_bco_baseline", self.baseline)

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

    def before_pass(self, microbatches: list[dict[str, torch.Tensor]], *, training: bool = True) -> None:
        """``z0`` for the microbatches about to train (or be scored): the mean over all of
        them, on every data-parallel rank, of the twins' log-ratio to the reference, clamped at
        0. One no-grad forward per microbatch (TRL runs its KL batch through the model too); a
        whole step's, so it does not depend on how the step is split into microbatches,
        pipeline microbatches or ranks. Collective. Nothing (z0 = 0) for a loss without it.
        BCO: a training step's examples first join the running baseline (the same forward,
        over the examples); a validation pass reads the baseline as it stands."""
        device = self.engine.device
        if self.method.uses_baseline:
            if training:
                self.baseline.add(*self._log_ratio_totals(microbatches, twins=False).unbind())
            self._z0 = self.baseline.mean.float()
            return
        if not self.method.uses_reference_point:
            self._z0 = torch.zeros((), device=device)
            return
        totals = self._log_ratio_totals(microbatches, twins=True)
        self._z0 = (totals[0] / totals[1].clamp(min=1)).clamp(min=0).float()

    def _log_ratio_totals(self, microbatches: list[dict[str, torch.Tensor]], *, twins: bool) -> torch.Tensor:
        """``[sum, count]`` (float64) of the log-ratios to the reference of the examples, or
        of their twins, with both scored, over ``microbatches`` on every data-parallel rank:
        one no-grad forward per microbatch. Collective."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)

        def capture(logits, b):
            sums, _ = self._document_sums(logits, b)
            example, twin = sums[:, 0::2], sums[:, 1::2]
            valid = (example[..., 1] > 0) & (twin[..., 1] > 0)
            scored = twin if twins else example
            ratios = (scored[..., 0] - scored[..., 2])[valid]
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
            totals = self.engine.sum_over(totals, "pp")  # only the last stage scored the documents
        # Tensor- and context-parallel peers hold the same sums: data-parallel ranks only.
        return self.engine.sum_over(totals, "dp")

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
        point = total["kl"] / max(total["kl_batches"], 1)
        if self.method.uses_baseline:  # BCO's baseline, in reward units (TRL's delta)
            means["delta"] = self.method.beta * point
        else:
            means["kl"] = point
        counts = {"pairs": int(total["examples"]), "count_chosen": int(total["count_chosen"]),
                  "count_rejected": int(total["count_rejected"])}
        return {f"{prefix}{name}": value for name, value in {**counts, **means}.items()}

    def summary_line(self, record: dict[str, Any]) -> str:
        """The console line of a logged record's KTO statistics (and its held-out ones)."""
        held_out = ("" if "validation_loss" not in record else
                    f" | held-out: loss {record['validation_loss']:.4f}  margin {record['validation_rewards_margins']:.3f}")
        point = f"delta {record['delta']:.4f}" if "delta" in record else f"kl {record['kl']:.4f}"
        return (f"{point}  reward chosen {record['rewards_chosen']:.3f}  rejected "
                f"{record['rewards_rejected']:.3f}  margin {record['rewards_margins']:.3f} ({record['count_chosen']} + "
                f"{record['count_rejected']} examples){held_out}")


__all__ = ["KTOConfig", "KTOSection", "KTOTrainer", "KTO_STATS", "RunningBaseline"]
