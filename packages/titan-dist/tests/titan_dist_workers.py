"""Functions run inside spawned gloo ranks (must be importable by the child processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from titan.dist import ParallelDims, clip_grad_norm_, reduce_max, reduce_mean
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def mesh_and_reductions(rank: int, world_size: int) -> dict:
    """Build a dp_shard x tp mesh, read every view, reduce metrics, clip a mixed grad set."""
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1,
                        world_size=world_size)
    root = dims.build_mesh("cpu")
    out = {
        "names": root.mesh_dim_names,
        "sizes": {n: dims.mesh(n).size() for n in ("pp", "dp_replicate", "dp_shard", "cp",
                                                   "tp", "dp", "dp_shard_cp", "dp_cp", "fsdp")},
        "dp_rank": dims.dp_rank,
        "mesh_dp_rank": dims.mesh("dp").get_local_rank(),
        "mean": reduce_mean(torch.tensor(float(rank)), root).item(),
        "max": reduce_max(torch.tensor(float(rank)), dims.mesh("dp_cp")).item(),
    }
    # Same full gradients on every rank: one sharded on tp, one replicated (DTensor),
    # one plain tensor, and one Partial sum over tp (what a sequence-parallel norm weight's
    # gradient is under TP without FSDP). The mesh-wide norm must equal the single-process norm.
    torch.manual_seed(0)
    full = [torch.randn(8, 4), torch.randn(5), torch.randn(3, 3), torch.randn(6)]
    out["expected_norm"] = torch.cat([g.flatten() for g in full]).norm().item()
    tp = dims.mesh("tp")
    share = (tp.get_local_rank() + 1) / 3  # 1/3 + 2/3: the ranks' pieces sum to full[3]
    grads = [distribute_tensor(full[0], tp, [Shard(0)]),
             distribute_tensor(full[1], tp, [Replicate()]), full[2].clone(),
             DTensor.from_local(full[3] * share, tp, [Partial()], run_check=False)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    out["full"] = [g.clone() for g in full]  # distribute_tensor may share storage with them
    out["norm"] = clip_grad_norm_(params, 1.0, mesh=root).item()
    out["clipped"] = [_whole(p.grad) for p in params]
    dist.barrier()
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (DTensor) gradient; a plain tensor as it is on this rank."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def clip_on_dp_mesh(rank: int, world_size: int) -> dict:
    """Clip on a dp_shard 2 mesh: an unevenly row-sharded gradient (5 rows over 2 ranks, as
    FSDP shards), a replicated one and a plain one; the full gradients are the same on every
    rank (seeded), so the test can clip them by hand."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world_size)
    root = dims.build_mesh("cpu")
    dp = dims.mesh("dp_shard")
    torch.manual_seed(1)
    full = [torch.randn(5, 3), torch.randn(4), torch.randn(2, 2)]
    grads = [distribute_tensor(full[0], dp, [Shard(0)]), distribute_tensor(full[1], dp, [Replicate()]),
             full[2].clone()]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    full = [g.clone() for g in full]  # distribute_tensor may share storage with them
    norm = clip_grad_norm_(params, 0.5, mesh=root).item()
    out = {"dp_size": dp.size(), "norm": norm, "max_norm": 0.5, "full": full,
           "local_rows": params[0].grad.to_local().shape[0], "clipped": [_whole(p.grad) for p in params]}
    dist.barrier()
    return out


def _parts_state(parts) -> dict:
    from titan_dist_testlib import full_state

    out = {}
    for part in parts:
        out.update(full_state(part))
    return out


def _dp_slice(dims, *tensors):
    per = tensors[0].shape[0] // dims.dp_world_size
    start = dims.dp_rank * per
    return [t[start:start + per] for t in tensors]


def train_case(case: dict, steps: int = 3, lr: float = 0.5) -> dict:
    """Train the tiny model under one parallel configuration, the way a trainer would:
    slice the batch by dp rank, shard it along the sequence for CP, run PP through the
    schedule, compute the loss under loss parallel, clip nothing, reduce the loss metric."""
    import titan_dist_testlib as lib
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelismConfig, parallelize
    from titan.dist.context_parallel import shard_batch_for_context_parallel
    from titan.dist.pipeline import build_pipeline
    from titan.dist.tensor_parallel import loss_parallel_context

    pcfg = ParallelismConfig(**case.get("parallelism", {}))
    ac = ActivationCheckpointConfig(**case.get("ac", {}))
    comp = CompileConfig(**case.get("compile", {}))
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    root = dims.build_mesh("cpu")
    model = lib.make_model()
    local_batch = lib.BATCH // dims.dp_world_size
    if dims.pp_enabled:
        schedule, parts, first, last = build_pipeline(
            model, dims, parallelism=pcfg, activation_checkpoint=ac, compile=comp,
            loss_fn=lib.loss_fn, local_batch_size=local_batch, device=torch.device("cpu"))
    else:
        parts = [parallelize(model, dims, root, parallelism=pcfg, activation_checkpoint=ac,
                             compile=comp)]
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=lr)
    losses = []
    for inputs, labels in lib.make_batches(steps):
        inputs, labels = _dp_slice(dims, inputs, labels)
        inputs, labels, positions = shard_batch_for_context_parallel(
            dims.mesh("cp") if dims.cp_enabled else None, inputs, labels)
        if dims.pp_enabled:
            loss = _pp_step(schedule, first, last, inputs, labels, dims)
        else:
            with loss_parallel_context(dims, pcfg):
                loss = lib.loss_fn(parts[0](inputs, positions), labels)
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(reduce_mean(loss.detach(), dims.mesh("dp_cp")).item())
    state = _parts_state(parts)
    dist.barrier()
    return {"losses": losses, "state": state}


def _pp_step(schedule, first, last, inputs, labels, dims):
    """One pipeline step; the last stage's mean microbatch loss is sent to every pp rank."""
    step_losses: list = []
    kwargs = {}
    if last:
        kwargs = {"target": labels, "losses": step_losses}
    if first:
        schedule.step(inputs, **kwargs)
    else:
        schedule.step(**kwargs)
    from torch.distributed.tensor import DTensor

    # Under TP loss parallel the per-microbatch losses are replicated DTensors.
    step_losses = [x.to_local() if isinstance(x, DTensor) else x for x in step_losses]
    loss = torch.stack(step_losses).mean().detach() if last else torch.zeros(())
    # Only the last stage has the loss: share it over the pp axis (sum of one non-zero).
    dist.all_reduce(loss, group=dims.mesh("pp").get_group())
    return loss


def train_cases(rank: int, world_size: int, cases: list) -> list:
    """Several configurations in one process group (spawning costs more than training)."""
    return [train_case(case) for case in cases]


def mesh_and_clipping(rank: int, world_size: int) -> tuple[dict, dict]:
    """Both checks above in one pair of processes (spawning ranks is the slow part)."""
    return mesh_and_reductions(rank, world_size), clip_on_dp_mesh(rank, world_size)


def replicas_sync_later_case(rank: int, world_size: int) -> dict:
    """Two microbatches of different data per rank under DDP and under HSDP (2 replicas of
    one shard): each rank's gradients after the first backward (inside `replicas_sync_later`)
    and after the second (outside), and what the two microbatches' gradients sum to."""
    from titan.dist import apply_ddp, replicas_sync_later
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name in ("ddp", "hsdp"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        reference = [p.detach().clone() for p in model.parameters()]
        if name == "ddp":
            apply_ddp(model, init_device_mesh("cpu", (world_size,)), None)
        else:  # 2 replicas of a 1-rank shard group: HSDP's all-reduce, no reduce-scatter traffic
            fully_shard(model, mesh=init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard")))
        g = torch.Generator().manual_seed(100 + rank)
        batches = [torch.randn(3, 4, generator=g) for _ in range(2)]
        with replicas_sync_later([model]):
            model(batches[0]).square().sum().backward()
        # HSDP keeps the reduce-scattered sum inside FSDP until its all-reduce: no .grad yet.
        out[f"{name}_first"] = [None if p.grad is None else _whole(p.grad) for p in model.parameters()]
        model(batches[1]).square().sum().backward()
        out[f"{name}_last"] = [_whole(p.grad) for p in model.parameters()]
        # This rank's own gradient sum, by hand on an unwrapped copy.
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        with torch.no_grad():
            for p, r in zip(plain.parameters(), reference, strict=True):
                p.copy_(r)
        for batch in batches:
            plain(batch).square().sum().backward()
        out[f"{name}_own_sum"] = [p.grad.clone() for p in plain.parameters()]
        dist.barrier()
    return out


def abort_once(rank: int, world_size: int, marker_dir: str) -> int:
    """Rank 0 dies of SIGABRT (as a native double free does) on every run until `marker_dir`
    holds a marker, which each abort leaves: the first run crashes, a rerun does not."""
    import os

    marker = os.path.join(marker_dir, "aborted")
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return rank


def always_abort(rank: int, world_size: int) -> int:
    """Rank 0 dies of SIGABRT on every run."""
    import os

    if rank == 0:
        os.abort()
    return rank
