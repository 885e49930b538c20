"""The policy loss of a rollout's microbatch as the engine calls it: ``loss_fn(logits, batch)``.

:mod:`titan.rl.losses` holds the losses as pure functions of tensors; this module turns the
``--rl.*`` flags into the closure the engine's ``forward_backward`` calls for each
microbatch of a rollout: the policy's log-probs of the labels (fp32, chunked, never gathering
vocabulary-sharded logits), what the PPO ratio is taken against (``--rl.old_logprobs``), the
importance weights, the configured loss, and the per-token stats the controller reduces over
microbatches and ranks (sums, except :data:`MAX_STATS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from titan.rl.config import RLSection
from titan.rl.logprobs import token_entropy, token_logprobs
from titan.rl.losses import (
    Totals,
    document_totals,
    importance_weights,
    off_policy_mask,
    policy_loss,
    row_totals,
)

SUMMED_STATS: tuple[str, ...] = (
    "tokens", "clipped", "kl", "entropy", "completion_tokens", "logprob_diff_sum", "is_weight", "is_capped",
    "is_masked", "policy_tokens", "off_policy_masked",
)
"""The loss's stats that add over microbatches and ranks."""
MAX_STATS: tuple[str, ...] = ("logprob_diff_max", "is_weight_max")
"""The loss's stats reduced with a max."""


def combine_stats(into: dict[str, Any], stats: Mapping[str, Any]) -> None:
    """Add ``stats`` into ``into``: sums, except :data:`MAX_STATS`, which keep their maximum.
    For a loss call's tensors (detached, float64, on the device: no host sync) and for an
    update's reduced floats alike."""
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
        if key not in into:
            into[key] = value
        elif key in MAX_STATS:
            into[key] = torch.maximum(into[key], value) if isinstance(value, torch.Tensor) else max(into[key], value)
        else:
            into[key] = into[key] + value



class RolloutLoss:
    """The loss closures of one run: ``--rl.*`` (``rl``), the sampling temperature the
    generator's log-probs were taken at, and ``--training.loss_chunk_tokens``.
    ``sequence_sum``: a differentiable sum of a per-row value over the context-parallel ranks
    (each holds a share of every row's tokens), for a sequence's importance weight
    (``--rl.is_level sequence``) and GSPO's sequence ratio; None without context parallel.
    ``slots``: the most completions a row can hold (its length): with ``--rl.padding_free`` a
    completion's sums are taken per document (:func:`document_totals`) in that many slots."""

    def __init__(self, rl: RLSection, *, temperature: float, chunk_tokens: int,
                 sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None, slots: int = 0) -> None:
        self.rl, self.temperature, self.chunk_tokens = rl, temperature, chunk_tokens
        self.sequence_sum, self.slots = sequence_sum, slots
        self.entropy_coef = rl.entropy_coef  # the controller moves it under --rl.adaptive_entropy

    @classmethod
    def on_engine(cls, engine: Any, rl: RLSection, *, temperature: float, chunk_tokens: int) -> RolloutLoss:
        """The loss of a run on ``engine`` (a ``TrainingEngine``): under context parallel a
        sequence's importance weight and GSPO's sequence ratio sum over the CP ranks."""
        return cls(rl, temperature=temperature, chunk_tokens=chunk_tokens, sequence_sum=engine.sequence_sum,
                   slots=engine.seq_len)

    def totals(self, batch: Mapping[str, torch.Tensor]) -> Totals:
        """Each completion's sums (:data:`~titan.rl.losses.Totals`) in ``batch``: per document
        of its packed rows with ``--rl.padding_free``, else per row."""
        if self.rl.padding_free:
            document_ids = batch["document_ids"]
            return document_totals(document_ids, max(self.slots, document_ids.shape[-1]), self.sequence_sum)
        return row_totals(self.sequence_sum)

    def label_logprobs(self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (fp32, 0 off the labels) of the label tokens, and the label mask. Logits
        sharded over the vocabulary (tensor parallel with loss parallel) stay sharded: a
        vocab-parallel cross-entropy gives each token's log-prob."""
        labels = batch["labels"]
        valid = (labels >= 0).float()
        logp = token_logprobs(logits, labels.clamp(min=0), self.temperature, chunk_tokens=self.chunk_tokens)
        return logp * valid, valid

    def token_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each position's entropy of the policy at the sampling temperature (fp32, in chunks;
        vocab-sharded logits are never gathered)."""
        return token_entropy(logits, self.temperature, chunk_tokens=self.chunk_tokens)

    def policy_mask(self, logp: torch.Tensor, batch: Mapping[str, torch.Tensor], high_entropy: torch.Tensor | None,
                    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The tokens that carry the policy term: the high-entropy ones (``high_entropy``,
        --rl.top_entropy_quantile) less those --rl.off_policy_mask_threshold masks (against
        the generator's log-probs, the policy that sampled them), and the count it masked;
        None: every token."""
        threshold = self.rl.off_policy_mask_threshold
        if threshold is None:
            return high_entropy, {}
        keep = off_policy_mask(logp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], threshold,
                               totals=self.totals(batch))
        masked = ((1 - keep) * batch["loss_mask"].to(keep.dtype)).sum()
        return (keep if high_entropy is None else keep * high_entropy), {"off_policy_masked": masked}

    def ratio_terms(self, before_update: torch.Tensor, generator: torch.Tensor, loss_mask: torch.Tensor,
                    totals: Totals | None = None):
        """What the PPO ratio is taken against, the importance weights, the ratio cap and the
        weights' stats, for --rl.old_logprobs (trainer: decoupled; generator: bypass).
        ``totals``: the batch's completion sums (default: one completion per row)."""
        rl = self.rl
        if rl.old_logprobs == "generator":
            return generator, None, rl.is_cap if rl.is_level == "token" else 0.0, {}
        if rl.is_level == "off":
            return before_update, None, 0.0, {}
        weights, stats = importance_weights(
            before_update, generator, loss_mask, level=rl.is_level, cap=rl.is_cap,
            mask_low=rl.is_mask_low, mask_high=rl.is_mask_high, totals=totals or row_totals(self.sequence_sum),
        )
        return before_update, weights, 0.0, stats

    def for_microbatch(self, accumulator: dict[str, torch.Tensor], trainer_old: torch.Tensor | None, *,
                       measure_mismatch: bool, policy_mask: torch.Tensor | None = None,
                       ) -> Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]:
        """``loss_fn(logits, batch)`` for the engine: policy log-probs of the labels (fp32),
        the configured policy loss, and token-sum stats added to ``accumulator``.

        ``trainer_old``: the trainer's log-probs of this microbatch before the rollout's first
        update (``[rows, this rank's sequence share]``, looked up by ``row_index``: a pipeline
        schedule hands the loss a subset of rows at a time), or None when the current
        log-probs are those (one update per rollout). ``measure_mismatch``: record how far the
        trainer's pre-update log-probs are from the generator's (the first pass).
        ``policy_mask``: the tokens that carry the policy term (--rl.top_entropy_quantile), laid
        out and looked up like ``trainer_old``; None: every token."""
        rl = self.rl

        def loss_fn(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
            logp, valid = self.label_logprobs(logits, batch)
            entropy_coef = self.entropy_coef
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_coef > 0):  # else only logged
                entropy = self.token_entropy(logits)
            generator = batch["old_logprobs"]
            rows = batch["row_index"][:, 0] if "row_index" in batch else None
            before_update = trainer_old[rows] if trainer_old is not None else logp.detach()
            totals = self.totals(batch)
            old, is_weights, is_cap, is_stats = self.ratio_terms(before_update, generator, batch["loss_mask"], totals)
            ref = batch.get("ref_logprobs")
            keep, keep_stats = self.policy_mask(logp, batch, policy_mask[rows] if policy_mask is not None else None)
            loss, stats = policy_loss(
                logp, old, batch["advantages"], batch["loss_mask"], loss_type=rl.loss_type,
                clip_eps_low=rl.clip_eps_low, clip_eps_high=rl.clip_eps_high, is_cap=is_cap, is_weights=is_weights,
                # Without a reference, "kl" measures the trainer's drift from the generator.
                ref_logprobs=ref if ref is not None else generator,
                kl_coef=rl.kl_coef if ref is not None else 0.0,
                kl_estimator=rl.kl_estimator, entropy=entropy, entropy_coef=entropy_coef,
                sequence_lengths=batch["sequence_lengths"] if rl.loss_type in ("grpo", "sapo") else None,
                totals=totals, dual_clip=rl.dual_clip,
                policy_mask=keep, kl_bias_correction=rl.kl_bias_correction,
                sapo_temperatures=(rl.sapo_temperature_pos, rl.sapo_temperature_neg),
            )
            stats.update(is_stats)
            stats.update(keep_stats)
            if measure_mismatch:
                diff = (before_update - generator).abs() * valid
                stats["completion_tokens"] = valid.sum()
                stats["logprob_diff_sum"] = diff.sum()
                stats["logprob_diff_max"] = diff.max() if diff.numel() else torch.zeros((), device=diff.device)
            combine_stats(accumulator, stats)
            return loss

        return loss_fn
