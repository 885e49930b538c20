"""The base every training loop extends: pretraining, SFT and RL post-training.

What a loop shares lives here once, so the loops cannot drift apart:

- **the model it builds**: the flavor check, the tokenizer, the vocabulary
  (``ModelConfig.resolve_vocab_size``: ``--model.vocab_size`` or the tokenizer's, rounded) and
  the ``--model.*`` shape overrides, handed to one :class:`~titan.train.engine.TrainingEngine`;
- **the supervised step** (:meth:`TrainingLoop.train_step`): gradient accumulation to
  ``--training.global_batch_size``, the loss of each microbatch divided by the valid label
  tokens of the whole global batch, then one optimizer step — pretraining's step, SFT's, and
  RL's SFT warm-up;
- **metrics**: one :class:`~titan.train.metrics.MetricsLogger` per loop; step records through
  :meth:`TrainingLoop.log_step`, any other record (an evaluation) through
  :meth:`TrainingLoop.log_record`; both reach every backend (JSONL, TensorBoard, W&B);
- **the run around the steps** (:meth:`TrainingLoop.train`): ``--checkpoint.create_seed_checkpoint``,
  the saved ``config.json``, resuming, the preemption guard (a SIGTERM finishes the step and
  saves), the profiler, the closing summary; :meth:`TrainingLoop.close` drains checkpoints.

A loop adds only its data and what one of its steps is (:meth:`TrainingLoop.run_steps`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from titan.dist import HangWatchdog, reduce_max
from titan.train.config import TrainingConfig
from titan.train.device_peak import device_peak_flops
from titan.train.engine import TrainingEngine
from titan.train.gc_control import GarbageCollection
from titan.train.loss import NonFiniteLossError, count_valid_tokens, supervised_loss
from titan.train.metrics import MetricsLogger
from titan.train.model_spec import ModelSpec
from titan.train.preemption import PreemptionGuard, save_for_preemption
from titan.train.profiling import StepProfiler
from titan.train.run_lock import lock_run_folder

logger = logging.getLogger("titan")


@dataclass
class StepResult:
    """What one optimizer step produced. The loss stays this rank's share until a logging
    step reduces it (see ``TrainingLoop.global_loss``): no collective on steps nobody logs, and
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
    rank_aux_loss: torch.Tensor | None = None
    """This rank's share of the part of ``rank_loss`` that is auxiliary (an MoE router's
    balancing loss; ``TrainingEngine.aux_loss_share``); None when it had none."""


def save_run_config(config: Any, *, rank: int) -> str | None:
    """The resolved config as ``<dump_folder>/config.json`` (rank 0), so a run folder says
    how it was made (every loop writes it: train, SFT, RL); returns the config.json it
    replaced (None: none, or not rank 0), which belongs with an earlier run's records."""
    if rank != 0:
        return None
    folder = Path(config.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    replaced = path.read_text() if path.is_file() else None
    record = {"type": type(config).__name__, **dataclasses.asdict(config)}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return replaced


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


class TrainingLoop:
    """The shell around :class:`~titan.train.engine.TrainingEngine` that every loop shares
    (see the module docstring). Subclasses set ``Config``, may check their flags in
    :meth:`check_config` (before anything is built), build their data after ``__init__`` and
    implement :meth:`run_steps`."""

    Config: type = object
    """The config class of this loop (its command's flags)."""
    uses_training_timeout: bool = True
    """Whether collectives switch to ``--comm.train_timeout_seconds`` after the first step."""
    trains_score_head: bool = False
    """Whether the loop trains a sequence-classification model (a score head, ``num_labels``)
    rather than a language model (``titan reward``)."""

    def __init__(self, config: Any, *, model_spec: ModelSpec) -> None:
        self.config = config
        self.model_spec = model_spec
        model_spec.check_flavor(config.model.flavor)
        self.check_config()
        # Before anything is written: a second run in the same folder stops here.
        self._folder_lock = lock_run_folder(config.job.dump_folder, rank=int(os.environ.get("RANK", "0") or 0))
        try:
            self._build(config, model_spec)
        except BaseException:
            self._folder_lock.release()
            raise

    def _build(self, config: Any, model_spec: ModelSpec) -> None:
        """The tokenizer, the engine (model, parallelism, optimizer, checkpoints) and metrics."""
        self.tokenizer = config.tokenizer.build()
        self.vocab_size = config.model.resolve_vocab_size(self.tokenizer.vocab_size)
        self.engine = TrainingEngine.from_config(config, model_spec=model_spec, vocab_size=self.vocab_size,
                                                 tokenizer=self.tokenizer)
        if self.engine.num_labels and not self.trains_score_head:
            self.engine.close()
            raise ValueError(f"the model is a sequence classifier ({self.engine.num_labels}-score head, e.g. a reward "
                             "model from a ...ForSequenceClassification checkpoint), and this command trains language "
                             "models: start from a language model, or train the classifier with titan reward")
        self._training_timeout_on = False
        # Every thread's stack on stderr when a step outlives the collective timeout (a rank
        # that hangs outside a collective shows where).
        self._watchdog = HangWatchdog(self.engine.comm.init_timeout_seconds)
        self.is_rank0 = self.engine.dist_env.rank == 0
        self.grad_accum_steps = grad_accum_steps(config.training, self.parallel_dims.dp_world_size)
        # Every step's manifest records them; a resume compares (_report_changes_since_checkpoint).
        batch = self.batch_facts()
        self.engine.checkpointer.run_facts = {"trainer": type(self).__name__, "seed": config.debug.seed,
                                              **({"batch": batch} if batch else {})}
        self._supervised_loss = supervised_loss(chunk_tokens=config.training.loss_chunk_tokens,
                                                compiled=config.compile.compiles_loss,
                                                loss_type=config.training.loss_type)
        self.metrics = MetricsLogger(
            config.metrics,
            dump_folder=Path(config.job.dump_folder),
            total_steps=config.training.steps,
            flops_per_token=self.engine.flops_per_token,
            peak_flops=device_peak_flops(self.engine.device, self.engine.compute_dtype),
            device=self.engine.device,
            compute_dtype=self.engine.compute_dtype,
            is_rank0=self.is_rank0,
        )
        self._run_start = (time.perf_counter(), 0, 0)

    @property
    def data_shard(self) -> tuple[int, int]:
        """(rank, world size) of this rank's share of the data: its data-parallel rank, among
        every replica group's ranks with ``--fault_tolerance.enable``."""
        dims = self.parallel_dims
        fault_tolerance = getattr(self.config, "fault_tolerance", None)
        if fault_tolerance is None:
            return dims.dp_rank, dims.dp_world_size
        return fault_tolerance.data_shard(dims.dp_rank, dims.dp_world_size)

    def check_config(self) -> None:
        """Refuse flags this loop cannot honour, before the engine is built (raises
        ValueError naming the flag). The base checks nothing beyond the flavor."""

    def batch_facts(self) -> dict[str, int] | None:
        """This run's optimizer batch as its checkpoints record it, for a resume to compare
        (:meth:`_report_changes_since_checkpoint`): rows (pairs, for DPO) per optimizer step (``global_batch_size``)
        and how they are made up. None where the batch does not follow ``--training.*``'s
        batch flags (RL's comes from its rollouts)."""
        training, dp = self.config.training, self.parallel_dims.dp_world_size
        return {"global_batch_size": training.local_batch_size * dp * self.grad_accum_steps,
                "local_batch_size": training.local_batch_size, "data_parallel_degree": dp,
                "gradient_accumulation_steps": self.grad_accum_steps, "seq_len": training.seq_len}

    def _report_changes_since_checkpoint(self) -> None:
        """Check what a resumed run's flags change against the run that saved its step: another
        seed is refused (`_check_seed`), another batch reported (`_report_batch_change`)."""
        self._check_seed()
        self._report_batch_change()

    def _set_aside_earlier_profiles(self, aside: Path | None) -> Path | None:
        """On rank 0 of a run that starts afresh: move the profiler traces and memory
        snapshots an earlier run left in the dump folder (``--profiling.save_traces_folder``,
        ``--profiling.save_memory_snapshot_folder``) beside its metrics in ``aside`` (or the
        next ``earlier_runs/<n>/``), so that this run's iterations do not overwrite or mix
        with that run's. Folders outside the dump folder are left where they are. The other
        ranks write their traces only after the first steps, which wait for this rank."""
        dump = Path(self.config.job.dump_folder)
        profiling = self.config.profiling
        found = []
        for name in (profiling.save_traces_folder, profiling.save_memory_snapshot_folder):
            folder = dump / name
            if not Path(name).is_absolute() and ".." not in Path(name).parts and folder.is_dir() and any(folder.iterdir()):
                found.append(folder)
        if not found:
            return aside
        if aside is None or any((aside / folder.relative_to(dump)).exists() for folder in found):
            n = 1
            while (dump / "earlier_runs" / str(n)).exists():
                n += 1
            aside = dump / "earlier_runs" / str(n)
        for folder in found:
            target = aside / folder.relative_to(dump)
            target.parent.mkdir(parents=True, exist_ok=True)
            folder.rename(target)
        logger.info("%s held an earlier run's profiles (%s) and this run starts afresh: moved them to %s", dump,
                    ", ".join(str(folder.relative_to(dump)) for folder in found), aside)
        return aside

    def _report_nothing_left(self) -> None:
        """Say so when the resumed step already reaches ``--training.steps``: the run trains
        nothing (its summary line alone would read as a run that did)."""
        steps = self.config.training.steps
        if not self.is_rank0:
            return
        if self.step == steps:
            logger.info("this run is complete: step %d (--training.steps) is saved; nothing to train (raise "
                        "--training.steps to train on)", self.step)
        elif self.step > steps:
            logger.warning("the checkpoint's step %d is past --training.steps %d: nothing to train; raise "
                           "--training.steps to train on, or pick an earlier step with --checkpoint.load_step",
                           self.step, steps)

    def _check_seed(self) -> None:
        """Refuse another ``--debug.seed`` than the saved run's. A resume restores that run's
        random states and data order, while what is drawn from the flag afresh (held-out
        batches, RL's prompt and generation draws, GKD's on-policy draws) would follow the new
        one: neither that run continued nor a run of the new seed."""
        saved = (self.engine.checkpointer.loaded_run_facts or {}).get("seed")
        if saved is None or saved == self.config.debug.seed:
            return
        raise ValueError(f"--debug.seed {self.config.debug.seed} is not the seed of the run this one resumes "
                         f"({saved}, step {self.step} in {self.engine.checkpointer.folder}): a resume continues that "
                         f"run, its random states and data order included; resume with --debug.seed {saved}, or train "
                         "with another seed as a new run (another --job.dump_folder, or --checkpoint.folder)")

    def _report_batch_change(self) -> None:
        """Say so when a resumed run's optimizer batch differs from the one its checkpoint was
        trained with. With ``--training.global_batch_size -1`` the batch follows the
        data-parallel degree, so resuming on another number of ranks changes it without a
        flag saying so (a warning, with the flag that keeps it); a batch set explicitly is
        only noted. Checkpoints written before titan recorded the batch say nothing."""
        saved = (self.engine.checkpointer.loaded_run_facts or {}).get("batch")
        mine = self.batch_facts()
        if (not self.is_rank0 or not isinstance(saved, dict) or mine is None
                or saved.get("global_batch_size") == mine["global_batch_size"]):
            return

        def shape(facts: dict[str, Any]) -> str:
            return (f"{facts.get('global_batch_size')} (local batch {facts.get('local_batch_size')} x "
                    f"data-parallel {facts.get('data_parallel_degree')} x {facts.get('gradient_accumulation_steps')} "
                    "accumulated)")

        was, now = saved["global_batch_size"], mine["global_batch_size"]
        change = (f"step {self.step} was trained with a global batch of {shape(saved)}; this run's is {shape(mine)}: "
                  f"each optimizer step now takes {now / was:.3g}x the batch, while the learning-rate schedule "
                  "and --training.steps count steps")
        if self.config.training.global_batch_size != -1:
            logger.info("%s (--training.global_batch_size %d)", change, now)
            return
        per_step = mine["local_batch_size"] * mine["data_parallel_degree"]
        keep = (f"--training.global_batch_size {was}" if was % per_step == 0 else
                f"--training.global_batch_size {was} with a --training.local_batch_size that divides it by the "
                f"data-parallel degree {mine['data_parallel_degree']}")
        logger.warning("%s. --training.global_batch_size -1 follows the local batch and the data-parallel degree; "
                       "to keep the checkpoint's batch pass %s (gradient accumulation makes up the rest)", change, keep)

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

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by a checkpoint resume)."""
        return self.engine.step

    def log_start(self) -> None:
        """The opening lines: the run's ``--job.description`` when set, then model, size,
        layout, batch geometry (and the config when ``--job.print_config``)."""
        cfg = self.config
        if cfg.job.description:
            logger.info("job: %s", cfg.job.description)
        if cfg.job.print_config and self.is_rank0:
            logger.info("config:\n%s", json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        d = self.parallel_dims
        logger.info(
            "%s %s: %.2fM params, %.1f MFLOPs/token | world %d on %s (dp_replicate %d, dp_shard %d, cp %d, tp %d, pp %d%s) | "
            "batch %d x %d tokens, %d accumulation step(s) | %d steps",
            cfg.model.name, cfg.model.flavor, self.num_params / 1e6, self.flops_per_token / 1e6,
            self.dist_env.world_size, self.device, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp,
            f", ep {d.ep}" if d.ep_enabled else "",
            cfg.training.local_batch_size, cfg.training.seq_len, self.grad_accum_steps, cfg.training.steps,
        )  # fmt: skip

    # ---- the supervised step ------------------------------------------------------------

    def next_microbatches(self, data_iter) -> list[dict[str, torch.Tensor]]:
        """The ``grad_accum_steps`` microbatches of one optimizer step on this rank."""
        return [next(data_iter) for _ in range(self.grad_accum_steps)]

    def train_step(self, microbatches: list[dict[str, torch.Tensor]], *, sync: bool = True) -> StepResult:
        """One optimizer step over ``microbatches`` (gradient accumulation): the loss of every
        microbatch is divided by the valid label tokens of the whole global batch.

        ``sync=False`` (steps that neither log nor save) never waits for the device: the loss
        and the gradient norm are checked for NaN/inf on the device and reported by the next
        step that syncs (see ``TrainingEngine.optimizer_step``), before it computes anything."""
        if sync:
            self.engine.raise_if_non_finite()
        self._watchdog.seconds = self._collective_timeout_s()
        self._watchdog.step_started()
        result = self._train_step(microbatches, sync=sync)
        self._watchdog.stop()
        if self.uses_training_timeout and not self._training_timeout_on:
            self.engine.use_training_timeout()  # the set-up and the first step are done
            self._training_timeout_on = True
        return result

    def _timeout_flag(self) -> str:
        """The flag whose timeout the collectives run under now."""
        on = self._training_timeout_on
        return f"--comm.{'train' if on else 'init'}_timeout_seconds {self._collective_timeout_s():g}"

    def _collective_timeout_s(self) -> float:
        comm = self.engine.comm
        return comm.train_timeout_seconds if self._training_timeout_on else comm.init_timeout_seconds

    def _train_step(self, microbatches: list[dict[str, torch.Tensor]], *, sync: bool) -> StepResult:
        self.engine.start_step()
        # Counted on the device: a host count copied over would make the host wait for the
        # queued steps (a copy from pageable memory), a sync on every step.
        microbatches = [self.engine.to_device(mb) for mb in microbatches]
        local_tokens = torch.stack([count_valid_tokens(mb["labels"]) for mb in microbatches]).sum().float()
        global_tokens = self.engine.sum_over(local_tokens.clone(), "dp")
        rank_loss = torch.zeros((), device=self.engine.device)
        for i, mb in enumerate(microbatches):
            rank_loss += self.engine.forward_backward(self.before_forward(mb), self._supervised_loss,
                                                      global_token_count=global_tokens,
                                                      last_microbatch=i == len(microbatches) - 1)
        if sync:  # otherwise a non-finite loss shows in the global grad norm, checked on device
            self._check_finite(float(rank_loss))
        lr = self.engine.lr_schedulers.last_lr()
        grad_norm = self.engine.optimizer_step(sync=sync)
        return StepResult(rank_loss=rank_loss, rank_tokens=local_tokens, tokens=global_tokens, grad_norm=grad_norm, lr=lr,
                          rank_aux_loss=self.engine.aux_loss_share())

    def before_forward(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the loss of ``microbatch`` needs besides the model's logits, added just before
        its forward (one microbatch at a time: e.g. a teacher's logits); the base adds nothing."""
        return microbatch

    def device_tokens(self, microbatches: list[dict[str, torch.Tensor]]) -> int:
        """This device's share of the tokens of ``microbatches``: a data-parallel rank's tokens
        are shared by its cp x tp x pp devices, so each device's share is what MFU compares
        with one device's peak."""
        return sum(mb["input_ids"].numel() for mb in microbatches) // self.parallel_dims.non_data_parallel_size

    def global_loss(self, result: StepResult) -> tuple[float, float]:
        """(mean, max over data-parallel ranks) of a step's loss. Collective: every rank calls
        it on the same steps."""
        rank_loss = result.rank_loss
        if self.parallel_dims.pp_enabled:
            rank_loss = self.engine.sum_over(rank_loss.clone(), "pp")  # only the last stage computed it
        # Context-parallel peers each hold part of a sequence's loss: their sum is the rank's.
        mean = float(self.engine.sum_over(rank_loss.clone(), "dp_cp"))
        rank_count, global_count = self.loss_counts(result)
        rank_mean = self.engine.sum_over(rank_loss.clone(), "cp") * global_count / rank_count.clamp(min=1)
        return mean, float(reduce_max(rank_mean, self.parallel_dims.mesh("dp_cp")))

    def loss_counts(self, result: StepResult) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's, the global batch's) count of what the step's loss is a mean over: its
        label tokens (a loop whose loss is a mean over something else, DPO's pairs, says so)."""
        return result.rank_tokens, result.tokens

    def global_aux_loss(self, result: StepResult) -> float:
        """The part of the step's global loss that is auxiliary (summed as the loss is).
        Collective: every rank calls it on the same steps."""
        share = result.rank_aux_loss if result.rank_aux_loss is not None else torch.zeros((), device=self.engine.device)
        if self.parallel_dims.pp_enabled:
            share = self.engine.sum_over(share.clone(), "pp")  # each stage counts its own layers'
        return float(self.engine.sum_over(share.clone(), "dp_cp"))

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

    # ---- metrics ------------------------------------------------------------------------

    def log_step(self, step: int, *, loss: float, grad_norm: float, lr: float, extra: dict[str, Any]) -> dict[str, Any]:
        """Log one step's record (console, JSONL, TensorBoard, W&B); returns it."""
        return self.metrics.log(step=step, loss=loss, grad_norm=grad_norm, lr=lr, extra=extra)

    def log_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Log any other record with a ``step`` (an evaluation) to every backend; returns it."""
        self.metrics.log_record(record)  # only the writing ranks write
        return record

    # ---- the run ------------------------------------------------------------------------

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
        finished = self.engine.checkpointer.load_finished_run(self.config.training.steps)
        if finished is not None:  # before anything is written: the folder stays the finished run's
            logger.info("this run is complete: its last step (%d, --training.steps) is saved in %s; nothing to "
                        "train (raise --training.steps to train on from the step before it)", finished,
                        self.engine.checkpointer.folder)
            self.metrics.close()
            return []
        resumed = self.engine.load_checkpoint() is not None  # step 0 too: a seed checkpoint, an initial load
        continues = resumed and bool(self.step or self.progressed_before_step_1())
        if continues:
            logger.info("resumed from step %d (%s)", self.step, self.resume_position())
            self._report_changes_since_checkpoint()
            self._report_nothing_left()
        elif resumed:  # an initial load or a seed checkpoint: weights, no progress yet
            logger.info("training starts at step 0 from the loaded weights")
        # Once the checkpoint is loaded and accepted: a run refused there leaves the folder's
        # config.json (the run it would have resumed) as it was.
        replaced_config = save_run_config(self.config, rank=self.dist_env.rank)
        self._report_restart(resumed)
        records: list[dict[str, Any]] = []
        self._run_start = (time.perf_counter(), self.step, self.train_state.tokens_seen)
        # A run that starts afresh sets an earlier run's metrics aside, with its config.
        aside = self.metrics.start(self.step, continues=continues)
        if not continues and self.is_rank0:
            aside = self._set_aside_earlier_profiles(aside)
        if aside is not None and replaced_config is not None:
            (aside / "config.json").write_text(replaced_config)
        guard = PreemptionGuard(self.engine.device)
        training = self.config.training
        collector = GarbageCollection(training.gc_freq, debug=training.gc_debug, rank=self.dist_env.rank)
        self.engine.step_callbacks.append(collector.after_step)
        try:
            with self._profiler() as profiler, collector:
                preempted = self.run_steps(guard, profiler, records)
        except RuntimeError as err:
            timeout = self.engine.timeout_error(err, self._timeout_flag())
            if timeout is None:
                raise
            raise timeout from err
        finally:
            self.engine.step_callbacks.remove(collector.after_step)
            self._watchdog.stop()
            guard.close()
        self.after_steps()
        self.metrics.close()
        self.log_summary(records, preempted)
        return records

    def _report_restart(self, resumed: bool) -> None:
        """Say when the launcher restarted this job (``torchrun --max-restarts``, which sets
        ``TORCHELASTIC_RESTART_COUNT``): from which step, or that nothing could be resumed."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if not restart or not self.is_rank0:
            return
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        if resumed:
            logger.warning("restart %d of at most %s: a rank of the previous attempt failed; continuing from "
                           "step %d", restart, limit, self.step)
        else:
            logger.warning("restart %d of at most %s: a rank of the previous attempt failed and there is no "
                           "checkpoint to resume (--checkpoint.enable): training starts again from step 0",
                           restart, limit)

    def resume_position(self) -> str:
        """Where a resumed run continues, for the log (the loops add their data position)."""
        return f"{self.train_state.tokens_seen} tokens seen"

    def progressed_before_step_1(self) -> bool:
        """Whether the loaded checkpoint of step 0 holds progress of a preempted run (work a
        loop does before its first optimizer step), not just weights to start from."""
        return False

    def run_steps(self, guard: PreemptionGuard, profiler: StepProfiler, records: list[dict[str, Any]]) -> bool:
        """The loop's steps until ``--training.steps`` or an agreed preemption request (then
        :meth:`stop_for_preemption`); appends the logged records; returns whether a signal
        stopped the run."""
        raise NotImplementedError

    def after_steps(self) -> None:
        """Settle what the steps left running (e.g. a background generation) before the
        summary."""

    def stop_for_preemption(self) -> None:
        """Save the step just finished so the same command resumes from it."""
        save_for_preemption(self.engine.checkpointer, self.step)

    def _profiler(self) -> StepProfiler:
        """Traces (and memory reports) every ``--profiling.profile_freq`` steps when enabled."""
        return StepProfiler(self.config.profiling, dump_folder=self.config.job.dump_folder,
                            rank=self.engine.dist_env.rank, device=self.engine.device, start_step=self.step)

    def log_summary(self, records: list[dict[str, Any]], preempted: bool) -> None:
        """One closing line: steps, tokens, wall time, mean throughput, best and last loss,
        where the checkpoints are."""
        started, first_step, first_tokens = self._run_start
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

    def close(self) -> None:
        """Drain checkpoint saves, close the progress bar, release the process group and the
        dump folder."""
        try:
            self.metrics.close()
            self.engine.close()
        finally:
            self._folder_lock.release()
