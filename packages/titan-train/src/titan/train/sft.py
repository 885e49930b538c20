"""Supervised fine-tuning: the pretraining loop with prompt/completion or chat data.

SFT runs on the same :class:`~titan.train.engine.TrainingEngine` as pretraining; only the
data differs. Examples are packed into rows with document boundaries, the loss covers the
completion (assistant) tokens only (labels are -100 elsewhere) and is divided by the number of
such tokens in the whole global batch, and document masking is on by default so an example's
log-probabilities do not depend on what it was packed with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from titan.train.config import RunConfig, TrainingConfig
from titan.train.data import DatasetConfig
from titan.train.data.chat import share_template_clock
from titan.train.data.sft import (
    SFTDataConfig,
    build_sft_dataloader,
    held_out_sft_batches,
    validate_sft_data_config,
)
from titan.train.trainer import Trainer


def _sft_training() -> TrainingConfig:
    return TrainingConfig(document_mask=True)


@dataclass(kw_only=True)
class SFTConfig(RunConfig):
    """A complete supervised fine-tuning run: the shared sections and the SFT data
    (``--sft_data.*``); document masking on by default (``--training.no_document_mask``
    turns it off)."""

    training: TrainingConfig = field(default_factory=_sft_training)
    sft_data: SFTDataConfig = field(default_factory=SFTDataConfig)


class SFTTrainer(Trainer):
    """Supervised fine-tuning: :class:`Trainer`'s loop over SFT batches.

    Start from pretrained weights with ``--checkpoint.initial_load_path`` (a titan checkpoint,
    or Hugging Face safetensors with ``--checkpoint.initial_load_in_hf``); resumes exactly
    like pretraining (the data position is checkpointed).
    """

    Config = SFTConfig

    def check_config(self) -> None:
        """Check ``--sft_data.*`` and what validation scores, before any work starts."""
        cfg = self.config
        validate_sft_data_config(cfg.sft_data)
        data, validation = cfg.sft_data, cfg.validation
        if validation.dataset != DatasetConfig():
            raise ValueError("--validation.dataset.* is titan train's corpus; titan sft scores held-out SFT "
                             "examples: --sft_data.eval_path (or the synthetic task's own)")
        if validation.enable and data.resolved_format != "synthetic" and not data.eval_path:
            raise ValueError("titan sft --validation.enable scores held-out examples: set --sft_data.eval_path "
                             f"(JSONL in the --sft_data.format {data.format} layout)")
        if data.eval_path and not validation.enable:
            raise ValueError("--sft_data.eval_path is scored by --validation.enable (every --validation.freq "
                             "steps); add it, or drop the path")

    def validation_loader(self):
        """One pass over the held-out SFT examples per validation (their completion tokens'
        loss), not a pretraining corpus."""
        return functools.partial(held_out_sft_batches, self.config.sft_data, self.tokenizer)

    def build_dataloader(self):
        """This data-parallel rank's resumable loader of packed SFT examples."""
        cfg = self.config
        # Every rank packs the same global rows from its own rendering of the examples: a chat
        # template's date (strftime_now) must be rank 0's on all of them.
        share_template_clock(self.engine.device if self.engine.device.type == "cuda" else None)
        dp_rank, dp_world_size = self.data_shard
        return build_sft_dataloader(
            cfg.sft_data,
            self.tokenizer,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            local_batch_size=cfg.training.local_batch_size,
            seq_len=cfg.training.seq_len,
            seed=cfg.debug.seed,
        )

    def log_extras(self) -> dict[str, Any]:
        """Passes over the data and examples skipped as too long or target-free."""
        return {**super().log_extras(), "epoch": self.dataloader.epoch, "dropped_examples": self.dataloader.dropped_examples}
