"""Named training configurations.

A recipe is a function returning a complete ``TrainerConfig``; recipes compose by calling
shared helpers and each other. ``titan train --config <name>`` starts from one and applies
``--section.field`` overrides on top.
"""

from __future__ import annotations

from collections.abc import Callable

from titan.train.config import TrainerConfig
from titan.train.sft import SFTConfig


def pretrain_defaults(*, flavor: str, seq_len: int, steps: int, lr: float, warmup_steps: int) -> TrainerConfig:
    """A Llama 3 pretraining config with the settings every size shares."""
    cfg = TrainerConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = flavor
    cfg.training.seq_len = seq_len
    cfg.training.steps = steps
    cfg.optimizer.lr = lr
    cfg.lr_scheduler.warmup_steps = warmup_steps
    cfg.lr_scheduler.decay_ratio = 0.2
    return cfg


def on_gpu_cluster(cfg: TrainerConfig, *, dataset: str, tokenizer_path: str) -> TrainerConfig:
    """Settings for real hardware: bf16 FSDP compute, a hub dataset, the model's tokenizer."""
    cfg.training.mixed_precision_param = "bfloat16"
    cfg.dataset.name = dataset
    cfg.tokenizer.kind = "hf"
    cfg.tokenizer.path = tokenizer_path
    cfg.model.vocab_multiple_of = 1  # the published vocab is already TP-friendly
    cfg.metrics.log_freq = 10
    cfg.checkpoint.interval = 500
    return cfg


def llama3_debug() -> TrainerConfig:
    """The debug model on CPU: trains in a few minutes on the Python standard library's own
    source (byte-level), no download."""
    cfg = pretrain_defaults(flavor="debugmodel", seq_len=128, steps=300, lr=2e-3, warmup_steps=20)
    cfg.training.local_batch_size = 8
    cfg.dataset.name = "stdlib"
    cfg.tokenizer.kind = "byte"
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/llama3_debug"
    return cfg


def llama3_debug_synthetic() -> TrainerConfig:
    """The debug model on the seeded synthetic corpus whose entropy floor is known."""
    cfg = llama3_debug()
    cfg.dataset.name = "synthetic"
    cfg.job.dump_folder = "./outputs/llama3_debug_synthetic"
    return cfg


def llama3_1b() -> TrainerConfig:
    """Llama 3.2 1B on 8 GPUs with FSDP."""
    cfg = pretrain_defaults(flavor="1B", seq_len=8192, steps=10_000, lr=3e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/llama3/tokenizer.json")
    cfg.training.local_batch_size = 1
    cfg.job.dump_folder = "./outputs/llama3_1b"
    return cfg


def llama3_8b() -> TrainerConfig:
    """Llama 3.1 8B on 8+ GPUs: FSDP with selective activation checkpointing."""
    cfg = pretrain_defaults(flavor="8B", seq_len=8192, steps=10_000, lr=3e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/llama3/tokenizer.json")
    cfg.training.local_batch_size = 1
    cfg.activation_checkpoint.mode = "selective"
    cfg.job.dump_folder = "./outputs/llama3_8b"
    return cfg


def llama3_70b() -> TrainerConfig:
    """Llama 3.1 70B on 64+ GPUs: FSDP x TP 8 with full activation checkpointing."""
    cfg = llama3_8b()
    cfg.model.flavor = "70B"
    cfg.optimizer.lr = 1.5e-4
    cfg.parallelism.tensor_parallel_degree = 8
    cfg.parallelism.enable_sequence_parallel = True
    cfg.activation_checkpoint.mode = "full"
    cfg.job.dump_folder = "./outputs/llama3_70b"
    return cfg


def llama3_405b() -> TrainerConfig:
    """Llama 3.1 405B on 512+ GPUs: FSDP x TP 8 x PP 8."""
    cfg = llama3_70b()
    cfg.model.flavor = "405B"
    cfg.optimizer.lr = 8e-5
    cfg.parallelism.pipeline_parallel_degree = 8
    cfg.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    cfg.training.local_batch_size = 8
    cfg.job.dump_folder = "./outputs/llama3_405b"
    return cfg


def sft_debug() -> SFTConfig:
    """SFT of the debug model on a synthetic string-reversal task (no download): loss only on
    the answers, packed examples with document masks; greedy answers become right."""
    cfg = SFTConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = "debugmodel"
    cfg.tokenizer.kind = "byte"
    cfg.sft_data.format = "synthetic"
    cfg.sft_data.synthetic_task = "reverse"
    cfg.training.seq_len = 64
    cfg.training.local_batch_size = 16
    cfg.training.steps = 300
    cfg.optimizer.lr = 2e-3
    cfg.lr_scheduler.warmup_steps = 20
    cfg.lr_scheduler.decay_ratio = 0.2
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/sft_debug"
    return cfg


RECIPES: dict[str, Callable[[], TrainerConfig | SFTConfig]] = {
    "llama3_debug": llama3_debug,
    "llama3_debug_synthetic": llama3_debug_synthetic,
    "llama3_1b": llama3_1b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_405b": llama3_405b,
    "sft_debug": sft_debug,
}
DEFAULT_RECIPE = "llama3_debug"


def recipe(name: str) -> TrainerConfig | SFTConfig:
    """The config of recipe ``name``; a ValueError lists the recipes otherwise."""
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"--config {name!r} is not a recipe; choose one of: {', '.join(RECIPES)}") from None
