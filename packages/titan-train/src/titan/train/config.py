"""The trainer's own config sections and the tree that composes every component's config.

Each component owns its ``Config`` dataclass next to its code; this module composes them into
``TrainerConfig``, the tree that tyro turns into ``--section.field`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titan.ckpt import CheckpointConfig
from titan.dist import ActivationCheckpointConfig, CommConfig, CompileConfig, ParallelismConfig
from titan.train.data import DatasetConfig, TokenizerConfig
from titan.train.fault_tolerance import FaultToleranceConfig
from titan.train.lr_scheduler import LRSchedulerConfig
from titan.train.metrics import MetricsConfig
from titan.train.optimizer import OptimizerConfig
from titan.train.profiling import ProfilerConfig
from titan.train.quantize import QuantizeConfig
from titan.train.validation import ValidationConfig


@dataclass(kw_only=True)
class JobConfig:
    """Where the run writes and what it is called (``--job.*``)."""

    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, checkpoints and other run outputs."""
    description: str = ""
    """Free text describing the run; printed at start."""
    print_config: bool = False
    """Print the resolved config as JSON at start."""

    def __post_init__(self) -> None:
        if not self.dump_folder:
            raise ValueError("--job.dump_folder must not be empty")


@dataclass(kw_only=True)
class ModelConfig:
    """Which model family and size to train (``--model.*``)."""

    name: str = "llama3"
    """Model family, as registered in titan.recipes (e.g. llama3)."""
    flavor: str = "debugmodel"
    """Size within the family (e.g. debugmodel, 1B, 8B, 70B, 405B), or ``hf``: the architecture
    of the Hugging Face checkpoint the run starts from, read from its ``config.json`` (needs
    ``--checkpoint.initial_load_path HF_FOLDER --checkpoint.initial_load_in_hf``)."""
    vocab_multiple_of: int = 64
    """Pad the embedding/output vocabulary to a multiple of this, so tensor parallel degrees
    divide it; padded rows never receive a label."""
    vocab_size: int | None = None
    """Rows of the embedding and output: None pads the tokenizer's vocabulary to
    ``vocab_multiple_of``; set it to match a checkpoint whose matrices have more rows than the
    tokenizer has tokens (Qwen3: 151936). Must be >= the tokenizer's vocabulary."""
    n_layers: int | None = None
    """Override the flavor's number of blocks (None keeps the flavor's)."""
    dim: int | None = None
    """Override the flavor's model width (None keeps the flavor's)."""
    n_heads: int | None = None
    """Override the flavor's query heads per block (None keeps the flavor's)."""
    n_kv_heads: int | None = None
    """Override the flavor's key/value heads per block (None keeps the flavor's)."""
    router_aux_loss_coef: float | None = None
    """MoE families: override the flavor's router auxiliary (balancing) loss coefficient; 0
    turns it off (None keeps the flavor's). Qwen3-MoE: transformers' Switch loss pooled over
    the layers; DeepSeek-V3: its sequence-wise balance loss (`aux_loss_alpha`)."""

    def __post_init__(self) -> None:
        if self.vocab_multiple_of < 1:
            raise ValueError(f"--model.vocab_multiple_of must be >= 1, got {self.vocab_multiple_of}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"--model.vocab_size must be >= 1, got {self.vocab_size}")
        for name, value in self.overrides().items():
            if value < (0 if name == "router_aux_loss_coef" else 1):
                raise ValueError(f"--model.{name} must be >= {0 if name == 'router_aux_loss_coef' else 1}, got {value}")

    def resolve_vocab_size(self, tokenizer_vocab: int) -> int:
        """The model's vocabulary for a tokenizer of ``tokenizer_vocab`` tokens — the one rule
        `titan train`, `titan sft`, `titan rl` and `titan dry-run` share: ``--model.vocab_size``
        when given (at least the tokenizer's), else the tokenizer's rounded up to
        ``--model.vocab_multiple_of``."""
        if self.vocab_size is None:
            return -(-tokenizer_vocab // self.vocab_multiple_of) * self.vocab_multiple_of
        if self.vocab_size < tokenizer_vocab:
            raise ValueError(
                f"--model.vocab_size {self.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
                f"use >= {tokenizer_vocab} or leave it unset"
            )
        return self.vocab_size

    def overrides(self) -> dict[str, int | float]:
        """The fields set on the command line or by the recipe, for the family's build (a
        family without such a field refuses it by name)."""
        return {
            name: value
            for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "router_aux_loss_coef")
            if (value := getattr(self, name)) is not None
        }


@dataclass(kw_only=True)
class TrainingConfig:
    """Steps, batch geometry, clipping and precision (``--training.*``)."""

    steps: int = 1000
    """Optimizer steps to train for."""
    local_batch_size: int = 8
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; a multiple of
    local_batch_size x data-parallel degree, the quotient being the gradient-accumulation
    steps. -1 means local_batch_size x data-parallel degree (no accumulation)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this; <= 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: str = "float32"
    """Compute dtype of forward/backward (bfloat16 on GPUs); master weights stay float32. Under
    FSDP2 its policy casts the parameters; elsewhere the forward runs under autocast."""
    mixed_precision_reduce: str = "float32"
    """dtype of gradient reduction under FSDP."""
    loss_chunk_tokens: int = 0
    """Compute the cross-entropy this many token positions at a time, recomputing each chunk
    in backward, so the float32 logits and log-softmax ([tokens, vocab] each) never exist for a
    whole microbatch (pretraining, SFT, validation, RL's SFT warm-up, and the RL policy loss's
    token log-probs and entropy); 0 computes it in one piece. Saves the most memory with large vocabularies (e.g. 4096 with Llama 3's 128K);
    costs one recomputed softmax."""
    loss_type: Literal["nll", "dft"] = "nll"
    """The token loss of training (pretraining, SFT, RL's SFT warm-up): nll, the negative
    log-likelihood; dft (Dynamic Fine-Tuning, TRL's SFT loss_type "dft"): each token's NLL
    weighted by its detached probability, so tokens the model finds very unlikely no longer
    dominate the gradient. The logged loss is that loss; validation always reports NLL."""
    document_mask: bool = False
    """Attend only within each packed document (causal AND same document), with RoPE
    positions restarting at 0 per document, so a sample's outputs do not depend on what it
    was packed with. Off for pretraining: packed windows of one corpus are the classic
    pretraining setup, cross-document context costs little there, the unmasked path keeps
    SDPA's fused `is_causal` kernel, and runs stay identical to earlier ones. SFT and RL
    loops turn it on: there a sequence's log-probabilities must be its own."""

    gc_freq: int = 50
    """Collect Python's garbage every this many optimizer steps, the same steps on every rank,
    with the automatic collector off while training (its pauses, at other moments on each
    rank, make the others wait at their next collective; torchtitan's flag and default); 0
    leaves Python's automatic collection on."""
    gc_debug: bool = False
    """A full garbage collection after every step, logged with what it freed, and torch's
    warning (rank 0) for reference cycles that keep tensors alive (slow: for debugging)."""

    def __post_init__(self) -> None:
        if self.gc_freq < 0:
            raise ValueError(f"--training.gc_freq must be >= 0 (0: Python's automatic collection), got {self.gc_freq}")
        if self.loss_type not in ("nll", "dft"):
            raise ValueError(f"--training.loss_type must be nll or dft, got {self.loss_type!r}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"--training.loss_chunk_tokens must be >= 0 (0 = one piece), got {self.loss_chunk_tokens}")
        for flag in ("steps", "local_batch_size", "seq_len"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--training.{flag} must be >= 1, got {getattr(self, flag)}")
        if self.global_batch_size != -1 and self.global_batch_size < 1:
            raise ValueError(
                f"--training.global_batch_size must be >= 1 or -1 (= local x dp), got {self.global_batch_size}"
            )
        for flag in ("mixed_precision_param", "mixed_precision_reduce"):
            if getattr(self, flag) not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"--training.{flag} must be float32, bfloat16 or float16, got {getattr(self, flag)!r}"
                )


@dataclass(kw_only=True)
class DebugConfig:
    """Reproducibility switches (``--debug.*``)."""

    seed: int = 0
    """Seed for weight init, data order and dropout-free randomness.
    A resume keeps the saved run's seed (its checkpoint records it; another is refused)."""
    deterministic: bool = False
    """Use deterministic kernels only (slower; bitwise-reproducible runs on the same layout)."""
    skip_memory_check: bool = False
    """Start even when the run's estimated peak memory per rank exceeds the device's (by
    default such a run is refused before anything is built, with the flags that would fit)."""
    moe_force_load_balance: bool = False
    """MoE families, for benchmarks (torchtitan's flag): every router sends the tokens to the
    experts round robin, the same number to each, whatever the scores (which still weight the
    outputs and train the gate), so throughput is measured at perfect balance. Changes what
    the model computes: not for real training."""


@dataclass(kw_only=True)
class RunConfig:
    """The sections every training loop shares: model, engine (parallelism, optimizer,
    checkpoints, ...), tokenizer and bookkeeping. Each loop adds its data section."""

    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilerConfig = field(default_factory=ProfilerConfig)


@dataclass(kw_only=True)
class TrainerConfig(RunConfig):
    """A complete pretraining run: the shared sections and the pretraining corpus."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
