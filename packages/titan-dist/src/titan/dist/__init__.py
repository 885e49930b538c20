"""titan.dist: every parallelism, applied from outside to an unchanged single-device model.

Public API (everything else is internal):

- configs: `ParallelismConfig`, `ActivationCheckpointConfig`, `CompileConfig`
- process group: `DistEnv`, `init_distributed`, `destroy_distributed` (`leaving_after_failure`: without
  its barrier); a job split in two parts with
  a bridge between them: `split_job`, `current_split`, `JobSplit`, `Bridge`
- mesh: `ParallelDims` (with expert parallel also the "ep" and "expert_fsdp" views)
- transformation: `parallelize` (fixed order CP -> TP/SP -> EP -> AC -> compile -> FSDP2),
  and the individual `apply_*` functions
- reductions: `clip_grad_norm_`, `reduce_mean`, `reduce_max`
- pipeline: `build_pipeline` -> (schedule, model_parts, has_first_stage, has_last_stage)
- context parallel: `shard_batch_for_context_parallel`, `shard_batch_dict_for_context_parallel`
- loss parallel: `loss_parallel_context`
- dry run: `dry_run` (fake process group, meta device, any world size)
"""

from titan.dist.activation_checkpoint import apply_activation_checkpointing
from titan.dist.compile import apply_compile, check_compile_options
from titan.dist.comm import (
    CollectiveTimeoutError,
    HangWatchdog,
    PeerLostError,
    enable_flight_recorder,
    set_collective_timeout,
)
from titan.dist.config import ActivationCheckpointConfig, CommConfig, CompileConfig, ParallelismConfig
from titan.dist.dims import ParallelDims
from titan.dist.env import DistEnv, destroy_distributed, init_distributed, leaving_after_failure
from titan.dist.split import Bridge, JobSplit, current_split, split_job
from titan.dist.context_parallel import (
    apply_context_parallel,
    shard_batch_dict_for_context_parallel,
    shard_batch_for_context_parallel,
)
from titan.dist.dry_run import RankEstimate, dry_run, validate_against_model
from titan.dist.expert_parallel import apply_expert_parallel
from titan.dist.fsdp import (
    apply_ddp,
    apply_fsdp,
    check_reshard_under_zero_bubble,
    mixed_precision_policy,
    replicas_sync_later,
)
from titan.dist.parallelize import parallelize
from titan.dist.pipeline import build_pipeline
from titan.dist.tensor_parallel import TensorParallelOverrides, apply_tensor_parallel, loss_parallel_context
from titan.dist.reduce import clip_grad_norm_, reduce_max, reduce_mean

__all__ = [
    "ActivationCheckpointConfig",
    "CollectiveTimeoutError",
    "PeerLostError",
    "CommConfig",
    "HangWatchdog",
    "enable_flight_recorder",
    "set_collective_timeout",
    "CompileConfig",
    "DistEnv",
    "ParallelDims",
    "ParallelismConfig",
    "RankEstimate",
    "TensorParallelOverrides",
    "apply_context_parallel",
    "apply_ddp",
    "apply_expert_parallel",
    "apply_fsdp",
    "replicas_sync_later",
    "apply_tensor_parallel",
    "build_pipeline",
    "dry_run",
    "loss_parallel_context",
    "mixed_precision_policy",
    "validate_against_model",
    "shard_batch_dict_for_context_parallel",
    "shard_batch_for_context_parallel",
    "apply_activation_checkpointing",
    "apply_compile",
    "check_compile_options",
    "check_reshard_under_zero_bubble",
    "clip_grad_norm_",
    "destroy_distributed",
    "leaving_after_failure",
    "Bridge",
    "JobSplit",
    "current_split",
    "split_job",
    "init_distributed",
    "parallelize",
    "reduce_max",
    "reduce_mean",
]
