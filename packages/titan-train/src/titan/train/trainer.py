"""The trainer: builds every component from a ``TrainerConfig`` and runs the training loop.

The life of one step is in DESIGN.md: microbatches -> forward -> loss normalized by the global
valid-token count -> backward -> mesh-wide clip -> optimizer step -> LR step -> metrics.
"""

from __future__ import annotations

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
from titan.dist import (
    ParallelDims,
    clip_grad_norm_,
    destroy_distributed,
    init_distributed,
    parallelize,
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

logger = logging.getLogger("titan")


@dataclass
class StepResult:
    """What one optimizer step produced (global over the mesh)."""

    loss: float
    grad_norm: float
    tokens: int


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


class Trainer:
    """Trains one model family from a complete config.

    Build it with the config and the family's :class:`ModelSpec`; :meth:`train` runs the loop
    and returns the logged metric records; :meth:`close` releases the process group.
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
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.dump_folder = Path(config.job.dump_folder)
        self.tokenizer = config.tokenizer.build()
        self.model = self._build_model()
        self.model_parts = [self.model]
        self.optimizer = build_optimizer(config.optimizer, self.model_parts, self.device.type)
        self.lr_scheduler = build_lr_scheduler(config.lr_scheduler, self.optimizer, config.training.steps)
        self.dataloader = build_dataloader(
            config.dataset,
            self.tokenizer,
            dp_rank=self.parallel_dims.dp_rank,
            dp_world_size=self.parallel_dims.dp_world_size,
            local_batch_size=config.training.local_batch_size,
            seq_len=config.training.seq_len,
            seed=config.debug.seed,
        )
        self.step = 0
        self.tokens_seen = 0
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

    def _build_model(self) -> nn.Module:
        cfg = self.config
        vocab_size = round_up(self.tokenizer.vocab_size, cfg.model.vocab_multiple_of)
        with torch.device("meta"):
            model = self.model_spec.build(cfg.model.flavor, vocab_size=vocab_size, max_seq_len=cfg.training.seq_len)
        self.num_params = model.num_params()
        self.flops_per_token = model.flops_per_token(cfg.training.seq_len)
        model = parallelize(
            model,
            self.parallel_dims,
            self.mesh,
            parallelism=cfg.parallelism,
            activation_checkpoint=cfg.activation_checkpoint,
            compile=cfg.compile,
        )
        model.to_empty(device=self.device)
        # Same seed on every rank: weights initialize identically wherever they are replicated.
        torch.manual_seed(cfg.debug.seed)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)
        model.train()
        return model

    def _log_start(self) -> None:
        cfg = self.config
        if cfg.job.print_config and self.dist_env.rank == 0:
            logger.info("config:\n%s", json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        logger.info(
            "%s %s: %.2fM params, %.1f MFLOPs/token | world %d on %s | batch %d x %d tokens, %d accumulation step(s) | %d steps",
            cfg.model.name,
            cfg.model.flavor,
            self.num_params / 1e6,
            self.flops_per_token / 1e6,
            self.dist_env.world_size,
            self.device,
            cfg.training.local_batch_size,
            cfg.training.seq_len,
            self.grad_accum_steps,
            cfg.training.steps,
        )

    # ---- the step -----------------------------------------------------------------------

    def _sum_over_batch_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a scalar over every rank that holds a different part of the global batch."""
        loss_mesh = self.parallel_dims.mesh("dp_cp")
        if loss_mesh is not None and loss_mesh.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=loss_mesh.get_group())
        return value

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over ``microbatches`` (gradient accumulation)."""
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens = sum(int(count_valid_tokens(mb["labels"])) for mb in microbatches)
        global_tokens = self._sum_over_batch_ranks(torch.tensor(float(local_tokens), device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        for mb in microbatches:
            inputs = mb["input_ids"].to(self.device, non_blocking=True)
            labels = mb["labels"].to(self.device, non_blocking=True)
            logits = self.model(inputs)
            loss = cross_entropy_sum(logits, labels) / global_tokens
            del logits  # free the largest activation before backward
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.config.training.max_norm,
            mesh=self.mesh,
        )
        global_loss = float(self._sum_over_batch_ranks(loss_sum))
        self._check_finite(global_loss, float(grad_norm))
        self.optimizer.step()
        self.lr_scheduler.step()
        return StepResult(loss=global_loss, grad_norm=float(grad_norm), tokens=int(global_tokens))

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        raise NonFiniteLossError(
            f"step {self.step + 1}: loss {loss}, grad norm {grad_norm} — training stopped before the "
            "optimizer step, so the weights are still finite. Try a lower --optimizer.lr, a longer "
            "--lr_scheduler.warmup_steps, or clipping with --training.max_norm."
        )

    def _next_microbatches(self, data_iter: Any) -> list[dict[str, torch.Tensor]]:
        return [next(data_iter) for _ in range(self.grad_accum_steps)]

    # ---- the loop -----------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        """Run until ``--training.steps``; return the records that were logged."""
        records: list[dict[str, Any]] = []
        data_iter = iter(self.dataloader)
        total = self.config.training.steps
        self.metrics.start(self.step)
        while self.step < total:
            microbatches = self._next_microbatches(data_iter)
            result = self.train_step(microbatches)
            self.step += 1
            local_tokens = sum(mb["input_ids"].numel() for mb in microbatches)
            self.tokens_seen += result.tokens
            self.metrics.record_tokens(local_tokens)
            if self.metrics.should_log(self.step):
                records.append(
                    self.metrics.log(
                        step=self.step,
                        loss=result.loss,
                        grad_norm=result.grad_norm,
                        lr=self.lr_scheduler.get_last_lr()[0],
                    )
                )
        self.metrics.close()
        logger.info("training done: %d steps, %d tokens", self.step, self.tokens_seen)
        return records

    def close(self) -> None:
        """Release the progress bar and the process group."""
        self.metrics.close()
        destroy_distributed()
