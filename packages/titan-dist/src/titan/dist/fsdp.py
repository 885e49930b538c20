"""Data parallelism: FSDP2 (per block, then the root), HSDP, and DDP."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan.dist.config import ZERO_BUBBLE_SCHEDULES
from titan.dist.plan import match_modules, sharding_plan, tied_parameter_groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes the `--training.mixed_precision_*` flags name."""


def mixed_precision_policy(param_dtype: str = "float32", reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2 policy from dtype names ("float32", "bfloat16", "float16"): parameters are cast to
    `param_dtype` for compute, gradients reduced in `reduce_dtype`; master weights stay as
    they are."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def reshard_after_forward(config, *, pp_enabled: bool) -> bool:
    """Whether FSDP frees a block's gathered params after its forward under
    `config.fsdp_reshard_after_forward` (`reshards_after_forward`)."""
    return reshards_after_forward(config.fsdp_reshard_after_forward, pp_enabled=pp_enabled)


def reshards_after_forward(policy: str, *, pp_enabled: bool) -> bool:
    """"always" / "never" as named; "default" frees gathered params after forward except under
    pipeline parallel, where every microbatch's forward would gather them again."""
    return {"always": True, "never": False}.get(policy, not pp_enabled)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Submodules the plan names as FSDP units (default: every block), in model order.

    A unit holding some but not all names of a tied parameter (the plan's `tied_parameters`,
    e.g. an embedding whose matrix is also the output projection) is left out: one Parameter
    cannot belong to two FSDP units, and two sharded copies would train apart. Its parameters
    fall to the root unit, which holds every name of the tie and manages the shared
    Parameter once (FSDP2 re-registers it on every module that uses it).
    """
    plan = sharding_plan(model)
    patterns = getattr(plan, "fsdp_units", None) or ("layers.*",)
    ties = tied_parameter_groups(model)
    return [m for pattern in patterns for name, m in match_modules(model, pattern)
            if m is not None and not splits_a_tie(name, ties)]


def splits_a_tie(module_name: str, ties: tuple[tuple[str, ...], ...]) -> bool:
    """Whether the submodule `module_name` holds some but not all names of a tied group."""
    prefix = module_name + "."
    for group in ties:
        inside = sum(name.startswith(prefix) for name in group)
        if 0 < inside < len(group):
            return True
    return False


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config, *, pp_enabled: bool = False,
               mp_policy: MixedPrecisionPolicy | None = None,
               expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard parameters with FSDP2: expert units, then each plan unit (block), then the root.

    A 1-D `mesh` shards over it (FSDP); a 2-D (dp_replicate, dp_shard_cp) mesh replicates
    over the first axis and shards over the second (HSDP). One all-gather per unit lets
    block i+1's gather overlap block i's compute.

    With expert parallel, `expert_mesh` (ParallelDims' "expert_fsdp") shards the plan's
    `expert_modules`, each its own unit wrapped before the blocks (a block unit then skips
    their parameters). Their gradients are averaged over that mesh like any unit's; the EP
    wrapper has already divided them by the EP degree (see `titan.dist.expert_parallel`).
    """
    _check_cpu_offload(config, mesh)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  offload_policy=CPUOffloadPolicy() if config.fsdp_cpu_offload else OffloadPolicy())
    reshard = reshard_after_forward(config, pp_enabled=pp_enabled)
    if expert_mesh is not None:
        _wrap_expert_units(model, dict(kwargs, mesh=expert_mesh), reshard)
    for unit in fsdp_units(model):
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    # The root's params (embedding, final norm, output) are needed right at the start of
    # backward, so keep them gathered unless the user asked for "always".
    fully_shard(model, reshard_after_forward=config.fsdp_reshard_after_forward == "always",
                **kwargs)
    return model


def _wrap_expert_units(model: nn.Module, kwargs: dict, reshard: bool) -> None:
    """One FSDP unit per grouped-experts module, on the expert mesh.

    FSDP shards dim 0 by default, but an EP rank may hold fewer experts than the expert mesh
    has shard ranks (e.g. 256 experts, EP 64, 8 shard ranks: 4 local experts); chunking 4 rows
    over 8 ranks would leave half of them empty. Such weights are sharded along dim 1 (hidden
    or model dim) instead when it divides evenly (FSDP2 needs that for dims other than 0).
    """
    from titan.dist.expert_parallel import expert_modules

    shards = kwargs["mesh"].shape[-1]  # the shard axis (the last one under HSDP)

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        uneven_experts = local.shape[0] % shards != 0
        return Shard(1) if uneven_experts and local.shape[1] % shards == 0 else Shard(0)

    for _, experts in expert_modules(model):
        fully_shard(experts, reshard_after_forward=reshard, shard_placement_fn=placement, **kwargs)


def check_cpu_offload_has_fsdp(parallelism, dims) -> None:
    """`--parallelism.fsdp_cpu_offload` is FSDP2's: a layout without FSDP (one data-parallel
    rank, or DDP) would silently keep every state on the device."""
    if getattr(parallelism, "fsdp_cpu_offload", False) and not dims.uses_fully_shard:
        raise ValueError(
            "--parallelism.fsdp_cpu_offload offloads FSDP2's sharded params, grads and optimizer states, "
            f"and this layout has no FSDP (data_parallel_shard_degree={dims.dp_shard}, "
            f"data_parallel_replicate_degree={dims.dp_replicate}, tensor_parallel_degree={dims.tp}): shard the parameters "
            "(--parallelism.data_parallel_shard_degree > 1) or drop the flag")


def check_reshard_under_zero_bubble(parallelism, dims) -> None:
    """Refuse FSDP's `--parallelism.fsdp_reshard_after_forward always` under a zero-bubble
    pipeline schedule, before anything is built (ValueError naming the flags). Those
    schedules compute a microbatch's weight gradients in a pass after its input gradients,
    when FSDP2's backward hooks have already run for it, and resharding after each forward
    drops them: a 4-rank FSDP 2 x PP 2 run measured a gradient norm of 0.20 where 1.29 is
    right (InterleavedZeroBubble, ZBVZeroBubble and DualPipeV alike). The default policy
    keeps a stage's parameters gathered for the whole step, and its gradients are right."""
    if (dims.pp_enabled and dims.uses_fully_shard and parallelism.fsdp_reshard_after_forward == "always"
            and parallelism.pipeline_parallel_schedule in ZERO_BUBBLE_SCHEDULES):
        raise ValueError(
            f"--parallelism.fsdp_reshard_after_forward always frees each stage's gathered parameters after every "
            f"forward, and {parallelism.pipeline_parallel_schedule} computes the weight gradients in a later pass, "
            "after FSDP's backward hooks: they would be lost. Use the default policy (a stage's parameters kept "
            "gathered for the step) or a schedule without a split backward (1F1B, Interleaved1F1B, GPipe, LoopedBFS)")


def _check_cpu_offload(config, mesh: DeviceMesh) -> None:
    """CPU offload moves sharded state from an accelerator to pinned host memory; on a CPU
    mesh the state is already there and FSDP2's pinning needs an accelerator."""
    if config.fsdp_cpu_offload and mesh.device_type == "cpu":
        raise ValueError(
            "--parallelism.fsdp_cpu_offload keeps sharded params, grads and optimizer states in "
            "host memory while computing on an accelerator; this run is on CPU, where they are "
            "in host memory already. Drop the flag.")


def apply_ddp(model: nn.Module, mesh: DeviceMesh, config) -> nn.Module:
    """Replicate the model over `mesh` and all-reduce gradients (DDP, composable form)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    return model


@contextlib.contextmanager
def replicas_sync_later(model_parts: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: the backward leaves the data-parallel replicas' gradient all-reduce to a later
    backward, for every microbatch of a gradient-accumulation step but the last. HSDP still
    reduce-scatters each microbatch inside its shard group and accumulates the shards (FSDP2's
    `set_requires_all_reduce`); DDP accumulates its local gradients (`set_requires_gradient_sync`).
    The last microbatch's backward, outside, all-reduces the sum once: the same gradients, the
    replicas' traffic once per step instead of once per microbatch. Plain FSDP and modules
    without data parallelism are left alone (FSDP must reduce-scatter every microbatch, or hold
    whole unsharded gradients)."""
    toggles = [toggle for part in model_parts if (toggle := _replica_sync_toggle(part)) is not None]
    for toggle in toggles:
        toggle(False)
    try:
        yield
    finally:
        for toggle in toggles:
            toggle(True)


def _replica_sync_toggle(module: nn.Module) -> Callable[[bool], None] | None:
    """The switch of `module`'s replicas' all-reduce: FSDP2's (a no-op without replicas, HSDP's
    otherwise), DDP's (`replicate` gives the module `set_requires_gradient_sync`), or None."""
    if isinstance(module, FSDPModule):
        return lambda on: module.set_requires_all_reduce(on, recurse=True)
    if callable(getattr(module, "set_requires_gradient_sync", None)):
        return module.set_requires_gradient_sync
    return None
