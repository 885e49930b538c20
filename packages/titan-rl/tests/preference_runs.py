"""The tiny runs the preference-loop tests (DPO, KTO, reward models) train: importable by them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any


def tiny_run(cfg: Any, tmp_path, *, steps: int, examples: int) -> Any:
    """``cfg`` (a DPO, KTO or reward config) set up as those tests run it: the tiny debug Llama
    with the byte tokenizer on ``examples`` pairs of the synthetic task, rows of 96 tokens, 4
    per microbatch, ``steps`` steps at a constant 3e-3, logging every step, in ``tmp_path``."""
    cfg.model.name, cfg.model.flavor = "llama3", "debugmodel_tiny"
    cfg.tokenizer.kind = "byte"
    data = next(getattr(cfg, name) for name in ("dpo_data", "kto_data", "reward_data") if hasattr(cfg, name))
    data.synthetic_examples = examples
    cfg.training.seq_len = 96
    cfg.training.local_batch_size = 4
    cfg.training.steps = steps
    cfg.optimizer.lr = 3e-3
    cfg.lr_scheduler.warmup_steps = 0
    cfg.metrics.log_freq = 1
    cfg.metrics.enable_progress_bar = False
    cfg.job.dump_folder = str(tmp_path / "run")
    return cfg


def trained(trainer: Any) -> list[dict]:
    """Train ``trainer`` to its last step and close it; the records it logged."""
    try:
        return trainer.train()
    finally:
        trainer.close()


def resumed_without_the_last_save(build: Callable[[], Any], tmp_path, *, last_step: int) -> list[dict]:
    """What a run in ``tmp_path`` logs when its checkpoint of ``last_step`` and its metrics
    are gone: a fresh trainer from ``build()`` resumes from the save before and trains on."""
    shutil.rmtree(tmp_path / "run" / "checkpoint" / f"step-{last_step}")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    return trained(build())
