"""Configuration sections owned by titan.dist: `--parallelism.*`, `--activation_checkpoint.*`,
`--compile.*`.

Each is a kw-only dataclass with a docstring per field (tyro turns them into flag help) and a
`__post_init__` that rejects bad values with a message naming the flag, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split a backward into its input-gradient (I) and weight-gradient (W) parts
to fill the pipeline's bubbles (the last two placing rank r's stages at r and 2 pp - 1 - r)."""
RESHARD_POLICIES = ("default", "always", "never")
DTYPES = ("float32", "bfloat16", "float16")
AC_MODES = ("none", "full", "selective")
COMPILE_GRANULARITIES = ("block", "model")
COMPILE_COMPONENTS = ("model", "loss")


def _require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: keeps each validation one readable line."""
    if not ok:
        raise ValueError(message)


def _check_degree(flag: str, value: int, *, allow_rest: bool = False) -> None:
    lowest = "-1 (the rest) or >= 1" if allow_rest else ">= 1"
    ok = value >= 1 or (allow_rest and value == -1)
    _require(ok, f"--parallelism.{flag} must be {lowest}, got {value}")


@dataclass(kw_only=True)
class ParallelismConfig:
    """How the job is split over ranks (`--parallelism.*`).

    The product of the data-parallel, context, tensor and pipeline degrees is the world size;
    `data_parallel_shard_degree=-1` takes whatever is left.
    """

    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or the replicate axis of HSDP when shard degree > 1)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard-group size; -1 uses every rank the other degrees leave over."""
    fsdp_reshard_after_forward: str = "default"
    """Free gathered params after forward: "always", "never", or "default" (yes, except under
    pipeline parallel where microbatches would re-gather them many times)."""
    fsdp_cpu_offload: bool = False
    """Keep sharded params, grads and optimizer states on CPU (FSDP2 CPUOffloadPolicy)."""
    tensor_parallel_degree: int = 1
    """Ranks a single layer's matmuls are split over (Megatron column/row parallel)."""
    enable_sequence_parallel: bool = True
    """With tensor parallel: shard norms and residuals along the sequence (saves memory)."""
    enable_loss_parallel: bool = True
    """With tensor parallel: cross-entropy on vocab-sharded logits, never gathering them."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP collectives with matmuls (CUDA + torch.compile only)."""
    pipeline_parallel_degree: int = 1
    """Number of pipeline ranks the layers are split over."""
    pipeline_parallel_schedule: str = "1F1B"
    """Schedule name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble or DualPipeV."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per stage; None = one stage per rank (two for V schedules)."""
    pipeline_parallel_split_points: list[str] | None = None
    """Explicit split: names of the blocks that start stages 1..n-1 (e.g. layers.2)."""
    pipeline_parallel_first_stage_less_layers: int = 0
    """Blocks' worth of work the first stage's embedding counts for: the split deals out blocks
    plus this many and plus ``..._last_stage_less_layers`` evenly, and the first stage holds
    this many blocks fewer (torchtitan's flag; its default is 1, titan's 0: an even split of
    the blocks). Not read with ``pipeline_parallel_split_points``, which name every stage's
    blocks (the command line refuses the two together)."""
    pipeline_parallel_last_stage_less_layers: int = 0
    """Blocks' worth of work the last stage's norm, output projection and loss count for (at a
    large vocabulary they cost more than a block): that stage holds this many blocks fewer.
    torchtitan's flag (default 1 there, 0 here)."""
    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline microbatch; the local batch must divide by it."""
    context_parallel_degree: int = 1
    """Ranks the sequence is split over (exact ring/all-gather attention)."""
    context_parallel_rotate_method: str = "allgather"
    """How K/V travel between CP ranks: "allgather" (the one implemented so far)."""
    expert_parallel_degree: int = 1
    """Ranks the MoE experts are split over, each owning n_experts / degree of them; borrowed
    from data_parallel_shard x context_parallel (must divide it), whose remaining ranks
    FSDP-shard the experts. Needs a model whose plan names its expert modules."""

    def __post_init__(self) -> None:
        _check_degree("data_parallel_replicate_degree", self.data_parallel_replicate_degree)
        _check_degree("data_parallel_shard_degree", self.data_parallel_shard_degree, allow_rest=True)
        for flag in ("tensor_parallel_degree", "pipeline_parallel_degree",
                     "context_parallel_degree", "expert_parallel_degree",
                     "pipeline_parallel_microbatch_size"):
            _check_degree(flag, getattr(self, flag))
        self._check_choices()
        lps = self.pipeline_parallel_layers_per_stage
        _require(lps is None or lps >= 1,
                 f"--parallelism.pipeline_parallel_layers_per_stage must be >= 1 or unset, got {lps}")
        _require(lps is None or not self.pipeline_parallel_split_points,
                 "set either --parallelism.pipeline_parallel_layers_per_stage or "
                 "--parallelism.pipeline_parallel_split_points, not both")
        for end in ("first", "last"):
            less = getattr(self, f"pipeline_parallel_{end}_stage_less_layers")
            _require(less >= 0, f"--parallelism.pipeline_parallel_{end}_stage_less_layers must be >= 0, got {less}")

    def _check_choices(self) -> None:
        _require(self.pipeline_parallel_schedule in PIPELINE_SCHEDULES,
                 f"--parallelism.pipeline_parallel_schedule={self.pipeline_parallel_schedule!r} "
                 f"is unknown; choose one of {', '.join(PIPELINE_SCHEDULES)}")
        _require(self.fsdp_reshard_after_forward in RESHARD_POLICIES,
                 f"--parallelism.fsdp_reshard_after_forward={self.fsdp_reshard_after_forward!r} "
                 f"is unknown; choose one of {', '.join(RESHARD_POLICIES)}")
        _require(self.context_parallel_rotate_method == "allgather",
                 f"--parallelism.context_parallel_rotate_method="
                 f"{self.context_parallel_rotate_method!r} is not supported; use allgather")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    """Trade compute for memory by recomputing activations in backward
    (`--activation_checkpoint.*`)."""

    mode: str = "none"
    """"none"; "full" (recompute every block); "selective" (see the two fields below)."""
    selective_layer_every: int | None = None
    """selective: checkpoint blocks 0, k, 2k, ... (k = this; 1 = every block). Unset: every
    second block whole, torchtitan's default for mode selective, or every block with
    `selective_op` (`checkpoint_every`)."""
    selective_op: bool = False
    """selective: inside a checkpointed block keep matmul (and collective) outputs and
    recompute only the cheap ops in between, instead of recomputing the whole block."""
    preserve_rng_state: bool = False
    """Replay the RNG states in the recomputation, so random ops (dropout) draw what the
    forward drew (torchtitan's flag and default). titan's models draw nothing at random in
    their forward; a model that does (dropout) needs it for exact gradients."""

    def __post_init__(self) -> None:
        _require(self.mode in AC_MODES,
                 f"--activation_checkpoint.mode={self.mode!r} is unknown; choose one of "
                 f"{', '.join(AC_MODES)}")
        _require(self.selective_layer_every is None or self.selective_layer_every >= 1,
                 f"--activation_checkpoint.selective_layer_every must be >= 1, got "
                 f"{self.selective_layer_every}")

    def checkpoint_every(self) -> int:
        """k of the blocks 0, k, 2k, ... the engine checkpoints: 1 under "full"; under
        "selective" `selective_layer_every`, else 1 per op and 2 whole (torchtitan's
        `selective_ac_option` default); 0 without AC."""
        if self.mode == "none":
            return 0
        if self.mode == "full":
            return 1
        if self.selective_layer_every is not None:
            return self.selective_layer_every
        return 1 if self.selective_op else 2


@dataclass(kw_only=True)
class CompileConfig:
    """torch.compile applied to each transformer block or to the whole model, and to the loss
    (`--compile.*`)."""

    enable: bool = False
    """Compile the model (inductor on CPU and CUDA), per `granularity`, and the loss
    (`components`)."""
    granularity: str = "block"
    """"block": each transformer block on its own (one graph reused by every block; works with
    every parallelism, FSDP's per-block hooks stay outside the graphs). "model": the whole model
    as one graph (embedding, norms and output fused too; longer compile), on one device, DDP or
    TP only."""
    backend: str = "inductor"
    """torch.compile backend; "aot_eager" is handy to debug compile issues quickly."""
    fullgraph: bool = False
    """Fail on graph breaks instead of falling back to eager for those ops."""
    components: list[str] = field(default_factory=lambda: list(COMPILE_COMPONENTS))
    """What `enable` compiles (torchtitan's flag): "model" (per `granularity`) and "loss" (the
    cross-entropy: its float32 cast, log-softmax and gather fused, and backward recomputing the
    softmax instead of keeping it; 1.37x the eager loss's forward + backward in float32 and
    2.5x in bf16 at vocab 32,768 on a CPU; loss parallel's vocab-sharded cross-entropy stays
    eager)."""

    def __post_init__(self) -> None:
        _require(bool(self.backend), "--compile.backend must name a torch.compile backend")
        _require(self.granularity in COMPILE_GRANULARITIES,
                 f"--compile.granularity={self.granularity!r} is unknown; choose one of "
                 f"{', '.join(COMPILE_GRANULARITIES)}")
        unknown = [c for c in self.components if c not in COMPILE_COMPONENTS]
        _require(not unknown, f"--compile.components {unknown} unknown; choose from {', '.join(COMPILE_COMPONENTS)}")
        _require(bool(self.components) and len(set(self.components)) == len(self.components),
                 f"--compile.components {self.components} must name each of {', '.join(COMPILE_COMPONENTS)} at most "
                 "once, and at least one (compile nothing: leave out --compile.enable)")

    @property
    def compiles_model(self) -> bool:
        """The model is compiled (`enable` with "model" among the components)."""
        return self.enable and "model" in self.components

    @property
    def compiles_loss(self) -> bool:
        """The loss is compiled (`enable` with "loss" among the components)."""
        return self.enable and "loss" in self.components


@dataclass(kw_only=True)
class CommConfig:
    """Collective timeouts and the flight recorder (`--comm.*`, torchtitan's names).

    A collective that never returns (a rank died, hung or diverged) fails the run after the
    timeout with the collective named, instead of holding every rank for the backend's default
    (30 minutes on gloo)."""

    init_timeout_seconds: int = 300
    """Timeout of every collective until the first training step is done (the set-up, the first
    step's compile and checkpoint load)."""
    train_timeout_seconds: int = 100
    """Timeout of every collective from the second training step on (`titan rl` keeps
    the set-up timeout: its trainer ranks wait on rank 0's generation)."""
    trace_buf_size: int = 20000
    """Collectives the flight recorder keeps per rank (0: off). On a timeout each rank writes
    them to ``<dump_folder>/comm_traces/``; on NCCL torch's watchdog dumps them too."""

    def __post_init__(self) -> None:
        _require(self.init_timeout_seconds > 0, f"--comm.init_timeout_seconds must be > 0, got {self.init_timeout_seconds}")
        _require(self.train_timeout_seconds > 0,
                 f"--comm.train_timeout_seconds must be > 0, got {self.train_timeout_seconds}")
        _require(self.trace_buf_size >= 0, f"--comm.trace_buf_size must be >= 0, got {self.trace_buf_size}")
