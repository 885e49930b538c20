"""Warmup–stable–decay learning-rate schedule."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger("titan")


@dataclass(kw_only=True)
class LRSchedulerConfig:
    """Warmup–stable–decay schedule (``--lr_scheduler.*``).

    The LR rises linearly over ``warmup_steps``, stays at the peak, then decays over the last
    ``decay_ratio`` of training toward ``min_lr_factor`` times the peak, torchtitan's schedule
    step for step: the decay ends one step after the last (its "virtual last step"), so the
    last step still learns, as with transformers' linear schedule.
    """

    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to the peak."""
    decay_ratio: float | None = None
    """Fraction of all steps spent decaying at the end; None decays over every step after warmup
    (the first of them still at the peak, as in torchtitan)."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """The LR the decay heads for, as a fraction of the peak (reached one step after the run)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"--lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ValueError(f"--lr_scheduler.decay_ratio must be in [0, 1], got {self.decay_ratio}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"--lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


def wsd_factor(step: int, *, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """The LR multiplier for 1-based ``step`` of ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        # Starts at 1/warmup rather than 0 so the first step already learns.
        return step / max(warmup, 1)
    after_warmup = total_steps - warmup
    decay_steps = after_warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_steps = min(decay_steps, after_warmup)
    # The decay's last step is a virtual one after the run's: the run's last step decays to
    # (decay_steps - 1) / decay_steps of the way, never to a zero LR that would waste it.
    decay_start = total_steps + 1 - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if cfg.decay_type == "linear":
        remaining = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * remaining


def warn_if_warmup_exceeds_steps(cfg: LRSchedulerConfig, total_steps: int) -> None:
    """Say so when the warmup is longer than the run: `wsd_factor` then warms up over the
    run's steps instead (the flag's value is not what runs, so it must not pass silently)."""
    if cfg.warmup_steps > total_steps:
        logger.warning(
            "--lr_scheduler.warmup_steps %d exceeds the run's %d steps: the LR warms up over "
            "those %d steps instead and reaches its peak at the last one",
            cfg.warmup_steps, total_steps, total_steps,
        )


def build_lr_scheduler(cfg: LRSchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """A LambdaLR following :func:`wsd_factor`; ``scheduler.step()`` once per optimizer step."""
    # LambdaLR calls the lambda with 0 at construction and k after the k-th step(); the
    # optimizer step that uses lr(k) is step k+1, so shift by one.
    return LambdaLR(optimizer, lambda k: wsd_factor(k + 1, cfg=cfg, total_steps=total_steps))
