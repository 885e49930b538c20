"""Pretraining: the packed-corpus loop on :class:`~titan.train.loop.TrainingLoop`.

The life of one step is in docs/design.md: microbatches -> forward -> loss normalized by the global
valid-token count -> backward -> mesh-wide clip -> optimizer step -> LR step -> metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from titan.train.config import TrainerConfig
from titan.train.data import build_dataloader, validate_data_config
from titan.train.loop import StepResult, TrainingLoop
from titan.train.model_spec import HasAuxLoss, ModelSpec, ReportsExpertLoad
from titan.train.preemption import PreemptionGuard
from titan.train.profiling import StepProfiler
from titan.train.straggler import StragglerWatch
from titan.train.validation import Validator

logger = logging.getLogger("titan")


class Trainer(TrainingLoop):
    """Pretraining: :class:`~titan.train.loop.TrainingLoop` over the packed corpus.

    Adds the tokenizer's packed data loader (checkpointed) and validation to the shared loop;
    :meth:`train` runs the loop and returns the logged metric records; :meth:`close` drains
    checkpoints and releases the process group.
    """

    Config = TrainerConfig

    def __init__(self, config: TrainerConfig, *, model_spec: ModelSpec) -> None:
        super().__init__(config, model_spec=model_spec)
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
            compile_loss=config.compile.compiles_loss,
            seed=config.debug.seed + 1,  # another order than training's, even on the same corpus
            loader=self.validation_loader(),
        )
        self._unsynced_tokens = torch.zeros((), device=self.engine.device)
        # Every part of one model is the same class, so every rank answers alike (the logging
        # of the auxiliary loss is a collective).
        self._has_aux_loss = any(isinstance(part, HasAuxLoss) for part in self.model_parts)
        self.stragglers = StragglerWatch(config.metrics.straggler_factor)
        self._unrecorded_steps: list[tuple[float, float]] = []
        self.log_start()

    # ---- the data: what a loop on the same engine replaces -------------------------------

    def check_config(self) -> None:
        """Check the data flags before any work starts (raises ValueError naming the flag)."""
        validate_data_config(self.config.dataset, self.config.tokenizer)

    def validation_loader(self):
        """The held-out batches ``--validation.enable`` scores, as a function of the loader
        arguments (``Validator``'s ``loader``); None: the ``--validation.dataset`` corpus."""
        return None

    def build_dataloader(self):
        """This data-parallel rank's resumable loader of ``{"input_ids", "labels", ...}``
        microbatches: the packed pretraining corpus."""
        cfg = self.config
        dp_rank, dp_world_size = self.data_shard
        return build_dataloader(
            cfg.dataset,
            self.tokenizer,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            local_batch_size=cfg.training.local_batch_size,
            seq_len=cfg.training.seq_len,
            seed=cfg.debug.seed,
        )

    # ---- the loop -----------------------------------------------------------------------

    def run_steps(self, guard: PreemptionGuard, profiler: StepProfiler, records: list[dict[str, Any]]) -> bool:
        """Train until ``--training.steps`` or an agreed preemption request."""
        total = self.config.training.steps
        data_iter = iter(self.dataloader)
        self._unsynced_tokens.zero_()
        while self.step < total:
            waiting = time.perf_counter()
            microbatches = self.next_microbatches(data_iter)
            data_wait = time.perf_counter() - waiting
            sync = self._syncs(self.step + 1)
            started = time.perf_counter()
            result = self.train_step(microbatches, sync=sync)
            if self.config.compile.enable and self.step == self._run_start[1] + 1:
                compiled = self.config.compile
                logger.info("first step: %.1f s, compiling included (%s)", time.perf_counter() - started,
                            " and ".join((f"the model, --compile.granularity {compiled.granularity}"
                                          if component == "model" else "the loss") for component in compiled.components))
            profiler.step()
            self._unsynced_tokens += result.tokens
            if sync:
                self._sync_host()
            self._record_step_time(time.perf_counter() - waiting, data_wait, synced=sync)
            self.metrics.record_tokens(self.device_tokens(microbatches), data_wait_s=data_wait)
            last = self.step == total
            validation = self.validator.run() if self.validator.due(self.step, last_step=last) else {}
            if validation or self.metrics.should_log(self.step):
                records.append(self._log(result, validation))
            self.engine.maybe_save(last_step=last)
            if not last and guard.requested():
                self.stop_for_preemption()
                return True
        return False

    def _record_step_time(self, seconds: float, data_wait: float, *, synced: bool) -> None:
        """Feed the straggler watch. On an accelerator the steps that do not sync only enqueue
        work, so their time is averaged into the next step that syncs."""
        self._unrecorded_steps.append((seconds, data_wait))
        if synced or self.engine.device.type == "cpu":
            count = len(self._unrecorded_steps)
            total, local = (sum(part) for part in zip(*self._unrecorded_steps, strict=True))
            self.stragglers.record(self.step, total / count, local / count)
            self._unrecorded_steps.clear()

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

    def stop_for_preemption(self) -> None:
        """Count the unsynced steps' tokens, then save the step just finished."""
        self._sync_host()
        super().stop_for_preemption()

    def _log(self, result: StepResult, validation: dict[str, float] | None = None) -> dict[str, Any]:
        loss, loss_max = self.global_loss(result)
        # The routers' balancing loss is part of `loss` (as transformers' reports it): shown
        # on its own too, for the models that have one.
        aux = {"aux_loss": self.global_aux_loss(result)} if self._has_aux_loss else {}
        env = self.engine.dist_env
        self.stragglers.check(env.rank, env.world_size, self.engine.device)
        record = self.log_step(
            self.step,
            loss=loss,
            grad_norm=float(result.grad_norm),
            lr=result.lr,
            extra={
                "loss_max": loss_max,
                **aux,
                "tokens_seen": self.train_state.tokens_seen,
                **(validation or {}),
                **self.log_extras(),
            },
        )
        line = self.validation_line(validation) if validation and self.is_rank0 else None
        if line:
            logger.info("step %d: %s", self.step, line)
        return record

    def validation_line(self, validation: dict[str, float]) -> str | None:
        """The console line of a validation pass's figures (the progress line shows the
        training loss only): the held-out loss, its perplexity and tokens, and any other
        figure the pass reports (e.g. GKD's ``validation_distill_loss``)."""
        line = (f"held-out loss {validation['validation_loss']:.4f}  perplexity "
                f"{validation['validation_perplexity']:.2f}  ({validation['validation_tokens']:,} tokens)")
        others = [f"  {key.removeprefix('validation_')} {value:.4f}" for key, value in validation.items()
                  if key not in ("validation_loss", "validation_perplexity", "validation_tokens")]
        return line + "".join(others)

    def log_extras(self) -> dict[str, Any]:
        """Loop-specific fields of each logged record: the model's own figures when it reports
        any (an ``expert_load()`` method, e.g. MoE per-layer load and imbalance)."""
        reporters = [part for part in self.model_parts if isinstance(part, ReportsExpertLoad)]
        if not reporters:
            return {}
        reports = [part.expert_load() for part in reporters]
        if self.parallel_dims.pp_enabled:  # each pipeline rank holds only its stages' layers
            reports = [report for rank_reports in self.engine.gather_over(reports, "pp") for report in rank_reports]
        return reporters[0].merge_expert_load(reports)
