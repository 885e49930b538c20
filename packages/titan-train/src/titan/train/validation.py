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
from titan.train.engine import TrainingEngine, local_value
from titan.train.loss import count_valid_tokens, supervised_loss


@dataclass(kw_only=True)
class ValidationConfig:
    """Held-out loss during training (``--validation.*``)."""

    enable: bool = False
    """Evaluate the validation corpus every ``freq`` steps (and after the last step)."""
    freq: int = 500
    """Optimizer steps between validation passes."""
    steps: int = 10
    """Microbatches of ``local_batch_size`` rows per data-parallel rank per pass (``titan sft``:
    at most this many; one pass over the held-out examples may end sooner); -1: one whole
    pass over the held-out corpus (torchtitan's default), read afresh each time, up to its
    last full global batch."""
    local_batch_size: int | None = None
    """Rows per data-parallel rank in a validation microbatch (None: ``--training.local_batch_size``;
    torchtitan's flag). Under pipeline parallel it must equal training's (the stages' shapes
    are fixed at the first step)."""
    seq_len: int | None = None
    """Tokens per validation row (None: ``--training.seq_len``; torchtitan's flag): at most
    training's (the model's RoPE table covers that far) and, under pipeline parallel, equal."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The validation corpus (``--validation.dataset.name``, ``.path``, ``.split`` ...); use a
    held-out split or files, e.g. ``--validation.dataset.split validation``. ``titan sft``
    scores its held-out examples instead (``--sft_data.eval_path``, or the synthetic task's)."""

    def __post_init__(self) -> None:
        if self.freq < 1:
            raise ValueError(f"--validation.freq must be >= 1, got {self.freq}")
        if self.steps < 1 and self.steps != -1:
            raise ValueError(f"--validation.steps must be >= 1, or -1 for the whole held-out corpus, got {self.steps}")
        for flag in ("local_batch_size", "seq_len"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise ValueError(f"--validation.{flag} must be >= 1 (or unset: training's), got {value}")

    def shape(self, local_batch_size: int, seq_len: int, *, pipelined: bool, multiple_of: int = 1) -> tuple[int, int]:
        """(rows, tokens per row) of a validation microbatch, given training's; raises ValueError
        naming the flag where the run cannot evaluate that shape (see the fields)."""
        rows = self.local_batch_size or local_batch_size
        length = self.seq_len or seq_len
        if length > seq_len:
            raise ValueError(f"--validation.seq_len {length} is longer than --training.seq_len {seq_len}, as far as "
                             "the model's RoPE table reaches; lower it to at most that")
        if pipelined and (rows, length) != (local_batch_size, seq_len):
            raise ValueError(f"--validation.local_batch_size/--validation.seq_len ({rows} x {length}) must equal "
                             f"training's ({local_batch_size} x {seq_len}) under pipeline parallel, whose stages fix "
                             "their shapes at the first step; drop them")
        if length % multiple_of:
            raise ValueError(f"--validation.seq_len {length} must divide by {multiple_of} (2 x the context-parallel "
                             "degree: its head-tail chunks), as --training.seq_len does")
        return rows, length


class Validator:
    """Runs validation passes for a loop: ``due(step)`` says when, ``run()`` returns
    ``{"validation_loss", "validation_perplexity", "validation_tokens"}`` (global values,
    equal on every rank; collective), and ``validation_<name>`` for a loss a loop adds with
    :meth:`also_report`."""

    def __init__(self, config: ValidationConfig, *, engine: TrainingEngine, tokenizer, local_batch_size: int,
                 seq_len: int, seed: int, loss_chunk_tokens: int = 0, compile_loss: bool = False,
                 loader: Callable[..., Iterable[dict[str, torch.Tensor]]] | None = None) -> None:
        """``loader(dp_rank=, dp_world_size=, local_batch_size=, seq_len=, seed=)``: the held-out
        batches (SFT's held-out examples); None reads ``--validation.dataset``."""
        self.config, self.engine = config, engine
        self._loader = loader
        self._loss = supervised_loss(chunk_tokens=loss_chunk_tokens, compiled=compile_loss)
        dims = engine.parallel_dims
        rows, length = local_batch_size, seq_len
        if config.enable:  # a disabled validator's flags are someone else's defaults (a job file's)
            rows, length = config.shape(local_batch_size, seq_len, pipelined=dims.pp_enabled,
                                        multiple_of=engine.parallel_dims.sequence_multiple)
        self._loader_args = dict(dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size,
                                 local_batch_size=rows, seq_len=length, seed=seed)
        self._tokenizer = tokenizer
        self._batches: list[dict[str, torch.Tensor]] | None = None
        self._extra: tuple[str, Callable, Callable] | None = None

    def also_report(self, name: str, loss_fn: Callable, prepare: Callable[[dict], dict]) -> None:
        """Report ``validation_<name>`` too: ``loss_fn``'s sum over the held-out batches divided
        by their label tokens, from the same forward as the loss, each batch first passed
        through ``prepare`` (e.g. to add a teacher's logits), as the loop's training loss is."""
        self._extra = (name, loss_fn, prepare)

    def due(self, step: int, *, last_step: bool) -> bool:
        """Whether a pass runs after optimizer step ``step``."""
        return self.config.enable and (step % self.config.freq == 0 or last_step)

    def _fixed_batches(self) -> Iterable[dict[str, torch.Tensor]]:
        """The pass's microbatches: ``--validation.steps`` of them, read once (every pass sees the
        same tokens); with -1 the whole held-out corpus, read afresh each pass (never all held)."""
        if self.config.steps == -1:
            return self._one_pass()
        if self._batches is None:
            # at most --validation.steps microbatches; a held-out set may end sooner
            self._batches = list(itertools.islice(self._new_loader(), self.config.steps))
        return self._batches

    def _new_loader(self):
        return (self._loader(**self._loader_args) if self._loader is not None
                else build_dataloader(self.config.dataset, self._tokenizer, **self._loader_args))

    def _one_pass(self) -> Iterable[dict[str, torch.Tensor]]:
        """Every global batch of the held-out corpus's first epoch, in its order: an endless
        pretraining loader is read until its position enters the second epoch (the batch that
        crossed is left out: it holds the corpus's start again). The position is global, so
        every rank stops at the same batch. A finite loader (SFT's held-out examples) ends itself."""
        loader = self._new_loader()
        if self._loader is not None:
            yield from loader
            return
        if loader.epoch is None:
            raise ValueError("--validation.steps -1 reads the held-out corpus once, but a --validation.dataset.mix "
                             "has no end; set --validation.steps N")
        count = 0
        for batch in loader:
            if loader.epoch > 0:
                break
            count += 1
            yield batch
        if count == 0:
            raise ValueError("--validation.steps -1: the held-out corpus (--validation.dataset.*) is shorter than one "
                             "global batch of --validation.local_batch_size x --validation.seq_len per data-parallel "
                             "rank; use more held-out text or a smaller batch")

    def run(self) -> dict[str, float]:
        """One pass in eval mode; the model goes back to training mode after it."""
        engine = self.engine
        device = engine.device
        loss_sum = torch.zeros((), device=device)
        extra_sum = torch.zeros((), device=device)
        tokens = torch.zeros((), device=device)
        engine.train(False)
        try:
            for batch in self._fixed_batches():
                batch = engine.to_device(batch)
                if self._extra is None:
                    loss_sum += engine.forward_only(batch, self._loss)
                else:
                    loss_sum += engine.forward_only(self._extra[2](batch), self._both_losses(extra_sum))
                tokens += count_valid_tokens(batch["labels"])
        finally:
            engine.train(True)
        tokens = engine.sum_over(tokens, "dp")  # CP peers counted the same full rows
        loss = float(self._global_sum(loss_sum) / tokens.clamp(min=1))
        out = {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 80.0)),
               "validation_tokens": int(tokens)}
        if self._extra is not None:
            out[f"validation_{self._extra[0]}"] = float(self._global_sum(extra_sum) / tokens.clamp(min=1))
        return out

    def _both_losses(self, extra_sum: torch.Tensor) -> Callable:
        """The loss function of a pass that also reports :meth:`also_report`'s loss: the
        loss's value, the other's added to ``extra_sum`` (one forward for both)."""
        loss_fn = self._extra[1]

        def both(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            extra_sum.add_(local_value(loss_fn(logits, batch).detach()))
            return self._loss(logits, batch)

        return both

    def _global_sum(self, rank_sum: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of a loss summed on each (collective)."""
        engine = self.engine
        if engine.parallel_dims.pp_enabled:
            rank_sum = engine.sum_over(rank_sum, "pp")  # only the last stage computed it
        return engine.sum_over(rank_sum, "dp_cp")
