"""Mesh-wide reductions: the gradient norm for clipping, and metric mean / max."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


def _world_group_of(mesh: DeviceMesh):
    """The process group spanning every rank of `mesh` (one group: one collective)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    name = "_".join(mesh.mesh_dim_names or ()) + "_flat"
    return mesh._flatten(name).get_group()


def _copies(grad: torch.Tensor, mesh: DeviceMesh) -> int:
    """How many ranks of `mesh` (pp excluded) hold this exact local gradient.

    Replicated placements and mesh axes the tensor does not live on hold identical copies;
    dividing each rank's contribution by this count makes one SUM over all ranks exact.
    """
    names = mesh.mesh_dim_names or ()
    pp = mesh["pp"].size() if "pp" in names else 1
    holders = mesh.size() // pp  # ranks that own the same pipeline stage
    if not isinstance(grad, DTensor):
        return holders
    dt_mesh = grad.device_mesh
    sharded = 1
    for dim, placement in enumerate(grad.placements):
        if not isinstance(placement, Replicate):
            sharded *= dt_mesh.size(dim)
    return holders // sharded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    """`grad` with its Partial placements summed into Replicate ones.

    Tensor parallel without FSDP leaves the gradients of replicated weights that saw
    sequence-sharded activations (sequence-parallel norms) as Partial sums; their local pieces
    are not pieces of the gradient, so their norms would not add up.
    """
    if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
        return grad
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


@functools.lru_cache(maxsize=16)
def _weights_on(weights: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The per-gradient weights as a device tensor, built once per gradient layout: a tensor
    made from a host list every step is a copy from pageable memory, which on CUDA waits for
    every queued kernel (a host sync on every step)."""
    return torch.tensor(weights, device=device, dtype=dtype)


def total_norm(grads: list[torch.Tensor], mesh: DeviceMesh | None,
               norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all `grads` as if they were one unsharded vector, with one collective."""
    if not grads:
        return torch.zeros(())
    grads = [_without_partial(g) for g in grads]
    device = _local(grads[0]).device
    # An empty local shard (FSDP's uneven split of a small parameter) adds nothing, and has no
    # infinity norm; every rank still joins the collective below.
    grads = [g for g in grads if _local(g).numel()]
    locals_ = [_local(g).float() for g in grads]
    # One multi-tensor kernel per device and dtype rather than two per gradient: on a GPU
    # ~300 launches per step for a 1B model, 1% of its step.
    norms = torch._foreach_norm(locals_, norm_type) if locals_ else []
    if math.isinf(norm_type):
        value = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        if mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_world_group_of(mesh))
        return value
    if not norms:
        value = torch.zeros((), device=device)
    else:
        parts = torch.stack(torch._foreach_pow(norms, norm_type)).to(device)
        if mesh is not None:
            parts = parts * _weights_on(tuple(1.0 / _copies(g, mesh) for g in grads), device, parts.dtype)
        value = parts.sum()
    if mesh is not None:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=_world_group_of(mesh))
    return value ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, *,
                    mesh: DeviceMesh | None = None, foreach: bool | None = None,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients to a total norm of `max_norm` and return the pre-clip total norm.

    The norm is mesh-wide: sharded (DTensor) gradients and replicated ones are combined in a
    single reduction over all ranks of `mesh` (the root mesh; pipeline stages are summed too),
    weighting every local piece by 1 / its number of copies. Without a mesh this is the plain
    single-process norm. `foreach` picks the fused multi-tensor scaling kernel (None: auto).

    `max_norm <= 0` disables clipping (`--training.max_norm 0`): the norm is still computed
    (it is logged) but the gradients are left untouched.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, mesh, norm_type)
    if max_norm <= 0:
        return norm
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    locals_ = [_local(g) for g in grads]
    if foreach is not False and locals_:
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    else:
        for g in locals_:
            g.mul_(coef.to(g.device))
    return norm


def _reduce(t: torch.Tensor, mesh: DeviceMesh | None, op) -> torch.Tensor:
    if mesh is None:
        return t
    out = _local(t).detach().clone()
    dist.all_reduce(out, op=op, group=_world_group_of(mesh))
    return out


def reduce_mean(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Mean of `t` over the ranks of `mesh` (e.g. the "dp_cp" loss axis); `t` itself
    without a mesh. SUM then divide: gloo has no AVG."""
    if mesh is None:
        return t
    return _reduce(t, mesh, dist.ReduceOp.SUM) / mesh.size()


def reduce_max(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Max of `t` over the ranks of `mesh`; `t` itself without a mesh."""
    return _reduce(t, mesh, dist.ReduceOp.MAX)
