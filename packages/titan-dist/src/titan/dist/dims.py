"""`ParallelDims`: the parallel degrees, their validation, and the named device mesh.

Mesh layout (outermost first): pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is
innermost so its heavy collectives stay on the fastest links; pipeline outermost because it
only sends activations between neighbours. Every axis is always present (size 1 when unused)
so callers can name any axis without asking whether it is enabled. Flattened views:

- "dp"          = dp_replicate x dp_shard: the batch axis (data loader, batch-size maths);
- "dp_shard_cp" = dp_shard x cp: the axis FSDP shards parameters over (CP ranks hold the
  same weights, so they join the shard group);
- "dp_cp"       = dp_replicate x dp_shard x cp: the loss / metric reduction axis.

Expert parallelism (ep > 1) borrows its ranks from "dp_shard_cp": that axis is unflattened
into ("dp_shard_mod_ep", "ep"), ep innermost (so with context parallel the EP group is the CP
group first). The model then has two regions:

- dense parameters are FSDP-sharded over "dp_shard_cp" (as without EP), HSDP-replicated over
  "dp_replicate";
- expert parameters are split by expert over "ep" (each rank owns n_experts / ep experts, a
  DTensor Shard(0) on "ep") and FSDP-sharded over the remaining "dp_shard_mod_ep" =
  dp_shard x cp / ep ranks ("expert_fsdp"; 2-D (dp_replicate, dp_shard_mod_ep) under HSDP).

The constraint between them: ep x dp_shard_mod_ep = dp_shard x cp, i.e. ep divides
dp_shard x cp, and both regions see the same dp_replicate x dp_shard x cp ranks per
(pp, tp) coordinate; tp and pp are orthogonal to EP (each TP/PP coordinate runs its own EP
groups, and experts are never tensor-parallel).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
EXPERT_VIEWS = ("ep", "dp_shard_mod_ep", "expert_fsdp")


@dataclass
class ParallelDims:
    """The parallel degrees of a job and the mesh built from them.

    `dp_shard=-1` is resolved to the ranks left over by the other degrees. Construction
    validates that the degrees multiply to `world_size` (naming every degree on failure).
    `rank` defaults to this process's rank (0 without a process group).
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    rank: int | None = None
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel degree {name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == -1:
            self.dp_shard = self._resolve_dp_shard()
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}")
        self._check_product()
        self._check_ep()

    @classmethod
    def from_config(cls, cfg, world_size: int) -> ParallelDims:
        """Build from a `ParallelismConfig` (read by attribute) and the launched world size."""
        return cls(
            dp_replicate=cfg.data_parallel_replicate_degree,
            dp_shard=cfg.data_parallel_shard_degree,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            pp=cfg.pipeline_parallel_degree,
            ep=cfg.expert_parallel_degree,
            world_size=world_size,
        )

    def _degrees_text(self) -> str:
        return (f"data_parallel_replicate_degree={self.dp_replicate} x "
                f"data_parallel_shard_degree={self.dp_shard} x context_parallel_degree={self.cp} "
                f"x tensor_parallel_degree={self.tp} x pipeline_parallel_degree={self.pp}")

    def _resolve_dp_shard(self) -> int:
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.world_size % others:
            raise ValueError(
                f"cannot fill data_parallel_shard_degree=-1: world size {self.world_size} is not "
                f"divisible by data_parallel_replicate_degree={self.dp_replicate} x "
                f"context_parallel_degree={self.cp} x tensor_parallel_degree={self.tp} x "
                f"pipeline_parallel_degree={self.pp} = {others}; change the degrees or the "
                f"number of processes (NGPU / --nproc_per_node)")
        return self.world_size // others

    def _check_product(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"{self._degrees_text()} = {product}, but the world size is {self.world_size}; "
                f"make the degrees multiply to {self.world_size} (or set "
                f"--parallelism.data_parallel_shard_degree -1 to use the rest)")

    def _check_ep(self) -> None:
        # Experts are spread over ranks that otherwise hold the same weights: dp_shard x cp.
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"expert_parallel_degree={self.ep} must divide data_parallel_shard_degree="
                f"{self.dp_shard} x context_parallel_degree={self.cp} = {self.dp_shard * self.cp} "
                f"(experts are spread over those ranks, the rest FSDP-shard them); with "
                f"{self._degrees_text()} and expert_parallel_degree={self.ep}, pick an "
                f"expert_parallel_degree that divides {self.dp_shard * self.cp} or raise "
                f"--parallelism.data_parallel_shard_degree")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def sequence_multiple(self) -> int:
        """What every sequence length must divide by: 2 x the context-parallel degree (CP's
        head-tail load balancing cuts a sequence into that many chunks), 1 without CP."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def dp_enabled(self) -> bool:
        """Any data parallelism (replicate or shard)."""
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Replicated data parallelism (DDP, or the outer axis of HSDP)."""
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Sharded data parallelism along dp_shard."""
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded with FSDP2 (over dp_shard x cp)."""
        return self.dp_shard * self.cp > 1

    @property
    def uses_fully_shard(self) -> bool:
        """`parallelize` wraps the model with FSDP2's `fully_shard`: when parameters are
        sharded, and also to replicate tensor-parallel DTensor params (torch's DDP cannot take
        DTensors) or pipeline stages (torch's schedules defer the gradient sync of FSDP2
        modules to the last microbatch; composable DDP's reducer expects each forward's
        backward before the next forward and mis-syncs a schedule's interleaved microbatches:
        measured 0.3% off the true gradient norm under 1F1B, 24% under ZBVZeroBubble). Only
        then does FSDP2's mixed-precision policy apply."""
        return self.fsdp_enabled or (self.dp_replicate_enabled and (self.tp_enabled or self.pp_enabled))

    @property
    def tp_enabled(self) -> bool:
        """Tensor parallelism is on."""
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        """Pipeline parallelism is on."""
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        """Context parallelism is on."""
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        """Expert parallelism is on."""
        return self.ep > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks that FSDP-shard each expert: dp_shard x cp / ep (dp_shard x cp without EP)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_world_size(self) -> int:
        """Size of the batch axis (dp_replicate x dp_shard): how many distinct batches a step
        sees. The data loader uses it together with `dp_rank`."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one batch: cp x tp x pp."""
        return self.cp * self.tp * self.pp

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every mesh axis (row-major over AXES)."""
        rank = self._rank()
        sizes = dict(zip(AXES, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            out[axis] = rank % sizes[axis]
            rank //= sizes[axis]
        return {axis: out[axis] for axis in AXES}

    @property
    def dp_rank(self) -> int:
        """This rank's index on the batch axis, in [0, dp_world_size)."""
        c = self.coords
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        return dist.get_rank() if dist.is_initialized() else 0

    # --- the mesh --------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the named mesh (axes pp, dp_replicate, dp_shard, cp, tp) plus the flattened
        views "dp", "dp_shard_cp", "dp_cp", and with EP the expert views "ep",
        "dp_shard_mod_ep" and "expert_fsdp". Returns None at world size 1 (no process group).

        The flattened views are kept here (see `mesh`): torch warns when they are re-sliced
        from the root mesh.
        """
        if self.world_size == 1:
            return None
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        self._meshes = {"root": root}
        for name, axes in FLATTENED.items():
            self._meshes[name] = root[axes]._flatten(name)
        if self.ep > 1:
            self._build_expert_meshes()
        return root

    def process_groups(self) -> list:
        """Every process group of the mesh and its views (empty before `build_mesh`, or at
        world size 1)."""
        meshes = getattr(self, "_meshes", None) or {}
        groups = {}
        for mesh in meshes.values():
            for group in mesh.get_all_groups():
                groups[id(group)] = group
        return list(groups.values())

    def _build_expert_meshes(self) -> None:
        """Split "dp_shard_cp" into ("dp_shard_mod_ep", "ep"), ep innermost, on the same root
        mesh (FSDP2 concatenates the expert FSDP mesh with the "ep" mesh of the expert
        DTensors, which needs one root)."""
        sizes, names = (self.dp_shard_mod_ep, self.ep), ("dp_shard_mod_ep", "ep")
        if self.dp_replicate == 1:
            experts = self._meshes["dp_shard_cp"]._unflatten(0, sizes, names)
            self._meshes["expert_fsdp"] = experts["dp_shard_mod_ep"]
        else:
            experts = self._fsdp_mesh()._unflatten("dp_shard_cp", sizes, names)
            self._meshes["expert_fsdp"] = experts["dp_replicate", "dp_shard_mod_ep"]
        self._meshes["ep"] = experts["ep"]
        self._meshes["dp_shard_mod_ep"] = experts["dp_shard_mod_ep"]

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named view of the built mesh: an axis ("tp", ...), a flattened view ("dp",
        "dp_shard_cp", "dp_cp"), "root", or "fsdp": the mesh FSDP2 shards over (1-D
        dp_shard_cp, or 2-D (dp_replicate, dp_shard_cp) for HSDP). With EP also "ep" (the
        expert-parallel group), "dp_shard_mod_ep" and "expert_fsdp" (the mesh FSDP2 shards
        expert parameters over: 1-D dp_shard_mod_ep, or 2-D (dp_replicate, dp_shard_mod_ep)).
        None at world size 1."""
        if not self._meshes:
            if self.world_size == 1:
                return None
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        if name in self._meshes:
            return self._meshes[name]
        if name == "fsdp":
            return self._fsdp_mesh()
        if name in AXES:
            return self._meshes["root"][name]
        if name in EXPERT_VIEWS:
            raise KeyError(f"mesh view {name!r} exists only with expert_parallel_degree > 1 "
                           f"(it is {self.ep})")
        raise KeyError(f"unknown mesh view {name!r}; use one of "
                       f"{AXES + tuple(FLATTENED) + EXPERT_VIEWS}")

    def _fsdp_mesh(self) -> DeviceMesh:
        if self.dp_replicate == 1:
            return self._meshes["dp_shard_cp"]
        with warnings.catch_warnings():
            # Only way to get (dp_replicate, flattened dp_shard_cp) as one 2-D mesh in 2.13.
            warnings.simplefilter("ignore")
            mesh = self._meshes["root"]["dp_replicate", "dp_shard_cp"]
        self._meshes["fsdp"] = mesh
        return mesh

    # --- model-dependent checks ------------------------------------------------------------
    def validate_model(self, *, n_layers: int, seq_len: int, global_batch_size: int, local_batch_size: int,
                       tensor_parallel_divisible: Mapping[str, int] | None = None,
                       expert_parallel_divisible: Mapping[str, int] | None = None) -> None:
        """Check the model and batch shapes against the degrees before any work starts.

        `tensor_parallel_divisible` / `expert_parallel_divisible`: the sizes (by name) the TP /
        EP degree must divide, as the model's sharding plan declares them. Raises ValueError
        naming the values and the fix.
        """
        problems = self._divisibility_problems("tensor_parallel_degree", self.tp, tensor_parallel_divisible or {})
        problems += self._divisibility_problems("expert_parallel_degree", self.ep, expert_parallel_divisible or {})
        if self.pp > n_layers:
            problems.append(f"pipeline_parallel_degree={self.pp} exceeds the model's {n_layers} "
                            f"layers; every stage needs at least one layer")
        problems += self._batch_problems(seq_len, global_batch_size, local_batch_size)
        if problems:
            raise ValueError("invalid parallel configuration:\n  - " + "\n  - ".join(problems))

    @staticmethod
    def _divisibility_problems(flag: str, degree: int, sizes: Mapping[str, int]) -> list[str]:
        return [f"{flag}={degree} must divide the model's {name}={size}; pick a divisor of {size}"
                for name, size in sizes.items() if size % degree]

    def _batch_problems(self, seq_len: int, global_batch: int, local_batch: int) -> list[str]:
        out = []
        if seq_len % self.sequence_multiple:
            out.append(f"seq_len={seq_len} must be divisible by 2 x context_parallel_degree = "
                       f"{self.sequence_multiple} (head-tail load balancing cuts it into {self.sequence_multiple} "
                       f"chunks); change --training.seq_len")
        if local_batch < 1:
            out.append(f"local_batch_size={local_batch} must be >= 1")
        elif global_batch > 0 and global_batch % (local_batch * self.dp_world_size):
            out.append(f"global_batch_size={global_batch} must be divisible by "
                       f"local_batch_size={local_batch} x data-parallel size "
                       f"{self.dp_world_size} = {local_batch * self.dp_world_size}; "
                       f"change --training.global_batch_size or --training.local_batch_size")
        return out
