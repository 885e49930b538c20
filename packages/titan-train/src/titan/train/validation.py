"""Validation: the loss of held-out batches every ``--validation.freq`` steps, under any layout.

The validator reads its own corpus (``--validation.dataset.*``) through the same resumable
global-stream loader as training, and evaluates it with the engine's ``forward_only``, so it
works under every parallelism the engine supports. Every validation pass starts from the same
position of its stream: the numbers of different steps are comparable.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from titan.train.data import DatasetConfig, build_dataloader
from titan.train.engine import TrainingEngine
from titan.train.loss import count_valid_tokens, supervised_loss


@dataclass(kw_only=True)
class ValidationConfig:
    """Held-out loss during training (``--validation.*``)."""

    enable: bool = False
    """Evaluate the validation corpus every ``freq`` steps (and after the last step)."""
    freq: int = 500
    """Optimizer steps between validation passes."""
    steps: int = 10
    """Microbatches of ``--training.local_batch_size`` rows per data-parallel rank per pass
    (``titan sft``: at most this many; one pass over the held-out examples may end sooner)."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The validation corpus (``--validation.dataset.name``, ``.path``, ``.split`` ...); use a
    held-out split or files, e.g. ``--validation.dataset.split validation``. ``titan sft``
    scores its held-out examples instead (``--sft_data.eval_path``, or the synthetic task's)."""

    def __post_init__(self) -> None:
        for flag in ("freq", "steps"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--validation.{flag} must be >= 1, got {getattr(self, flag)}")


class Validator:
    """Runs validation passes for a loop: ``due(step)`` says when, ``run()`` returns
    ``{"validation_loss", "validation_perplexity", "validation_tokens"}`` (global values,
    equal on every rank; collective)."""

    def __init__(self, config: ValidationConfig, *, engine: TrainingEngine, tokenizer, local_batch_size: int,
                 seq_len: int, seed: int, loss_chunk_tokens: int = 0, compile_loss: bool = False,
                 loader: Callable[..., Iterable[dict[str, torch.Tensor]]] | None = None) -> None:
        """``loader(dp_rank=, dp_world_size=, local_batch_size=, seq_len=, seed=)``: the held-out
        batches (SFT's held-out examples); None reads ``--validation.dataset``."""
        self.config, self.engine = config, engine
        self._loader = loader
        self._loss = supervised_loss(chunk_tokens=loss_chunk_tokens, compiled=compile_loss)
        dims = engine.parallel_dims
        self._loader_args = dict(dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size,
                                 local_batch_size=local_batch_size, seq_len=seq_len, seed=seed)
        self._tokenizer = tokenizer
        self._batches: list[dict[str, torch.Tensor]] | None = None

    def due(self, step: int, *, last_step: bool) -> bool:
        """Whether a pass runs after optimizer step ``step``."""
        return self.config.enable and (step % self.config.freq == 0 or last_step)

    def _fixed_batches(self) -> list[dict[str, torch.Tensor]]:
        """The pass's microbatches, read once: every pass sees the same tokens."""
        if self._batches is None:
            loader = iter(self._loader(**self._loader_args) if self._loader is not None
                          else build_dataloader(self.config.dataset, self._tokenizer, **self._loader_args))
            # at most --validation.steps microbatches; a held-out set may end sooner
            self._batches = list(itertools.islice(loader, self.config.steps))
        return self._batches

    def run(self) -> dict[str, float]:
        """One pass in eval mode; the model goes back to training mode after it."""
        engine = self.engine
        device = engine.device
        loss_sum = torch.zeros((), device=device)
        tokens = torch.zeros((), device=device)
        engine.train(False)
        try:
            for batch in self._fixed_batches():
                batch = engine.to_device(batch)
                loss_sum += engine.forward_only(batch, self._loss)
                tokens += count_valid_tokens(batch["labels"])
        finally:
            engine.train(True)
        if engine.parallel_dims.pp_enabled:
            loss_sum = engine.sum_over(loss_sum, "pp")  # only the last stage computed it
        loss_sum = engine.sum_over(loss_sum, "dp_cp")
        tokens = engine.sum_over(tokens, "dp")  # CP peers counted the same full rows
        loss = float(loss_sum / tokens.clamp(min=1))
        return {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 80.0)),
                "validation_tokens": int(tokens)}
