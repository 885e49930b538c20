"""The trainer: builds every component from a ``TrainerConfig`` and runs the training loop.

The life of one step is in docs/design.md: microbatches -> forward -> loss normalized by the global
valid-token count -> backward -> mesh-wide clip -> optimizer step -> LR step -> metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from titan.dist import reduce_max
from titan.train.config import TrainerConfig, TrainingConfig
from titan.train.data import build_dataloader, validate_data_config
from titan.train.device_peak import device_peak_flops
from titan.train.engine import TrainingEngine
from titan.train.loss import NonFiniteLossError, count_valid_tokens, next_token_loss
from titan.train.metrics import MetricsLogger
from titan.train.model_spec import ModelSpec, ReportsExpertLoad
from titan.train.preemption import PreemptionGuard, save_for_preemption
from titan.train.profiling import StepProfiler
from titan.train.validation import Validator

logger = logging.getLogger("titan")


@dataclass
class StepResult:
    """What one optimizer step produced. The loss stays this rank's share until a logging
    step reduces it (see ``Trainer.global_loss``): no collective on steps nobody logs, and
    the counts and the norm stay on the device (no host sync) until a step reads them."""

    rank_loss: torch.Tensor
    """This rank's share of the global mean loss (zero on pipeline stages without the loss)."""
    rank_tokens: torch.Tensor
    """Valid label tokens this rank's share was computed over."""
    tokens: torch.Tensor
    """Valid label tokens of the whole global batch (a device scalar)."""
    grad_norm: float | torch.Tensor
    """Global gradient norm before clipping (a device scalar on steps that did not sync)."""
    lr: float
    """The learning rate this step applied (the scheduler has moved on since)."""


def save_run_config(config: Any, *, rank: int) -> None:
    """The resolved config as ``<dump_folder>/config.json`` (rank 0), so a run folder says
    how it was made (every loop writes it: train, SFT, RL)."""
    if rank != 0:
        return
    folder = Path(config.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"type": type(config).__name__, **dataclasses.asdict(config)}
    (folder / "config.json").write_text(json.dumps(record, indent=2, default=str) + "\n")


def grad_accum_steps(training: TrainingConfig, dp_world_size: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank: ``--training.global_batch_size``
    over ``--training.local_batch_size`` x the data-parallel degree (1 when the global batch is
    -1); a global batch that is not a multiple raises, naming the nearest valid one."""
    per_step = training.local_batch_size * dp_world_size
    global_batch = per_step if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % per_step:
        raise ValueError(
            f"--training.global_batch_size {global_batch} must be a multiple of "
            f"--training.local_batch_size {training.local_batch_size} x data-parallel degree "
            f"{dp_world_size} = {per_step}; e.g. use {max(1, global_batch // per_step) * per_step}"
        )
    return global_batch // per_step


class Trainer:
    """Pretraining: a thin loop over :class:`~titan.train.engine.TrainingEngine`.

    Builds the tokenizer, the packed data loader and the metrics logger, and hands the engine
    everything else (model, parallelism, optimizers, checkpoints). :meth:`train` runs the loop
    and returns the logged metric records; :meth:`close` drains checkpoints and releases the
    process group.
    """

    Config = TrainerConfig

    def __init__(self, config: TrainerConfig, *, model_spec: ModelSpec) -> None:
        self.config = config
        self.model_spec = model_spec
        model_spec.check_flavor(config.model.flavor)
        self.validate_data()
        self.tokenizer = config.tokenizer.build()
        vocab_size = self._vocab_size()
        self.engine = TrainingEngine.from_config(config, model_spec=model_spec, vocab_size=vocab_size)
        self._loss_fn = functools.partial(next_token_loss, chunk_tokens=config.training.loss_chunk_tokens)
        self.grad_accum_steps = self._grad_accum_steps()
        self.dataloader = self.build_dataloader()
        # The loader's position is one global record, equal on every rank (every rank fetches
        # grad_accum_steps global microbatches per step), so it resumes under any layout.
        self.engine.add_state("dataloader", self.dataloader)
        self.validator = Validator(
            config.validation,
            engine=self.engine,
            tokenizer=self.tokenizer,
            local_batch_size=config.training.local_batch_size,
            seq_len=config.training.seq_len,
            loss_chunk_tokens=config.training.loss_chunk_tokens,
            seed=config.debug.seed + 1,  # another order than training's, even on the same corpus
        )
        self.metrics = MetricsLogger(
            config.metrics,
            dump_folder=Path(config.job.dump_folder),
            total_steps=config.training.steps,
            flops_per_token=self.engine.flops_per_token,
            peak_flops=device_peak_flops(self.engine.device),
            device=self.engine.device,
            is_rank0=self.engine.dist_env.rank == 0,
        )
        self._log_start()

    def _vocab_size(self) -> int:
        """The model's vocabulary (`ModelConfig.resolve_vocab_size` of the tokenizer's)."""
        return self.config.model.resolve_vocab_size(self.tokenizer.vocab_size)

    # ---- the data: what a loop on the same engine replaces -------------------------------

    def validate_data(self) -> None:
        """Check the data flags before any work starts (raises ValueError naming the flag)."""
        validate_data_config(self.config.dataset, self.config.tokenizer)

    def build_dataloader(self):
        """This data-parallel rank's resumable loader of ``{"input_ids", "labels", ...}``
        microbatches: the packed pretraining corpus."""
        cfg = self.config
        return build_dataloader(
            cfg.dataset,
            self.tokenizer,
            dp_rank=self.parallel_dims.dp_rank,
            dp_world_size=self.parallel_dims.dp_world_size,
            local_batch_size=cfg.training.local_batch_size,
            seq_len=cfg.training.seq_len,
            seed=cfg.debug.seed,
        )

    # ---- what the engine owns, under the names loops and tests use ----------------------

    @property
    def parallel_dims(self):
        """The mesh degrees (``titan.dist.ParallelDims``)."""
        return self.engine.parallel_dims

    @property
    def mesh(self):
        """The root device mesh (None on one process)."""
        return self.engine.mesh

    @property
    def model_parts(self) -> list[torch.nn.Module]:
        """The model parts this rank holds (several under pipeline parallel)."""
        return self.engine.model_parts

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per model part."""
        return self.engine.optimizers

    @property
    def pp_schedule(self):
        """The pipeline schedule (pipeline parallel only)."""
        return self.engine.pp_schedule

    @property
    def checkpointer(self):
        """The engine's checkpoint manager."""
        return self.engine.checkpointer

    @property
    def train_state(self):
        """Step and tokens seen (checkpointed)."""
        return self.engine.train_state

    @property
    def dist_env(self):
        """Rank, world size and device of this process."""
        return self.engine.dist_env

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.engine.device

    @property
    def num_params(self) -> int:
        """Parameters of the whole model."""
        return self.engine.num_params

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token at the configured sequence length."""
        return self.engine.flops_per_token

    def _grad_accum_steps(self) -> int:
        return grad_accum_steps(self.config.training, self.parallel_dims.dp_world_size)

    def _log_start(self) -> None:
        cfg = self.config
        if cfg.job.print_config and self.dist_env.rank == 0:
            logger.info("config:\n%s", json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        d = self.parallel_dims
        logger.info(
            "%s %s: %.2fM params, %.1f MFLOPs/token | world %d on %s (dp_replicate %d, dp_shard %d, cp %d, tp %d, pp %d) | "
            "batch %d x %d tokens, %d accumulation step(s) | %d steps",
            cfg.model.name, cfg.model.flavor, self.num_params / 1e6, self.flops_per_token / 1e6,
            self.dist_env.world_size, self.device, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp,
            cfg.training.local_batch_size, cfg.training.seq_len, self.grad_accum_steps, cfg.training.steps,
        )  # fmt: skip

    # ---- the step -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by a checkpoint resume)."""
        return self.engine.step

    def train_step(self, microbatches: list[dict[str, torch.Tensor]], *, sync: bool = True) -> StepResult:
        """One optimizer step over ``microbatches`` (gradient accumulation): the loss of every
        microbatch is divided by the valid label tokens of the whole global batch.

        ``sync=False`` (steps that neither log nor save) never waits for the device: the loss
        and the gradient norm are checked for NaN/inf on the device and reported by the next
        step that syncs (see ``TrainingEngine.optimizer_step``), before it computes anything."""
        if sync:
            self.engine.raise_if_non_finite()
        local_tokens = torch.stack([count_valid_tokens(mb["labels"]) for mb in microbatches]).sum().float()
        local_tokens = local_tokens.to(self.engine.device)
        global_tokens = self.engine.sum_over(local_tokens.clone(), "dp")
        rank_loss = torch.zeros((), device=self.engine.device)
        for mb in microbatches:
            rank_loss += self.engine.forward_backward(mb, self._loss_fn, global_token_count=global_tokens)
        if sync:  # otherwise a non-finite loss shows in the global grad norm, checked on device
            self._check_finite(float(rank_loss))
        lr = self.engine.lr_schedulers.last_lr()
        grad_norm = self.engine.optimizer_step(sync=sync)
        return StepResult(rank_loss=rank_loss, rank_tokens=local_tokens, tokens=global_tokens, grad_norm=grad_norm, lr=lr)

    def global_loss(self, result: StepResult) -> tuple[float, float]:
        """(mean, max over data-parallel ranks) of a step's loss. Collective: every rank calls
        it on the same steps."""
        rank_loss = result.rank_loss
        if self.parallel_dims.pp_enabled:
            rank_loss = self.engine.sum_over(rank_loss.clone(), "pp")  # only the last stage computed it
        # Context-parallel peers each hold part of a sequence's loss: their sum is the rank's.
        mean = float(self.engine.sum_over(rank_loss.clone(), "dp_cp"))
        rank_mean = self.engine.sum_over(rank_loss.clone(), "cp") * result.tokens / result.rank_tokens.clamp(min=1)
        return mean, float(reduce_max(rank_mean, self.parallel_dims.mesh("dp_cp")))

    def _check_finite(self, rank_loss: float) -> None:
        """Stop before the optimizer step on a non-finite loss on this rank (the engine's
        global grad norm catches every other rank's)."""
        if math.isfinite(rank_loss):
            return
        self.engine.zero_grad()
        raise NonFiniteLossError(
            f"step {self.step + 1}: loss {rank_loss} — training stopped before the optimizer step, so the "
            "weights are still finite. Try a lower --optimizer.lr, a longer --lr_scheduler.warmup_steps, "
            "or clipping with --training.max_norm."
        )

    # ---- the loop -----------------------------------------------------------------------

    def save_seed_checkpoint(self) -> str:
        """Write the freshly initialized weights as step 0 (``--checkpoint.create_seed_checkpoint``)."""
        path = self.checkpointer.save_seed_checkpoint()
        logger.info("seed checkpoint written to %s", path)
        return path

    def train(self) -> list[dict[str, Any]]:
        """Resume from a checkpoint when there is one, run until ``--training.steps`` (or a
        SIGTERM/SIGINT: the step finishes and a checkpoint is saved), and return the records
        that were logged."""
        if self.config.checkpoint.create_seed_checkpoint:
            self.save_seed_checkpoint()
            return []
        self._save_config()
        if self.engine.load_checkpoint():
            logger.info("resumed from step %d (%d tokens seen)", self.step, self.train_state.tokens_seen)
        guard = PreemptionGuard(self.engine.device)
        try:
            records, preempted = self._loop(guard)
        finally:
            guard.close()
        self.metrics.close()
        self._log_summary(records, preempted)
        return records

    def _loop(self, guard: PreemptionGuard) -> tuple[list[dict[str, Any]], bool]:
        """The steps; returns (logged records, whether a signal stopped the run early)."""
        records: list[dict[str, Any]] = []
        data_iter = iter(self.dataloader)
        self._run_start = (time.perf_counter(), self.step, self.train_state.tokens_seen)
        self.metrics.start(self.step)
        with self._profiler() as profiler:
            return self._steps(guard, profiler, data_iter, records)

    def _profiler(self) -> StepProfiler:
        """Traces (and memory reports) every ``--profiler.profile_freq`` steps when enabled."""
        return StepProfiler(self.config.profiler, dump_folder=self.config.job.dump_folder,
                            rank=self.engine.dist_env.rank, device=self.engine.device, start_step=self.step)

    def _steps(self, guard: PreemptionGuard, profiler: StepProfiler, data_iter,
               records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """Train until ``--training.steps`` or an agreed preemption request."""
        total = self.config.training.steps
        self._unsynced_tokens = torch.zeros((), device=self.engine.device)
        while self.step < total:
            waiting = time.perf_counter()
            microbatches = [next(data_iter) for _ in range(self.grad_accum_steps)]
            data_wait = time.perf_counter() - waiting
            sync = self._syncs(self.step + 1)
            started = time.perf_counter()
            result = self.train_step(microbatches, sync=sync)
            if self.config.compile.enable and self.step == self._run_start[1] + 1:
                logger.info("first step: %.1f s, compiling included (%s)", time.perf_counter() - started,
                            f"--compile.granularity {self.config.compile.granularity}")
            profiler.step()
            self._unsynced_tokens += result.tokens
            if sync:
                self._sync_host()
            # Per-device throughput: the data-parallel rank's tokens are shared by its cp x tp x pp
            # devices, so each device's share is what MFU compares with one device's peak.
            batch_tokens = sum(mb["input_ids"].numel() for mb in microbatches)
            self.metrics.record_tokens(batch_tokens // self.parallel_dims.non_data_parallel_size, data_wait_s=data_wait)
            last = self.step == total
            validation = self.validator.run() if self.validator.due(self.step, last_step=last) else {}
            if validation or self.metrics.should_log(self.step):
                records.append(self._log(result, validation))
            self.engine.maybe_save(last_step=last)
            if not last and guard.requested():
                self._stop_for_preemption()
                return records, True
        return records, False

    def _syncs(self, step: int) -> bool:
        """Whether optimizer step ``step`` reads device values on the host: when it logs,
        validates or saves, and at the last step; every other step runs ahead of the device."""
        last = step == self.config.training.steps
        return (last or self.metrics.should_log(step) or self.validator.due(step, last_step=last)
                or self.engine.checkpointer.save_due(step, last_step=last))

    def _sync_host(self) -> None:
        """Read what the unsynced steps left on the device: raise on a non-finite step, add
        their tokens to ``tokens_seen``."""
        self.engine.raise_if_non_finite()
        self.train_state.tokens_seen += int(self._unsynced_tokens)
        self._unsynced_tokens.zero_()

    def _stop_for_preemption(self) -> None:
        """Save the step just finished so the same command resumes from it."""
        self._sync_host()
        save_for_preemption(self.engine.checkpointer, self.step)

    def _save_config(self) -> None:
        save_run_config(self.config, rank=self.engine.dist_env.rank)

    def _log_summary(self, records: list[dict[str, Any]], preempted: bool) -> None:
        """One closing line: steps, tokens, wall time, mean throughput, best and last loss,
        where the checkpoints are."""
        started, first_step, first_tokens = getattr(self, "_run_start", (time.perf_counter(), self.step, 0))
        wall = time.perf_counter() - started
        tokens = self.train_state.tokens_seen - first_tokens
        losses = [r["loss"] for r in records if "loss" in r]
        best = f"{min(losses):.4f}" if losses else "n/a"
        last = f"{losses[-1]:.4f}" if losses else "n/a"
        where = self.engine.checkpointer.folder if self.config.checkpoint.enable else "off"
        logger.info(
            "%s: steps %d-%d, %d tokens in %.1fs (%.0f tokens/s over all ranks) | loss best %s, last %s | "
            "checkpoints: %s",
            "preempted" if preempted else "training done", first_step, self.step, tokens, wall,
            tokens / wall if wall > 0 else 0.0, best, last, where,
        )

    def _log(self, result: StepResult, validation: dict[str, float] | None = None) -> dict[str, Any]:
        loss, loss_max = self.global_loss(result)
        return self.metrics.log(
            step=self.step,
            loss=loss,
            grad_norm=float(result.grad_norm),
            lr=result.lr,
            extra={
                "loss_max": loss_max,
                "tokens_seen": self.train_state.tokens_seen,
                **(validation or {}),
                **self.log_extras(),
            },
        )

    def log_extras(self) -> dict[str, Any]:
        """Loop-specific fields of each logged record: the model's own figures when it reports
        any (an ``expert_load()`` method, e.g. MoE per-layer load and imbalance)."""
        extras: dict[str, Any] = {}
        for part in self.model_parts:
            if isinstance(part, ReportsExpertLoad):
                extras.update(part.expert_load())
        return extras

    def close(self) -> None:
        """Drain checkpoint saves, close the progress bar and release the process group."""
        self.metrics.close()
        self.engine.close()
