"""`parallelize`: the one place that fixes the order the techniques are applied in.

CP -> TP/SP -> EP -> activation checkpointing -> compile -> FSDP2 / DDP.

Why this order: CP swaps the attention kernel, which TP must then see as an ordinary
submodule; TP turns parameters into DTensors on the "tp" axis before FSDP adds the data
axes on top (FSDP2 composes over existing TP DTensors, not the reverse); checkpointing
wraps a block's forward and compile must trace that wrapped forward; FSDP comes last so its
per-block hooks (all-gather before, reduce-scatter after) sit outside the compiled and
checkpointed code.

EP comes after TP because the experts are never tensor-parallel (it refuses experts that
already are DTensors) while the dense part around them may be; it comes before AC and
compile so their wrappers trace the dispatching forward, and before FSDP2, which adds the
expert mesh on top of the expert DTensors (each grouped-experts module its own unit).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from titan.dist.activation_checkpoint import apply_activation_checkpointing
from titan.dist.compile import apply_compile
from titan.dist.dims import ParallelDims
from titan.dist.fsdp import check_cpu_offload_has_fsdp, check_reshard_under_zero_bubble


def parallelize(model: nn.Module, parallel_dims: ParallelDims, mesh: DeviceMesh | None, *,
                parallelism, activation_checkpoint, compile,
                mp_policy: MixedPrecisionPolicy | None = None,
                tensor_parallel_overrides=None) -> nn.Module:
    """Apply every configured technique to `model` (or to one pipeline stage of it).

    `mesh` is the root mesh from `parallel_dims.build_mesh` (None at world size 1); the
    axis views are taken from `parallel_dims.mesh(name)`. The model's `sharding_plan()` says
    which submodules get which tensor-parallel style, which are FSDP units and where the
    attention kernels are. `mp_policy` is FSDP2's mixed precision (default: none, fp32).
    `tensor_parallel_overrides` (a `TensorParallelOverrides`) replaces the TP style of some
    modules. Returns the same module object, transformed in place.
    """
    dims = parallel_dims
    check_cpu_offload_has_fsdp(parallelism, dims)
    check_reshard_under_zero_bubble(parallelism, dims)
    if dims.cp_enabled:
        from titan.dist.context_parallel import apply_context_parallel
        apply_context_parallel(model, dims.mesh("cp"), parallelism)
    if dims.tp_enabled:
        from titan.dist.tensor_parallel import apply_tensor_parallel
        apply_tensor_parallel(model, dims.mesh("tp"), parallelism, tensor_parallel_overrides)
    if dims.ep_enabled:
        from titan.dist.expert_parallel import apply_expert_parallel
        apply_expert_parallel(model, dims.mesh("ep"), parallelism)
    apply_activation_checkpointing(model, None, activation_checkpoint)
    apply_compile(model, None, compile)
    _apply_data_parallel(model, dims, parallelism, mp_policy)
    return model


def _apply_data_parallel(model: nn.Module, dims: ParallelDims, parallelism,
                         mp_policy: MixedPrecisionPolicy | None) -> None:
    """FSDP2 (HSDP when also replicating) when parameters are sharded; DDP when only
    replicated; nothing on a single data-parallel rank. Replication of tensor-parallel
    DTensor params goes through FSDP2 with a shard group of 1 (torch's DDP cannot take
    DTensors)."""
    if dims.uses_fully_shard:
        from titan.dist.fsdp import apply_fsdp
        # ep divides dp_shard x cp > 1, so FSDP is always on with EP.
        expert_mesh = dims.mesh("expert_fsdp") if dims.ep_enabled else None
        apply_fsdp(model, dims.mesh("fsdp"), parallelism, pp_enabled=dims.pp_enabled,
                   mp_policy=mp_policy, expert_mesh=expert_mesh)
    elif dims.dp_replicate_enabled:
        from titan.dist.fsdp import apply_ddp
        apply_ddp(model, dims.mesh("dp_replicate"), parallelism)
