"""Tensor parallel, sequence parallel and loss parallel from a model's declarative plan.

Plan styles (docs/contracts.md) and what they become:

- "embedding":   vocab-sharded embedding (rowwise on the table); output sequence-sharded with SP
- "colwise":     output features sharded (Megatron f: input replicated)
- "rowwise":     input features sharded, output reduced (Megatron g); reduce-scattered along
                 the sequence with SP
- "norm":        sequence-parallel region (norm on sequence shards) when SP is on, else replicated
                 weights computing on the plain replicated activations
- "block_input": first positional input gathered from sequence shards to replicated (SP only)
- "output":      final projection; vocab-sharded logits kept as a DTensor for loss parallel
- "score":       a small final head (a reward model's scores): replicated weights reading the
                 whole sequence (gathered from sequence shards with SP); plain scores out
- "replicate":   replicated weights on plain replicated activations (a router, a low-rank
                 projection)
- "head_norm":   replicated weights on activations sharded by heads (a per-head norm)
- "shared_by_heads": an activation every head reads whole (MLA's rotated key part), on a
                 parameter-free module: unchanged forward, gradient summed over the TP ranks
                 in the backward (Megatron f), since each rank's heads give only part of it
- "replicated_block": a block every TP rank computes whole (an MoE layer)

A caller may replace the styles of some modules (`TensorParallelOverrides`): titan.train
gives torchao's float8 linears float8 styles, whose sequence-parallel gathers move float8
bytes.

Tied parameters (the plan's `tied_parameters`): torch distributes each module's parameters on
its own, so a shared Parameter comes out as two DTensors. When every name got the same layout
(a tied embedding/output: both styles shard the [vocab, dim] matrix on dim 0) the first one is
put back on every module, so the tie survives as one DTensor; different layouts are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from titan.dist.plan import match_modules, sharding_plan, tied_parameter_groups

STYLES = ("embedding", "colwise", "rowwise", "norm", "block_input", "output", "score", "replicate", "head_norm",
          "shared_by_heads", "replicated_block")


def _style(name: str, *, sp: bool, lp: bool):
    """The torch ParallelStyle for one plan style (None: nothing to do in this mode)."""
    seq = Shard(1) if sp else Replicate()
    # With SP the residual stream stays a sequence-sharded DTensor (not its local shard) so
    # the model still sees the global sequence length, e.g. when it builds RoPE positions.
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                               use_local_output=not sp)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=seq, use_local_output=not sp)
    if name == "norm":
        return SequenceParallel() if sp else ReplicatedNorm()
    if name == "output":
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(),
                               use_local_output=not lp)
    if name == "score":
        return ReplicatedHead()
    if name == "replicate":
        return ReplicatedNorm()
    if name == "head_norm":
        return ReplicatedNorm(input_placement=Shard(2))
    if name == "shared_by_heads":
        return SumGradientOverRanks()
    if name in ("block_input", "replicated_block"):
        return None  # handled by hooks, see _gather_first_input / _replicate_block
    raise ValueError(f"unknown tensor-parallel style {name!r} in the model's sharding plan; "
                     f"expected one of {', '.join(STYLES)}")


class ReplicatedNorm(ParallelStyle):
    """A module whose weights are replicated over the TP ranks while its activations stay
    plain tensors: a norm without sequence parallel, a router or low-rank projection
    ("replicate"), or a per-head norm over sharded heads ("head_norm").

    Left as plain tensors, such weights would be the only non-DTensor parameters of a TP-only
    model, and foreach/fused optimizers refuse to mix the two kinds in one group. The inputs
    are read as `input_placement` of the whole activation: Replicate() when every rank holds
    all of it (the weight gradient is then already complete on each rank), Shard(2) when each
    holds some heads (the weight gradient is then a partial sum that DTensor reduces).
    """

    def __init__(self, input_placement=None) -> None:
        super().__init__()
        self.input_placement = input_placement if input_placement is not None else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # distribute_module's default partition replicates every parameter.
        return distribute_module(module, device_mesh, input_fn=self._to_dtensor,
                                 output_fn=self._to_local)

    def _to_dtensor(self, _module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [self.input_placement], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                     for x in inputs)

    @staticmethod
    def _to_local(_module, output, _device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output


class SumGradientOverRanks(ReplicatedNorm):
    """A parameter-free module whose input every TP rank holds whole and whose output each
    rank's heads read (MLA's rotated key part): the forward passes the tensor through, the
    backward all-reduces its gradient, each rank's being the sum over its own heads only.
    `ReplicatedNorm` with a replicated input, whose output declares its gradient partial.

    Without it the replicated projection below (`wkv_a`) would get half of that gradient on
    each of 2 ranks: a silent error, and Adam, invariant to a gradient's scale, would hide
    most of it from the loss."""

    @staticmethod
    def _to_local(_module, output, _device_mesh):
        # The gradient coming back is this rank's partial sum; from_local's backward then
        # reduces it to the replicated input's placement.
        return output.to_local(grad_placements=[Partial()]) if isinstance(output, DTensor) else output


class ReplicatedHead(ReplicatedNorm):
    """A final head too narrow to split (a sequence-classification score): replicated weights,
    the input gathered whole from sequence shards under SP (its gradient cut back to this
    rank's shard), plain tensors out, identical on every TP rank."""

    def _to_dtensor(self, _module, inputs, device_mesh):
        x, *rest = inputs
        if isinstance(x, DTensor):
            x = x.redistribute(device_mesh, [Replicate()])
        else:
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        return (x, *rest)


def _gather_first_input(module: nn.Module, mesh: DeviceMesh, cast: Callable | None = None) -> None:
    """SP -> TP boundary: all-gather the first positional input along the sequence (kept as
    a replicated DTensor so the backward reduce-scatters the partial input gradients);
    any other inputs (e.g. the RoPE table) pass through untouched. `cast` (from
    `TensorParallelOverrides.block_input_cast`) converts the sequence shard first, so the
    gather moves what it returns (float8 bytes)."""

    def hook(_module, args):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        if cast is not None:
            x = cast(x)
        return (x.redistribute(mesh, [Replicate()]),) + tuple(args[1:])

    module.register_forward_pre_hook(hook)


def _replicate_block(module: nn.Module, mesh: DeviceMesh) -> None:
    """SP around a block every TP rank computes whole: its first input gathered from sequence
    shards to the full sequence as a plain tensor, its output cut back to this rank's sequence
    shard. Every rank's output (and so its input gradient) is identical, which Replicate
    states, so the backward needs no reduction."""

    def gather(_module, args):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]).to_local(),) + tuple(args[1:])

    def scatter(_module, _args, out):
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(scatter)


class TensorParallelOverrides:
    """Module-specific replacements for the plan's styles; this base class replaces nothing.

    A subclass (e.g. titan.train's float8 tensor parallel) returns its own ParallelStyle, or a
    cast of a block's input before its gather, for the modules it knows and None for the rest,
    which get the plan's style and a plain gather.
    """

    def style(self, style_name: str, module: nn.Module, *, sp: bool) -> ParallelStyle | None:
        """The ParallelStyle for `module` under plan style `style_name`, or None for the
        default one."""
        return None

    def block_input_cast(self, module: nn.Module) -> Callable | None:
        """A conversion of this "block_input" module's sequence-sharded first input, applied
        before the SP -> TP gather (sequence parallel only), or None to gather it as it is."""
        return None


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, config,
                          overrides: TensorParallelOverrides | None = None) -> nn.Module:
    """Shard the model's linears over the 1-D "tp" `mesh` as its `sharding_plan()` says.

    `config` is the ParallelismConfig: `enable_sequence_parallel`, `enable_loss_parallel`
    and `enable_async_tensor_parallel` are read from it. `overrides` may replace the style
    of some modules (see `TensorParallelOverrides`).
    """
    overrides = overrides or TensorParallelOverrides()
    plan = sharding_plan(model)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no sharding_plan(); tensor parallel needs "
                         f"one (or set --parallelism.tensor_parallel_degree 1)")
    _check_async(config, mesh)
    sp, lp = config.enable_sequence_parallel, config.enable_loss_parallel
    torch_plan: dict = {}
    for pattern, style_name in plan.tensor_parallel.items():
        for fqn, module in match_modules(model, pattern):
            if module is None:
                continue  # pipeline parallel removed it from this stage
            if style_name == "block_input" and sp:
                _gather_first_input(module, mesh, overrides.block_input_cast(module))
            if style_name == "replicated_block" and sp:
                _replicate_block(module, mesh)
            style = overrides.style(style_name, module, sp=sp) or _style(style_name, sp=sp, lp=lp)
            if style is not None:
                torch_plan[fqn] = style
    parallelize_module(model, mesh, torch_plan)
    reshare_tied_parameters(model)
    if config.enable_async_tensor_parallel:
        _enable_async_tp(mesh)
    return model


def reshare_tied_parameters(model: nn.Module) -> None:
    """Make every name of each tied group (plan `tied_parameters`) the first name's Parameter
    again, after sharding gave each module its own copy; raise if their layouts differ."""
    for group in tied_parameter_groups(model):
        present = [(name, *where) for name in group if (where := _owner(model, name)) is not None]
        if len(present) < 2:
            continue  # pipeline parallel left at most one name on this stage
        first_name, first_owner, first_leaf = present[0]
        shared = getattr(first_owner, first_leaf)
        for name, owner, leaf in present[1:]:
            param = getattr(owner, leaf)
            if param is shared:
                continue
            if _layout(param) != _layout(shared) or param.shape != shared.shape:
                raise ValueError(
                    f"tied parameters {first_name} and {name} get different tensor-parallel "
                    f"layouts ({_layout(shared)} vs {_layout(param)}); give their modules styles "
                    f"that shard the shared matrix the same way (e.g. embedding + output), untie "
                    f"them, or set --parallelism.tensor_parallel_degree 1")
            owner.register_parameter(leaf, shared)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """(module, attribute) holding parameter `name`, or None when a module on the path is
    missing (set to None by pipeline parallel)."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return (module, leaf) if isinstance(getattr(module, leaf, None), nn.Parameter) else None


def _layout(param: torch.Tensor) -> tuple:
    """(mesh, placements) of a DTensor; ("plain",) for an undistributed tensor."""
    if isinstance(param, DTensor):
        return (param.device_mesh, tuple(param.placements))
    return ("plain",)


def _check_async(config, mesh: DeviceMesh) -> None:
    if config.enable_async_tensor_parallel and mesh.device_type != "cuda":
        raise ValueError(
            "--parallelism.enable_async_tensor_parallel needs CUDA (symmetric-memory fused "
            f"collective matmuls); this mesh is on {mesh.device_type!r}. Turn the flag off.")


def _enable_async_tp(mesh: DeviceMesh) -> None:
    """Let inductor fuse TP collectives with the neighbouring matmuls (needs --compile.enable)."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.get_group().group_name)


def loss_parallel_context(parallel_dims, config):
    """Context to wrap the loss computation AND its backward in: vocab-parallel
    cross-entropy on DTensor logits when TP + loss parallel are on; a no-op otherwise."""
    if parallel_dims.tp_enabled and config.enable_loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()
