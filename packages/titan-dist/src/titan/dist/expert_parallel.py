"""Expert parallelism: each rank of the "ep" mesh owns n_experts / ep of an MoE layer's experts
and the tokens routed to them travel there and back with two uneven all-to-alls.

Where the dispatch sits. The MoE block is left unchanged: its router picks the experts, it
sorts the token copies by expert and calls its grouped-experts module with all E experts'
counts, then weights and combines the outputs. Expert parallelism wraps only that
grouped-experts call, so routing, auxiliary losses, load statistics and the combine see
exactly what one process would:

    router -> sort by expert -> [dispatch all-to-all -> local experts -> combine all-to-all]
    -> weighted combine

Module contract (read by attribute, titan.dist never imports a model): the plan's
`expert_modules` glob names modules with parameters `w1` [E, hidden, dim], `w3` [E, hidden,
dim], `w2` [E, dim, hidden] and `forward(x [N, D], num_tokens_per_expert [E] long) -> [N, D]`
whose rows of `x` are grouped by expert in expert order; the expert count is read from the
weights or the counts, never from a stored config field (under EP the module sees only its
local experts). Under tensor parallel every TP rank must hand the experts the same tokens
(the MoE block input gathered with the "block_input" style, or sequence parallel off); the
experts themselves are never tensor-parallel.

Gradients. The engine scales each rank's loss assuming FSDP averages gradients over all
R x S x C = dp_replicate x dp_shard x cp ranks, which dense FSDP/HSDP does. An expert's
gradient on its owner, though, is already a sum over the tokens of its `ep` EP peers (the
all-to-all backward brings them home), and the expert FSDP units average it over only the
R x S x C / ep ranks holding the same experts. So the local expert weights scale their
gradient by 1 / ep on the way back (`_ScaleGrad`): R x S x C / ep x ep = R x S x C, and expert
gradients equal the single-process ones. (Doing it here rather than with FSDP's gradient
divide factor keeps the expert units' reductions plain averages, which every backend has.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan.dist.plan import match_modules, sharding_plan

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the grouped-experts modules the plan's `expert_modules` glob names
    and this model part still holds (pipeline parallel may have removed some)."""
    pattern = getattr(sharding_plan(model), "expert_modules", None)
    if not pattern:
        return []
    return [(name, m) for name, m in match_modules(model, pattern) if m is not None]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, config=None) -> nn.Module:
    """Split every plan `expert_modules` module's experts over the 1-D `ep_mesh`, in place.

    `w1`, `w2`, `w3` become DTensors Shard(0) on `ep_mesh` (global shapes stay [E, ...], so
    checkpoints and optimizers see the full experts; each rank stores n_experts / ep of them)
    and the module's forward dispatches tokens to their experts' owners and back. `config`
    (the ParallelismConfig) is unused for now, kept for the `apply_*` signature. Raises
    ValueError when the plan names no experts or the count does not divide by the degree.
    """
    modules = expert_modules(model)
    if not modules and getattr(sharding_plan(model), "expert_modules", None) is None:
        raise ValueError(
            f"{type(model).__name__}'s sharding plan names no expert_modules; expert parallel "
            f"needs them (or set --parallelism.expert_parallel_degree 1)")
    for name, module in modules:
        _shard_experts(name, module, ep_mesh)
        module.forward = functools.partial(_expert_parallel_forward, module, module.forward,
                                           ep_mesh)
    return model


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace w1/w2/w3 by DTensor Shard(0) parameters on `mesh` (each rank keeps its own rows,
    no communication: every rank holds the same full tensor, or the meta device)."""
    for weight in EXPERT_WEIGHTS:
        param = getattr(module, weight, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{name}.{weight} is not a parameter; the plan's expert_modules must "
                             f"name grouped-experts modules with w1, w2, w3 [E, ...]")
        if isinstance(param, DTensor):
            raise ValueError(
                f"{name}.{weight} is already distributed on {param.device_mesh}; experts cannot be "
                f"tensor-parallel under expert parallel: leave them out of the plan's "
                f"tensor_parallel styles or set --parallelism.expert_parallel_degree 1")
        if param.shape[0] % mesh.size():
            raise ValueError(
                f"{name}.{weight} holds {param.shape[0]} experts, which "
                f"expert_parallel_degree={mesh.size()} does not divide; pick a divisor")
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(weight, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _expert_parallel_forward(module: nn.Module, inner: Callable, mesh: DeviceMesh,
                             x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Dispatch x (rows grouped by global expert) to the experts' owners, run the local
    experts there, and bring the outputs back in x's order."""
    if isinstance(x, DTensor):  # a replicated TP activation: every TP rank has these tokens
        if not all(isinstance(p, Replicate) for p in x.placements):
            raise ValueError(f"expert parallel needs the experts' input replicated over tensor "
                             f"parallel ranks, got placements {x.placements}")
        out = _expert_parallel_forward(module, inner, mesh, x.to_local(), num_tokens_per_expert)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
    n_experts = module.w1.shape[0]
    if num_tokens_per_expert.numel() != n_experts:
        raise ValueError(f"the experts got {num_tokens_per_expert.numel()} token counts for "
                         f"{n_experts} experts; pass one count per (global) expert")
    routes = _exchange_counts(num_tokens_per_expert, mesh)
    counted = sum(routes.send_splits)  # rows past the counted ones (padding) give zeros
    received = all_to_all_single_autograd(x[:counted].contiguous(), routes.recv_splits,
                                          routes.send_splits, mesh)
    order = _local_expert_order(routes.recv_counts, sum(routes.recv_splits))
    with _local_parameters(module, grad_scale=1.0 / mesh.size()):
        y = inner(received[order], routes.recv_counts.sum(0))
    back = y[_inverse(order)]
    out = all_to_all_single_autograd(back, routes.send_splits, routes.recv_splits, mesh)
    out = wait_tensor(out)  # a plain tensor, not a lazily-waited wrapper, for the MoE block
    if counted < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - counted, *out.shape[1:])])
    return out


@dataclass
class _Routes:
    """Token counts of one dispatch: `send_splits[r]` rows go to EP rank r, `recv_splits[r]`
    come from it, `recv_counts[r, e]` of them for local expert e."""

    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: torch.Tensor


def _exchange_counts(counts: torch.Tensor, mesh: DeviceMesh) -> _Routes:
    """Tell every EP rank how many rows of each of its experts this rank sends (one equal-split
    all-to-all of the [E] counts: rank r gets the slice of its own experts from everyone)."""
    ep = mesh.size()
    counts = counts.detach().to(torch.int64).reshape(ep, -1)  # [owner rank, local expert]
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=mesh.get_group())
    # The split sizes must be host integers: one device->host sync per MoE layer.
    return _Routes(counts.sum(1).tolist(), recv.sum(1).tolist(), recv)


def _local_expert_order(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Row permutation taking the `total` received rows from (source rank, local expert)
    order to (local expert, source rank) order, i.e. grouped by local expert (no host sync)."""
    flat = recv_counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).reshape(recv_counts.shape)
    seg_starts, seg_counts = starts.t().flatten(), recv_counts.t().flatten()
    segment = torch.repeat_interleave(torch.arange(seg_counts.numel(), device=flat.device),
                                      seg_counts, output_size=total)
    first_row = torch.repeat_interleave(torch.cumsum(seg_counts, 0) - seg_counts, seg_counts,
                                        output_size=total)
    return seg_starts[segment] + torch.arange(total, device=flat.device) - first_row


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation undoing `order` (a gather, so the backward is a deterministic scatter
    of one row per destination)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


@contextlib.contextmanager
def _local_parameters(module: nn.Module, *, grad_scale: float) -> Iterator[None]:
    """Let the module's own forward see its local experts as plain tensors (a DTensor weight
    would not mix with plain activations); gradients flow back into the DTensors, scaled by
    `grad_scale` (see the module docstring)."""
    saved = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        for name, param in saved.items():
            module._parameters[name] = _ScaleGrad.apply(param.to_local(), grad_scale)
        yield
    finally:
        module._parameters.update(saved)
