"""The trainer: builds every component from a ``TrainerConfig`` and runs the training loop.

The life of one step is in DESIGN.md: microbatches -> forward -> loss normalized by the global
valid-token count -> backward -> mesh-wide clip -> optimizer step -> LR step -> metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from titan.ckpt import CheckpointManager, OptimizerWrapper, TrainState
from titan.dist import (
    ParallelDims,
    build_pipeline,
    clip_grad_norm_,
    destroy_distributed,
    init_distributed,
    loss_parallel_context,
    mixed_precision_policy,
    parallelize,
    reduce_max,
    shard_batch_for_context_parallel,
    validate_against_model,
)
from titan.train.config import TrainerConfig
from titan.train.data import build_dataloader, validate_data_config
from titan.train.device_peak import device_peak_flops
from titan.train.loss import NonFiniteLossError, count_valid_tokens, cross_entropy_sum
from titan.train.lr_scheduler import build_lr_scheduler
from titan.train.metrics import MetricsLogger
from titan.train.model_spec import ModelSpec
from titan.train.optimizer import build_optimizer
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titan")


@dataclass
class StepResult:
    """What one optimizer step produced. The loss stays this rank's share until a logging
    step reduces it (see ``Trainer.global_loss``): no collective on steps nobody logs."""

    rank_loss: torch.Tensor
    """This rank's share of the global mean loss (zero on pipeline stages without the loss)."""
    rank_tokens: torch.Tensor
    """Valid label tokens this rank's share was computed over."""
    tokens: int
    """Valid label tokens of the whole global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings only elsewhere, one compact format."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[titan %(asctime)s] %(message)s", datefmt="%H:%M:%S", force=True)


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed every RNG the run touches; optionally restrict to deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            # cuBLAS needs a fixed workspace to be deterministic.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def local_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a (replicated) DTensor, e.g. a loss under loss parallel."""
    return t.to_local() if isinstance(t, DTensor) else t


class LRSchedulers:
    """One LR scheduler per optimizer (one optimizer per pipeline part), stepped together and
    checkpointed as one: they all follow the same schedule."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        """Advance every scheduler by one optimizer step."""
        for scheduler in self.schedulers:
            scheduler.step()

    def last_lr(self) -> float:
        """The current LR of the first parameter group."""
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        """The shared schedule position."""
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every scheduler to the saved position."""
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)


class Trainer:
    """Trains one model family from a complete config.

    Build it with the config and the family's :class:`ModelSpec`; :meth:`train` runs the loop
    and returns the logged metric records; :meth:`close` drains checkpoints and releases the
    process group.
    """

    Config = TrainerConfig

    def __init__(self, config: TrainerConfig, *, model_spec: ModelSpec) -> None:
        self.config = config
        self.model_spec = model_spec
        model_spec.check_flavor(config.model.flavor)
        validate_data_config(config.dataset, config.tokenizer)
        self.dist_env = init_distributed()
        setup_logging(self.dist_env.rank)
        self.device = self.dist_env.device
        set_determinism(config.debug.seed, config.debug.deterministic, self.device)
        self.parallel_dims = ParallelDims.from_config(config.parallelism, world_size=self.dist_env.world_size)
        self.grad_accum_steps = self._grad_accum_steps()
        self.tokenizer = config.tokenizer.build()
        meta_model = self._build_meta_model()
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.dump_folder = Path(config.job.dump_folder)
        self.model_parts = self._parallelize(meta_model)
        self.optimizers = [build_optimizer(config.optimizer, [part], self.device.type) for part in self.model_parts]
        self.lr_schedulers = LRSchedulers(
            [build_lr_scheduler(config.lr_scheduler, opt, config.training.steps) for opt in self.optimizers]
        )
        self.dataloader = build_dataloader(
            config.dataset,
            self.tokenizer,
            dp_rank=self.parallel_dims.dp_rank,
            dp_world_size=self.parallel_dims.dp_world_size,
            local_batch_size=config.training.local_batch_size,
            seq_len=config.training.seq_len,
            seed=config.debug.seed,
        )
        self.train_state = TrainState()
        self.checkpointer = self._build_checkpointer(meta_model)
        self.metrics = MetricsLogger(
            config.metrics,
            dump_folder=self.dump_folder,
            total_steps=config.training.steps,
            flops_per_token=self.flops_per_token,
            peak_flops=device_peak_flops(self.device),
            device=self.device,
            is_rank0=self.dist_env.rank == 0,
        )
        self._log_start()

    # ---- construction -------------------------------------------------------------------

    def _grad_accum_steps(self) -> int:
        training = self.config.training
        per_step = training.local_batch_size * self.parallel_dims.dp_world_size
        global_batch = per_step if training.global_batch_size == -1 else training.global_batch_size
        if global_batch % per_step:
            raise ValueError(
                f"--training.global_batch_size {global_batch} must be a multiple of "
                f"--training.local_batch_size {training.local_batch_size} x data-parallel degree "
                f"{self.parallel_dims.dp_world_size} = {per_step}; e.g. use {max(1, global_batch // per_step) * per_step}"
            )
        return global_batch // per_step

    def _build_meta_model(self) -> nn.Module:
        """The whole model on the meta device, checked against the parallel degrees before
        any process group work."""
        cfg = self.config
        vocab_size = round_up(self.tokenizer.vocab_size, cfg.model.vocab_multiple_of)
        with torch.device("meta"):
            model = self.model_spec.build(cfg.model.flavor, vocab_size=vocab_size, max_seq_len=cfg.training.seq_len)
        validate_against_model(
            self.parallel_dims,
            model,
            seq_len=cfg.training.seq_len,
            global_batch_size=cfg.training.global_batch_size,
            local_batch_size=cfg.training.local_batch_size,
        )
        self.num_params = model.num_params()
        self.flops_per_token = model.flops_per_token(cfg.training.seq_len)
        return model

    def _parallelize(self, model: nn.Module) -> list[nn.Module]:
        """Apply the configured parallelisms, then materialize and initialize this rank's
        shards. Returns the model parts this rank holds (several under pipeline parallel)."""
        cfg = self.config
        mp_policy = mixed_precision_policy(cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce)
        common = dict(parallelism=cfg.parallelism, activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile)
        if self.parallel_dims.pp_enabled:
            self.pp_schedule, parts, self.pp_has_first, self.pp_has_last = build_pipeline(
                model,
                self.parallel_dims,
                **common,
                loss_fn=self._pipeline_loss,
                local_batch_size=cfg.training.local_batch_size,
                device=self.device,
                mp_policy=mp_policy,
                scale_grads=False,  # the loss is already normalized over the global batch
            )
        else:
            parts = [parallelize(model, self.parallel_dims, self.mesh, **common, mp_policy=mp_policy)]
        for part in parts:
            part.to_empty(device=self.device)
            # Values depend on the seed and each parameter's name only: every layout starts
            # from the weights a single process would create, each rank drawing its shards.
            with torch.no_grad():
                part.init_weights(buffer_device=self.device, seed=cfg.debug.seed)
            part.train()
        return parts

    def _build_checkpointer(self, meta_model: nn.Module) -> CheckpointManager:
        adapter = self.model_spec.adapter(meta_model) if self.model_spec.adapter else None
        return CheckpointManager(
            self.config.checkpoint,
            dump_folder=str(self.dump_folder),
            states={"lr_scheduler": self.lr_schedulers, "dataloader": self.dataloader, "train_state": self.train_state},
            model_parts=self.model_parts,
            optimizers=OptimizerWrapper(self.model_parts, self.optimizers),
            hf_adapter=adapter,
            # The loader's state is one global record, equal on every rank: every rank (TP/PP/CP
            # peers included) fetches grad_accum_steps global microbatches per step, so at a
            # step boundary all stand after the same global batch. Saved once (DCP keeps one
            # copy of identical entries), it resumes under any dp degree and TP/PP/CP layout.
            rank_local=("rng",),
        )

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
        return self.train_state.step

    def _sum_over(self, value: torch.Tensor, axis: str) -> torch.Tensor:
        """Sum a tensor over the ranks of mesh ``axis`` (no-op when the axis is trivial)."""
        mesh = self.parallel_dims.mesh(axis)
        if mesh is not None and mesh.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return value

    def _data_parallel_grad_scale(self) -> float:
        """FSDP/HSDP/DDP average gradients over the data-parallel and context-parallel ranks;
        our loss is each rank's share of a global sum, so undo the average."""
        mesh = self.parallel_dims.mesh("dp_cp")
        return float(mesh.size()) if mesh is not None else 1.0

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the global mean loss, scaled for gradient averaging."""
        return cross_entropy_sum(logits, labels) * self._loss_scale

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(output, labels)

    def _shard_for_context_parallel(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        inputs = mb["input_ids"].to(self.device, non_blocking=True)
        labels = mb["labels"].to(self.device, non_blocking=True)
        cp_mesh = self.parallel_dims.mesh("cp") if self.parallel_dims.cp_enabled else None
        return shard_batch_for_context_parallel(cp_mesh, inputs, labels)

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over ``microbatches`` (gradient accumulation)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        sharded = [self._shard_for_context_parallel(mb) for mb in microbatches]
        local_tokens = torch.stack([count_valid_tokens(labels) for _, labels, _ in sharded]).sum().float()
        global_tokens = self._sum_over(local_tokens.clone(), "dp_cp")
        grad_scale = self._data_parallel_grad_scale()
        self._loss_scale = grad_scale / global_tokens
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels, positions in sharded:
            loss_sum += self._forward_backward(inputs, labels, positions)
        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.config.training.max_norm,
            mesh=self.mesh,
        )
        # loss_sum holds this rank's share of the global mean (times grad_scale). A non-finite
        # loss on any rank makes the global grad norm non-finite, so every rank stops together.
        rank_loss = loss_sum / grad_scale
        self._check_finite(float(rank_loss), float(grad_norm))
        for opt in self.optimizers:
            opt.step()
        self.lr_schedulers.step()
        return StepResult(
            rank_loss=rank_loss, rank_tokens=local_tokens, tokens=int(global_tokens), grad_norm=float(grad_norm)
        )

    def global_loss(self, result: StepResult) -> tuple[float, float]:
        """(mean, max over data-parallel ranks) of a step's loss. Collective: every rank calls
        it on the same steps."""
        rank_loss = result.rank_loss
        if self.parallel_dims.pp_enabled:
            rank_loss = self._sum_over(rank_loss.clone(), "pp")  # only the last stage computed it
        mean = float(self._sum_over(rank_loss.clone(), "dp_cp"))
        rank_mean = rank_loss * result.tokens / result.rank_tokens.clamp(min=1)
        return mean, float(reduce_max(rank_mean, self.parallel_dims.mesh("dp_cp")))

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision where FSDP2's policy does not reach (one device, DDP, TP alone, PP
        without FSDP): autocast the forward to ``--training.mixed_precision_param``, keeping
        fp32 weights. Under FSDP2 the policy casts the parameters instead."""
        dtype = self.config.training.mixed_precision_param
        if dtype == "float32" or self.parallel_dims.uses_fully_shard:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, positions: Any) -> torch.Tensor:
        """Forward and backward of one microbatch; returns its detached (scaled) loss."""
        if self.parallel_dims.pp_enabled:
            with self._autocast():
                return self._pipeline_forward_backward(inputs, labels)
        with loss_parallel_context(self.parallel_dims, self.config.parallelism):
            with self._autocast():
                logits = self.model_parts[0](inputs, positions)
            loss = self._loss(logits, labels)
            del logits  # free the largest activation before backward
            loss.backward()
        return local_value(loss.detach())

    def _pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Run the pipeline schedule; the last stage returns the sum of its microbatch losses,
        the other stages zero."""
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": labels, "losses": losses} if self.pp_has_last else {}
        if self.pp_has_first:
            self.pp_schedule.step(inputs, **kwargs)
        else:
            self.pp_schedule.step(**kwargs)
        if not self.pp_has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(x).detach() for x in losses]).sum()

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        raise NonFiniteLossError(
            f"step {self.step + 1}: loss {loss}, grad norm {grad_norm} — training stopped before the "
            "optimizer step, so the weights are still finite. Try a lower --optimizer.lr, a longer "
            "--lr_scheduler.warmup_steps, or clipping with --training.max_norm."
        )

    # ---- the loop -----------------------------------------------------------------------

    def save_seed_checkpoint(self) -> str:
        """Write the freshly initialized weights as step 0 (``--checkpoint.create_seed_checkpoint``)."""
        path = self.checkpointer.save_seed_checkpoint()
        logger.info("seed checkpoint written to %s", path)
        return path

    def train(self) -> list[dict[str, Any]]:
        """Resume from a checkpoint when there is one, run until ``--training.steps``, and
        return the records that were logged."""
        if self.config.checkpoint.create_seed_checkpoint:
            self.save_seed_checkpoint()
            return []
        loaded = self.checkpointer.load()
        if loaded:
            logger.info("resumed from step %d (%d tokens seen)", self.step, self.train_state.tokens_seen)
        records: list[dict[str, Any]] = []
        data_iter = iter(self.dataloader)
        total = self.config.training.steps
        self.metrics.start(self.step)
        while self.step < total:
            microbatches = [next(data_iter) for _ in range(self.grad_accum_steps)]
            result = self.train_step(microbatches)
            self.train_state.step += 1
            self.train_state.tokens_seen += result.tokens
            # Per-device throughput: the data-parallel rank's tokens are shared by its cp x tp x pp
            # devices, so each device's share is what MFU compares with one device's peak.
            batch_tokens = sum(mb["input_ids"].numel() for mb in microbatches)
            self.metrics.record_tokens(batch_tokens // self.parallel_dims.non_data_parallel_size)
            if self.metrics.should_log(self.step):
                records.append(self._log(result))
            self.checkpointer.maybe_save(self.step, last_step=self.step == total)
        self.metrics.close()
        logger.info("training done: %d steps, %d tokens", self.step, self.train_state.tokens_seen)
        return records

    def _log(self, result: StepResult) -> dict[str, Any]:
        loss, loss_max = self.global_loss(result)
        return self.metrics.log(
            step=self.step,
            loss=loss,
            grad_norm=result.grad_norm,
            lr=self.lr_schedulers.last_lr(),
            extra={"loss_max": loss_max, "tokens_seen": self.train_state.tokens_seen},
        )

    def close(self) -> None:
        """Drain checkpoint saves, close the progress bar and release the process group."""
        self.checkpointer.close()
        self.metrics.close()
        destroy_distributed()
