"""Direct preference optimization (``titan dpo``): the SFT loop's engine over preference pairs.

DPO trains the policy to raise a chosen completion's log-probability over a rejected one's,
measured against a frozen reference (the weights the run starts from; the losses are in
:mod:`titan.rl.preference`). This loop is :class:`~titan.train.trainer.Trainer` with:

- **the data** of :mod:`titan.rl.preference_data`: each pair placed whole in one row, its chosen
  and rejected sequences as two documents (document masking is required: neither may see the
  other), so any microbatch, pipeline or context-parallel split scores pairs where they lie;
- **the reference without a second model**: before the first step, the starting weights score
  every pair the run will train on, on the same engine and layout (one no-grad forward per
  microbatch of the run; TRL's ``precompute_ref_log_probs``), and the per-pair log-probs are
  checkpointed. No reference copy is held, so the reference costs no memory at any scale, and
  at step 1 the policy's log-probs equal the reference's up to summation order (the sigmoid
  loss is log 2);
- **the step**: each microbatch's pairs' sequence log-probs (a scatter over document ids;
  summed over the context-parallel ranks, differentiably), the loss per pair, summed and
  divided by the pairs of the whole global batch; ``--dpo.rpo_alpha`` adds the chosen
  completions' NLL (RPO), per token over the global batch;
- **metrics** under TRL's names with ``_`` for ``/``: ``rewards_chosen``, ``rewards_rejected``,
  ``rewards_accuracies``, ``rewards_margins`` (the implicit rewards ``beta (log pi - log ref)``,
  means over the pairs since the last log), ``logps_chosen``, ``logps_rejected`` and ``pairs``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from titan.rl.logprobs import token_logprobs
from titan.rl.losses import document_sums
from titan.rl.preference import (
    LABEL_SMOOTHING_LOSSES,
    MEAN_LOGPROB_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    preference_loss,
)
from titan.rl.preference_data import (
    PreferenceDataConfig,
    build_preference_dataloader,
    build_preference_source,
    held_out_preference_batches,
)
from titan.train.config import RunConfig, TrainingConfig
from titan.train.data import DatasetConfig
from titan.train.loop import StepResult
from titan.train.loss import count_valid_tokens
from titan.train.trainer import Trainer

logger = logging.getLogger("titan")

REFERENCE_PROGRESS_S = 30.0
"""Seconds between the reference pass's progress lines (a long dataset's pass takes a while)."""

STATS = ("pairs", "rewards_chosen", "rewards_rejected", "rewards_accuracies", "rewards_margins", "logps_chosen",
         "logps_rejected")
"""The step statistics, summed over pairs (``pairs`` counts them); logged as means."""


@dataclass(kw_only=True)
class DPOSection:
    """``--dpo.*``: the preference loss (names as TRL's ``DPOConfig``)."""

    beta: float = 0.1
    """How far the policy may move from the reference: the implicit reward is
    ``beta (log pi - log ref)`` (for ipo, the margin's target is ``1 / (2 beta)``)."""
    loss_type: tuple[Literal["sigmoid", "robust", "hinge", "ipo", "exo_pair", "nca_pair", "sppo_hard", "apo_zero",
                             "apo_down", "discopop", "simpo", "orpo", "sft"], ...] = ("sigmoid",)
    """sigmoid (DPO), robust (rDPO), hinge (SLiC), ipo (on per-token mean log-probs), exo_pair
    (EXO), nca_pair (NCA), sppo_hard (SPPO), apo_zero / apo_down (APO), discopop (DiscoPOP);
    without a reference (no reference pass), on mean log-probs: simpo (SimPO, TRL's CPO
    trainer) and orpo (ORPO: the chosen NLL plus beta x its odds-ratio term). Several
    (TRL's list, e.g. ``sigmoid ipo``): their sum, weighted by --dpo.loss_weights (the logged
    log-probs and rewards are the first one's); ``sft`` in the list adds the chosen
    completions' NLL with its weight (as MPO uses it; --dpo.rpo_alpha is the same term). TRL's
    names, formulas in titan.rl.preference."""
    loss_weights: tuple[float, ...] | None = None
    """One weight per --dpo.loss_type (None: 1 each), as TRL's ``loss_weights``."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is wrong (cDPO with sigmoid, rDPO with robust,
    EXO's label distribution with exo_pair); in [0, 0.5)."""
    discopop_tau: float = 0.05
    """discopop: the temperature of the blend between its logistic and exponential parts."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma (TRL's ``CPOConfig.simpo_gamma``)."""
    reference_free: bool = False
    """Compare against a uniform reference (log ref = 0) instead of the starting weights: no
    reference pass."""
    rpo_alpha: float = 0.0
    """Add this times the chosen completions' NLL (mean over their tokens in the global batch;
    RPO, TRL's ``rpo_alpha``): keeps the chosen answers likely."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse bad values and flags no chosen loss reads (also for a section changed after
        it was built)."""
        types = self.loss_types
        known = (*PREFERENCE_LOSSES, "sft")
        unknown = [t for t in types if t not in known]
        if not types or unknown or len(set(types)) != len(types):
            raise ValueError(f"--dpo.loss_type must name each of {', '.join(known)} at most once (at least one), got "
                             f"{' '.join(types)}")
        if types == ("sft",):
            raise ValueError("--dpo.loss_type sft alone is supervised fine-tuning on the chosen answers: add a "
                             "preference loss (e.g. sigmoid), or use titan sft")
        if "sft" in types and self.rpo_alpha:
            raise ValueError("--dpo.loss_type sft and --dpo.rpo_alpha add the same term (the chosen NLL): keep one")
        if self.loss_weights is not None and (len(self.loss_weights) != len(types)
                                              or any(w <= 0 for w in self.loss_weights)):
            raise ValueError(f"--dpo.loss_weights {' '.join(map(str, self.loss_weights))} must be one positive weight "
                             f"per --dpo.loss_type ({' '.join(types)})")
        if not self.beta > 0:
            raise ValueError(f"--dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        for flag, readers, changed in (
            ("label_smoothing", LABEL_SMOOTHING_LOSSES, self.label_smoothing != 0),
            ("discopop_tau", ("discopop",), self.discopop_tau != DPOSection.discopop_tau),
            ("simpo_gamma", ("simpo",), self.simpo_gamma != DPOSection.simpo_gamma),
        ):
            if changed and not set(types) & set(readers):
                raise ValueError(f"--dpo.{flag} is read by --dpo.loss_type {', '.join(readers)}, not "
                                 f"{' '.join(types)}: drop it")
        if not self.discopop_tau > 0:
            raise ValueError(f"--dpo.discopop_tau must be > 0, got {self.discopop_tau}")
        if "orpo" in types and self.rpo_alpha:
            raise ValueError("--dpo.loss_type orpo already adds the chosen completions' NLL (weight 1, ORPO's "
                             "objective): drop --dpo.rpo_alpha")
        if self.rpo_alpha < 0:
            raise ValueError(f"--dpo.rpo_alpha must be >= 0, got {self.rpo_alpha}")

    @property
    def loss_types(self) -> tuple[str, ...]:
        """The loss types, a tuple (one given as a string counts as one)."""
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    @property
    def weighted_losses(self) -> list[tuple[str, float]]:
        """(loss type, weight) of each loss of the sum."""
        weights = self.loss_weights or (1.0,) * len(self.loss_types)
        return list(zip(self.loss_types, weights, strict=True))

    @property
    def preference_losses(self) -> list[tuple[str, float]]:
        """(loss type, weight) of the pair losses of the sum (``sft`` is the NLL term)."""
        return [(t, weight) for t, weight in self.weighted_losses if t != "sft"]

    @property
    def uses_means(self) -> bool:
        """The first pair loss compares per-token mean log-probs (ipo, simpo, orpo) rather
        than sums: the logged log-probs and rewards are means then."""
        return self.preference_losses[0][0] in MEAN_LOGPROB_LOSSES

    @property
    def uses_reference(self) -> bool:
        """A loss compares against the starting weights (they score the pairs first)."""
        return not self.reference_free and any(t not in REFERENCE_FREE_LOSSES for t, _ in self.preference_losses)

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen completions' NLL in the loss: ``rpo_alpha``, or sft's and
        orpo's weights in the sum (ORPO's objective has it)."""
        return self.rpo_alpha + sum(weight for t, weight in self.weighted_losses if t in ("orpo", "sft"))


def document_masked_training() -> TrainingConfig:
    """``--training.*`` of the loops that pack two sequences of an example in one row (DPO, KTO,
    reward models): document masking on, which they require."""
    return TrainingConfig(document_mask=True)


@dataclass(kw_only=True)
class DPOConfig(RunConfig):
    """A complete DPO run: the shared sections, the loss (``--dpo.*``) and the pairs
    (``--dpo_data.*``); document masking on (required)."""

    training: TrainingConfig = field(default_factory=document_masked_training)
    dpo: DPOSection = field(default_factory=DPOSection)
    dpo_data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)


class ReferenceLogprobs:
    """The reference's sequence log-probs of every pair (``[pairs, 2]``: chosen, rejected;
    float64) and which pairs were scored: identical on every rank, checkpointed."""

    def __init__(self, num_pairs: int) -> None:
        self.logprobs = torch.zeros(num_pairs, 2, dtype=torch.float64)
        self.known = torch.zeros(num_pairs, dtype=torch.bool)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table and its mask (replicated: stored once)."""
        return {"logprobs": self.logprobs, "known": self.known}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the table (DCP loads in place; copied for a loader that does not)."""
        if state["logprobs"].shape != self.logprobs.shape:
            raise ValueError(f"the checkpoint's reference log-probs cover {state['logprobs'].shape[0]} pairs and this "
                             f"run's data has {self.logprobs.shape[0]}: resume with the same --dpo_data.*")
        self.logprobs.copy_(state["logprobs"])
        self.known.copy_(state["known"])


def pair_slots(batch: dict[str, torch.Tensor], slots: int) -> torch.Tensor:
    """``[B, slots]`` int64: the data index of the pair in each pair slot of each row (slot k
    holds documents 2k and 2k + 1), -1 for empty slots."""
    docs, pairs = batch["document_ids"], batch["pair_index"]
    out = torch.full((docs.shape[0], slots), -1, dtype=torch.int64)
    rows, positions = torch.nonzero(docs >= 0, as_tuple=True)
    out[rows, docs[rows, positions] // 2] = pairs[rows, positions]
    return out


class DPOTrainer(Trainer):
    """DPO on :class:`Trainer`'s loop (see the module docstring). Start from the SFT model with
    ``--checkpoint.initial_load_path`` (titan) or with ``--checkpoint.initial_load_in_hf``
    (Hugging Face safetensors): those weights are the reference."""

    Config = DPOConfig
    command = "dpo"
    """The ``titan`` subcommand, for messages."""
    method_section, data_section = "dpo", "dpo_data"
    """The config sections of the loss (``--dpo.*``) and of the data (``--dpo_data.*``)."""
    unit = "pairs"
    """What the data's items are called in messages."""
    STATS = STATS
    """The step statistics' names (:meth:`reduce_stats`), the first the count of pairs."""
    reference_table = True
    """Whether the loop keeps (and checkpoints) the reference log-prob tables."""

    @property
    def method(self) -> Any:
        """The loss's section (``--dpo.*``)."""
        return getattr(self.config, self.method_section)

    @property
    def data(self) -> PreferenceDataConfig:
        """The data's section (``--dpo_data.*``)."""
        return getattr(self.config, self.data_section)

    def __init__(self, config: DPOConfig, *, model_spec) -> None:
        super().__init__(config, model_spec=model_spec)
        self.slots = (config.training.seq_len + 1) // 2  # pair slots per row: at most one per two positions
        self.reference = ReferenceLogprobs(self.dataloader.num_examples if self.reference_table else 0)
        if self.reference_table:
            self.engine.add_state("dpo_reference", self.reference)
        self._stats = self._new_stats()
        self._step_pairs: tuple[torch.Tensor, torch.Tensor] | None = None
        # Held-out pairs (--validation.enable): their own reference table, scored with the rest.
        self.eval_reference: ReferenceLogprobs | None = None
        if config.validation.enable:
            self.validator = DPOValidator(self.validator, self)
            if self.reference_table:
                self.eval_reference = ReferenceLogprobs(self.validator.num_pairs())
                self.engine.add_state("dpo_eval_reference", self.eval_reference)

    def _new_stats(self) -> torch.Tensor:
        return torch.zeros(len(self.STATS), dtype=torch.float64, device=self.engine.device)

    # ---- flags and data -----------------------------------------------------------------

    def check_config(self) -> None:
        """Refuse the flags DPO cannot honour, naming them."""
        cfg = self.config
        training = cfg.training
        command, data_flag = f"titan {self.command}", f"--{self.data_section}"
        if not training.document_mask:
            raise ValueError(f"{command} packs two sequences of an example in one row, which must not see each other: "
                             "drop --training.no_document_mask")
        if training.loss_type != "nll":
            raise ValueError(f"--training.loss_type {training.loss_type} is an SFT token loss; {command} has its own "
                             f"(--{self.method_section}.*): drop it")
        if cfg.validation.dataset != DatasetConfig():
            raise ValueError(f"--validation.dataset.* is titan train's corpus; {command} scores held-out examples: "
                             f"{data_flag}.eval_path (or the synthetic task's own)")
        data = self.data
        if cfg.validation.enable and data.resolved_format != "synthetic" and not data.eval_path:
            raise ValueError(f"{command} --validation.enable scores held-out examples: set {data_flag}.eval_path")
        if data.eval_path and not cfg.validation.enable:
            raise ValueError(f"{data_flag}.eval_path is scored by --validation.enable (every --validation.freq "
                             "steps); add it, or drop the path")
        if cfg.compile.enable and cfg.compile.components == ["loss"]:
            raise ValueError(f"--compile.components loss compiles the cross-entropy, which {command} does not use: "
                             "add model to the components, or drop --compile.enable")

    def validation_loader(self):
        """One pass over the held-out pairs per validation."""
        return functools.partial(held_out_preference_batches, self.data, self.tokenizer)

    def build_dataloader(self):
        """This data-parallel rank's resumable loader of packed preference pairs."""
        return self._preference_loader(*self.data_shard)

    def _preference_loader(self, dp_rank: int, dp_world_size: int, local_batch_size: int | None = None):
        cfg = self.config
        return build_preference_dataloader(
            self.data, self.tokenizer, dp_rank=dp_rank, dp_world_size=dp_world_size,
            local_batch_size=local_batch_size or cfg.training.local_batch_size, seq_len=cfg.training.seq_len,
            seed=cfg.debug.seed)

    def next_microbatches(self, data_iter) -> list[dict[str, torch.Tensor]]:
        """The step's microbatches, each with the row of every token (``row_index``, so a
        pipeline's last stage knows which rows it scores) and, on each document's first token,
        its reference log-prob (``reference_logprobs``)."""
        return [self.prepare_rows(next(data_iter), self.reference) for _ in range(self.grad_accum_steps)]

    def prepare_rows(self, batch: dict[str, torch.Tensor], table: ReferenceLogprobs | None) -> dict[str, torch.Tensor]:
        """A microbatch as the loss reads it: each token's row, and each document's reference
        log-prob from ``table`` (training's or the held-out one's)."""
        return self._with_reference(self._with_rows(batch), table)

    @staticmethod
    def _with_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = torch.arange(batch["input_ids"].shape[0]).unsqueeze(1).expand_as(batch["input_ids"])
        return {**batch, "row_index": rows.contiguous()}

    def _with_reference(self, batch: dict[str, torch.Tensor], table: ReferenceLogprobs) -> dict[str, torch.Tensor]:
        values = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        if self.method.uses_reference:
            docs = batch["document_ids"]
            slots = pair_slots(batch, self.slots)
            first = (batch["positions"] == 0) & (docs >= 0)
            rows, positions = torch.nonzero(first, as_tuple=True)
            doc = docs[rows, positions]
            pairs = slots[rows, doc // 2]
            if not bool(table.known[pairs].all()):
                missing = sorted({int(p) for p in pairs[~table.known[pairs]]})[:5]
                raise RuntimeError(f"step {self.step + 1}: pairs {missing} have no reference log-probs")
            values[rows, positions] = table.logprobs[pairs, doc % 2].float()
        return {**batch, "reference_logprobs": values}

    # ---- sequence log-probs -------------------------------------------------------------

    def _document_sums(self, logits: torch.Tensor, batch: dict[str, torch.Tensor],
                       extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row and document slot (``[B, 2 * slots, C]``, document d in slot d): the sums over
        the document's tokens of (policy log-prob of its labels, labelled tokens, reference
        log-prob[, ``extra``: a per-token value of the caller's]), whole (summed over the
        context-parallel ranks, differentiably), and the same sums over this rank's own tokens."""
        labels = batch["labels"]
        valid = (labels >= 0).float()
        logp = token_logprobs(logits, labels.clamp(min=0), chunk_tokens=self.config.training.loss_chunk_tokens) * valid
        columns = [logp, valid, batch["reference_logprobs"].to(logp.dtype)]
        if extra is not None:
            columns.append(extra.to(logp.dtype))
        local = document_sums(torch.stack(columns, dim=-1), batch["document_ids"], 2 * self.slots)
        sequence_sum = self.engine.sequence_sum
        return (sequence_sum(local) if sequence_sum is not None else local), local

    def _pair_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], *, global_pairs: torch.Tensor,
                   global_chosen_tokens: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the microbatch's summed pair losses (plus its RPO term scaled to
        the global pair count), and the step statistics of its pairs."""
        dpo = self.config.dpo
        sums, local = self._document_sums(logits, batch)
        chosen, rejected = sums[:, 0::2], sums[:, 1::2]
        chosen_tokens, rejected_tokens = chosen[..., 1], rejected[..., 1]
        valid = (chosen_tokens > 0) & (rejected_tokens > 0)
        summed = [side[..., column][valid] for column in (0, 2) for side in (chosen, rejected)]
        counts = [chosen_tokens[valid].clamp(min=1), rejected_tokens[valid].clamp(min=1)] * 2
        means = [value / n for value, n in zip(summed, counts, strict=True)]  # ipo, simpo, orpo: per-token means
        losses, rewards = 0, None
        for loss_type, weight in dpo.preference_losses:
            values = means if loss_type in MEAN_LOGPROB_LOSSES else summed
            part, part_rewards = preference_loss(
                *values, beta=dpo.beta, loss_type=loss_type, discopop_tau=dpo.discopop_tau, simpo_gamma=dpo.simpo_gamma,
                label_smoothing=dpo.label_smoothing if loss_type in LABEL_SMOOTHING_LOSSES else 0.0)
            losses = losses + weight * part
            rewards = part_rewards if rewards is None else rewards  # the first loss's
        policy = means[:2] if dpo.uses_means else summed[:2]
        # Under context parallel each rank carries its token share of a pair's loss (the shares
        # sum to one pair loss; the sequence sum's backward brings every rank's gradient back).
        local_tokens = local[..., 1].detach()
        share = (local_tokens[:, 0::2] + local_tokens[:, 1::2])[valid] / (chosen_tokens + rejected_tokens)[valid]
        loss = (losses * share.detach()).sum()
        if dpo.nll_weight:  # this rank's chosen tokens' NLL, a mean over the global batch's chosen tokens
            chosen_nll = -local[:, 0::2, 0].sum()
            loss = loss + dpo.nll_weight * chosen_nll * global_pairs / global_chosen_tokens.clamp(min=1)
        self._accumulate(self._stats if stats is None else stats, rewards, policy[0].detach(), policy[1].detach())
        return loss

    @staticmethod
    def _accumulate(stats: torch.Tensor, rewards: dict[str, torch.Tensor], logps_chosen: torch.Tensor,
                    logps_rejected: torch.Tensor) -> None:
        """Add a microbatch's pairs to the step statistics (every tensor- and context-parallel
        rank holds the same pairs; the log step sums over data-parallel ranks only)."""
        chosen_r, rejected_r = rewards["chosen_rewards"], rewards["rejected_rewards"]
        values = [torch.tensor(float(len(chosen_r)), device=chosen_r.device), chosen_r.sum(), rejected_r.sum(),
                  (chosen_r > rejected_r).float().sum(), (chosen_r - rejected_r).sum(), logps_chosen.sum(),
                  logps_rejected.sum()]
        stats += torch.stack([v.double() for v in values])

    # ---- the step -----------------------------------------------------------------------

    def before_pass(self, microbatches: list[dict[str, torch.Tensor]], *, training: bool = True) -> None:
        """What a loss needs from all of a step's (or, ``training`` False, a validation pass's)
        microbatches before the first one's loss: nothing for DPO; KTO's reference point, BCO's
        running baseline (moved by training steps only). Collective."""

    @staticmethod
    def _pair_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs in a microbatch of whole rows: half its documents."""
        return ((batch["document_ids"].amax(dim=1) + 1) // 2).sum()

    def _train_step(self, microbatches: list[dict[str, torch.Tensor]], *, sync: bool) -> StepResult:
        """One optimizer step: every microbatch's pair losses divided by the pairs of the whole
        global batch (``StepResult.tokens`` stays the label tokens, for ``tokens_seen``)."""
        self.engine.start_step()
        microbatches = [self.engine.to_device(mb) for mb in microbatches]
        counts = torch.stack([torch.stack([self._pair_count(mb).float(), count_valid_tokens(mb["labels"]).float(),
                                           count_valid_tokens(torch.where(mb["document_ids"] % 2 == 0, mb["labels"], -100)
                                                              ).float()])
                              for mb in microbatches]).sum(0)
        global_counts = self.engine.sum_over(counts.clone(), "dp")
        global_pairs, global_tokens, global_chosen_tokens = global_counts.unbind()
        self._step_pairs = (counts[0], global_pairs)
        self.before_pass(microbatches)

        def loss_fn(logits, batch):
            return self._pair_loss(logits, batch, global_pairs=global_pairs, global_chosen_tokens=global_chosen_tokens)

        rank_loss = torch.zeros((), device=self.engine.device)
        for i, mb in enumerate(microbatches):
            rank_loss += self.engine.forward_backward(mb, loss_fn, global_token_count=global_pairs.clamp(min=1),
                                                      aux_token_count=global_tokens,
                                                      last_microbatch=i == len(microbatches) - 1)
        if sync:
            self._check_finite(float(rank_loss))
        lr = self.engine.lr_schedulers.last_lr()
        grad_norm = self.engine.optimizer_step(sync=sync)
        return StepResult(rank_loss=rank_loss, rank_tokens=counts[1], tokens=global_tokens, grad_norm=grad_norm, lr=lr,
                          rank_aux_loss=self.engine.aux_loss_share())

    def loss_counts(self, result: StepResult) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss is a mean over pairs: (this rank's, the global batch's)."""
        return self._step_pairs

    def log_extras(self) -> dict[str, Any]:
        """The pair statistics of the steps since the last log (means over their pairs;
        collective)."""
        stats = self._stats.clone()
        self._stats.zero_()
        return {**super().log_extras(), **self.reduce_stats(stats)}

    def _log(self, result: StepResult, validation: dict[str, float] | None = None) -> dict[str, Any]:
        """The step's record, and on the console a line of its pair statistics (the progress
        line shows the loss only)."""
        record = super()._log(result, validation)
        if self.is_rank0:
            logger.info("step %d: %s", record["step"], self.summary_line(record))
        return record

    def validation_line(self, validation: dict[str, float]) -> str | None:
        """None: the held-out figures are in :meth:`summary_line`'s line."""
        return None

    def summary_line(self, record: dict[str, Any]) -> str:
        """The console line of a logged record's statistics (and its held-out ones)."""
        held_out = ("" if "validation_loss" not in record else
                    f" | held-out: loss {record['validation_loss']:.4f}  reward accuracy "
                    f"{record['validation_rewards_accuracies']:.3f}  margin {record['validation_rewards_margins']:.3f}")
        return (f"reward accuracy {record['rewards_accuracies']:.3f}  margin {record['rewards_margins']:.3f}  "
                f"chosen {record['rewards_chosen']:.3f}  rejected {record['rewards_rejected']:.3f} "
                f"({record['pairs']} pairs){held_out}")

    def reduce_stats(self, stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """``stats`` (this rank's sums) summed over the mesh, as means over the pairs
        (``pairs``: their count). Collective."""
        if self.parallel_dims.pp_enabled:
            stats = self.engine.sum_over(stats, "pp")  # only the last stage scored the pairs
        # Tensor- and context-parallel peers hold the same pairs: data-parallel ranks only.
        totals = self.engine.sum_over(stats, "dp").tolist()
        pairs = totals[0]
        means = {f"{prefix}{name}": value / max(pairs, 1)
                 for name, value in zip(self.STATS[1:], totals[1:], strict=True)}
        return {f"{prefix}pairs": int(pairs), **means}

    # ---- the reference pass -------------------------------------------------------------

    def run_steps(self, guard, profiler, records) -> bool:
        """Score the pairs with the reference first (a fresh run), or check that the restored
        scores cover the steps left (a resumed one); then :class:`Trainer`'s steps."""
        if self.method.uses_reference:
            if self.step == 0 and not bool(self.reference.known.any()):
                self.score_reference()
            else:
                self._check_reference_covers_run()
        return super().run_steps(guard, profiler, records)

    def _check_held_out_scored(self) -> None:
        """A resumed run validates only held-out pairs the starting weights scored."""
        if self.eval_reference is not None and not bool(self.eval_reference.known.any()):
            raise ValueError(f"resuming at step {self.step} with --validation.enable: the held-out pairs were not "
                             "scored by the starting weights (the run started without validation), and the weights "
                             "have moved since; resume without --validation.enable, or start a new run from this "
                             "checkpoint with --checkpoint.initial_load_path")

    def held_out_batches(self):
        """The held-out microbatches of a validation pass, with rows and reference log-probs."""
        for batch in self.validator.batches():
            yield self.prepare_rows(batch, self.eval_reference)

    def _remaining_microbatches(self) -> int:
        return (self.config.training.steps - self.step) * self.grad_accum_steps

    def score_reference(self) -> None:
        """The starting weights' log-probs of every pair the run's steps will read: the
        training loader's own microbatches from its current position (so the same layouts),
        one no-grad forward each, skipping those whose pairs are all scored (later epochs).
        The table is then summed over all ranks, so every rank holds all of it."""
        started = time.perf_counter()
        loader = self._preference_loader(*self.data_shard)
        loader.load_state_dict(self.dataloader.state_dict())
        training = (next(loader) for _ in range(self._remaining_microbatches()))
        forwards = self._score_into(self.reference, training)
        message = f"reference log-probs of {int(self.reference.known.sum())} {self.unit}"
        if self.eval_reference is not None:
            forwards += self._score_into(self.eval_reference, self.validator.batches())
            message += f" and {int(self.eval_reference.known.sum())} held-out ones"
        logger.info("%s from the starting weights: %d forwards in %.1fs", message, forwards,
                    time.perf_counter() - started)

    def _score_into(self, table: ReferenceLogprobs, batches) -> int:
        """Fill ``table`` with the current weights' log-probs of the pairs of ``batches`` (this
        rank's microbatches, as many on every rank); returns the forwards run."""
        totals = torch.zeros(len(table.known), 2, dtype=torch.float64)
        times = torch.zeros(len(table.known), dtype=torch.float64)
        counted = self._counts_pairs()
        forwards = 0
        started = last_report = time.perf_counter()
        self.engine.train(False)  # no MoE balancing statistics from this pass
        try:
            for read, batch in enumerate(batches, start=1):
                if self.is_rank0 and time.perf_counter() - last_report > REFERENCE_PROGRESS_S:
                    last_report = time.perf_counter()
                    logger.info("reference pass: %d microbatches read, %d scored, %.1f s", read - 1, forwards,
                                last_report - started)
                batch = self._with_rows(batch)
                slots = pair_slots(batch, self.slots)
                needed = torch.tensor([float(bool(((slots >= 0) & (times[slots.clamp(min=0)] == 0)).any()))],
                                      device=self.engine.device)
                if not self._any_rank(needed):
                    continue
                forwards += 1
                sums = self._score(batch)
                if sums is not None and counted:
                    valid = slots >= 0
                    pairs = slots[valid]
                    totals[pairs] += sums.view(sums.shape[0], -1, 2)[valid].double()
                    times[pairs] += 1
        finally:
            self.engine.train(True)
        if dist.is_initialized() and self.engine.dist_env.world_size > 1:
            packed = torch.cat([totals, times.unsqueeze(1)], dim=1).to(self.engine.device)
            dist.all_reduce(packed)
            totals, times = packed[:, :2].cpu(), packed[:, 2].cpu()
        known = times > 0
        table.logprobs[known] = totals[known] / times[known].unsqueeze(1)
        table.known |= known
        return forwards

    def _counts_pairs(self) -> bool:
        """Whether this rank adds its scores to the table: one rank of each tensor- and
        context-parallel group (they hold the same whole-sequence sums) on the last stage."""
        coords = self.parallel_dims.coords
        return self.engine.pp_has_last and coords.get("tp", 0) == 0 and coords.get("cp", 0) == 0

    def _any_rank(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` is set on any rank (collective)."""
        if dist.is_initialized() and self.engine.dist_env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[B, 2 * slots]`` the policy's whole-sequence log-prob of every document of
        ``batch`` (no grad); None on pipeline stages without the output."""
        batch = {**batch, "reference_logprobs": torch.zeros(batch["input_ids"].shape)}
        return self.per_document(batch, lambda logits, b: self._document_sums(logits, b)[0][..., 0])

    def per_document(self, batch: dict[str, torch.Tensor], values) -> torch.Tensor | None:
        """``[B, 2 * slots]``: ``values(logits, microbatch)`` (a ``[rows, 2 * slots]`` value per
        document slot of the rows a pipeline microbatch holds) for every row of ``batch`` (rows
        prepared for the loss, ``row_index`` included), from one no-grad forward; None on
        pipeline stages without the output."""
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []

        def capture(logits, b):
            pieces.append((b["row_index"][:, 0], values(logits, b).detach()))
            return torch.zeros((), device=logits.device)

        self.engine.forward_only(self.engine.to_device(batch), capture)
        if not pieces:
            return None
        out = torch.zeros(batch["input_ids"].shape[0], 2 * self.slots, dtype=torch.float32)
        for rows, scored in pieces:
            out[rows.cpu()] = scored.float().cpu()
        return out

    def _check_reference_covers_run(self) -> None:
        """A resumed run: every pair its remaining steps read has restored reference
        log-probs (a run resumed with more --training.steps than it started with may reach
        pairs the starting weights never scored, and the weights have moved since)."""
        self._check_held_out_scored()
        # Each rank checks its own rows (a replica group's table holds its own shard's pairs),
        # and every rank raises if any rank found one missing.
        loader = self._preference_loader(*self.data_shard)
        loader.load_state_dict(self.dataloader.state_dict())
        missing = False
        for _ in range(self._remaining_microbatches()):
            pairs = next(loader)["pair_index"].unique()
            pairs = pairs[pairs >= 0]
            if not bool(self.reference.known[pairs].all()):
                missing = True
                break
        if self._any_rank(torch.tensor([float(missing)], device=self.engine.device)):
            raise ValueError(
                f"resuming at step {self.step}: --training.steps {self.config.training.steps} reaches pairs the "
                "starting weights did not score (the run started with fewer steps, and the reference is the "
                "weights it started from); resume with the original --training.steps, or start a new run from "
                "this checkpoint with --checkpoint.initial_load_path (a new reference)")


class DPOValidator:
    """``--validation.enable`` for DPO: every ``--validation.freq`` steps, the held-out pairs'
    loss and reward statistics (``validation_loss``, ``validation_rewards_accuracies``, ...)
    against the reference the run started from. Wraps the loop's :class:`Validator` for its
    schedule and held-out batches (``--validation.steps`` microbatches, or -1: all)."""

    def __init__(self, validator: Any, trainer: DPOTrainer) -> None:
        self.inner, self.trainer = validator, trainer

    def due(self, step: int, *, last_step: bool) -> bool:
        """Whether a pass runs after optimizer step ``step``."""
        return self.inner.due(step, last_step=last_step)

    def batches(self):
        """The held-out microbatches of one pass (the same ones every pass)."""
        return iter(self.inner._fixed_batches())

    def num_pairs(self) -> int:
        """How many held-out pairs the data holds (the size of their reference table)."""
        return len(build_preference_source(self.trainer.data, self.trainer.tokenizer, held_out=True))

    def run(self) -> dict[str, float]:
        """One pass in eval mode: the mean pair loss and statistics over the held-out pairs."""
        trainer, engine = self.trainer, self.trainer.engine
        stats = trainer._new_stats()
        batches = [engine.to_device(batch) for batch in trainer.held_out_batches()]
        trainer.before_pass(batches, training=False)
        counts = torch.stack([torch.stack([trainer._pair_count(b).float(), count_valid_tokens(
            torch.where(b["document_ids"] % 2 == 0, b["labels"], -100)).float()]) for b in batches]).sum(0)
        pairs, chosen_tokens = engine.sum_over(counts, "dp").unbind()
        loss_sum = torch.zeros((), device=engine.device)
        engine.train(False)
        try:
            for batch in batches:
                loss_sum += engine.forward_only(batch, functools.partial(
                    trainer._pair_loss, global_pairs=pairs, global_chosen_tokens=chosen_tokens, stats=stats))
        finally:
            engine.train(True)
        if engine.parallel_dims.pp_enabled:
            loss_sum = engine.sum_over(loss_sum, "pp")
        loss = float(engine.sum_over(loss_sum, "dp_cp")) / max(float(pairs), 1.0)
        return {"validation_loss": loss, **trainer.reduce_stats(stats, prefix="validation_")}


def build_dpo_trainer(config: DPOConfig, *, model_spec) -> DPOTrainer:
    """The DPO loop of ``config`` (what ``titan dpo`` runs)."""
    return DPOTrainer(config, model_spec=model_spec)


__all__ = ["DPOConfig", "DPOSection", "DPOTrainer", "ReferenceLogprobs", "build_dpo_trainer", "document_masked_training",
           "pair_slots"]
