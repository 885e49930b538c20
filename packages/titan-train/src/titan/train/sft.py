"""Supervised fine-tuning: the pretraining loop with prompt/completion or chat data.

SFT runs on the same :class:`~titan.train.engine.TrainingEngine` as pretraining; only the
data differs. Examples are packed into rows with document boundaries, the loss covers the
completion (assistant) tokens only (labels are -100 elsewhere) and is divided by the number of
such tokens in the whole global batch, and document masking is on by default so an example's
log-probabilities do not depend on what it was packed with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan.train.config import RunConfig, TrainingConfig
from titan.train.data.sft import (
    SFTDataConfig,
    build_sft_dataloader,
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
        """Check ``--sft_data.*`` before any work starts."""
        validate_sft_data_config(self.config.sft_data)

    def build_dataloader(self):
        """This data-parallel rank's resumable loader of packed SFT examples."""
        cfg = self.config
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
