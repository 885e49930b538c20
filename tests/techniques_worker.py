"""Build the real trainer from `titan train` flags, watch one training step, and write what
each parallelism technique left behind to ``<out_dir>/rank<R>.json``.

Usage (one process or under torchrun)::

    python tests/techniques_worker.py RUNS.json

where the file holds ``[[OUT_DIR, [flag, ...]], ...]``: several observed runs, one after another
in one process group (``train_runs_worker.one_process_group``). Each run's config is parsed
exactly as ``titan train`` parses it (recipe, then flags). Forward hooks
record, for the first call of each watched module: the output's type, dtype and DTensor
placements, the dtype of its weight during the call, and for blocks whether their parameters
are still gathered once forward returns. After the step the worker adds the static facts: the
mesh, the placements of the master parameters, the pipeline schedule and stages, the
torch.compile state of every block and, under tensor parallel, the collectives of the step by
dtype. ``tests/test_techniques_ran.py`` asserts on the result.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

# Modules whose outputs say which technique ran: norms (sequence parallel), the output
# projection (loss parallel, mixed precision), a block and two of its linears (FSDP reshard
# policy, mixed precision). Names are relative to a model part.
WATCHED = re.compile(
    r"^(norm|output|tok_embeddings|layers\.\d+|layers\.\d+\.(attention_norm|ffn_norm)"
    r"|layers\.\d+\.attention\.wq|layers\.\d+\.feed_forward\.w2)$"
)
BLOCK = re.compile(r"^layers\.\d+$")


def placements(t: torch.Tensor) -> list[str] | None:
    """A DTensor's placements with Shard dims made non-negative ("Shard(2)", "Replicate()");
    None for a plain tensor."""
    if not isinstance(t, DTensor):
        return None
    out = []
    for p in t.placements:
        if isinstance(p, Shard):
            out.append(f"Shard({p.dim % t.ndim})")
        else:
            out.append("Replicate()" if p.is_replicate() else type(p).__name__)
    return out


def describe(t: Any) -> dict[str, Any] | None:
    """Type, dtype, shape and placements of an output tensor (None for anything else)."""
    if not isinstance(t, torch.Tensor):
        return None
    return {
        "type": type(t).__name__,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "placements": placements(t),
        "mesh_dims": list(t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else None,
    }


def params_state(module: nn.Module) -> str:
    """Whether `module`'s parameters are DTensors right now: "sharded" when all are (FSDP2
    puts the sharded DTensors back when it reshards, the plain gathered tensors while
    unsharded), "unsharded" when none is, "mixed" otherwise. Meaningful under FSDP2 only:
    tensor-parallel parameters are DTensors throughout."""
    kinds = {isinstance(p, DTensor) for p in module.parameters()}
    return "mixed" if len(kinds) != 1 else ("sharded" if kinds == {True} else "unsharded")


def watch(part_index: int, name: str, module: nn.Module, seen: dict[str, Any], compiled: bool) -> None:
    """Record the first forward of `module` into `seen[key]`."""
    key = f"{part_index}:{name}"

    def pre_hook(mod, _args):
        if key in seen:
            return
        weight = getattr(mod, "weight", None)
        dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else None
        seen[key] = {"weight_dtype_in_forward": dtype}

    def post_hook(mod, _args, output):
        entry = seen.setdefault(key, {})
        if "output" in entry:
            return
        entry["output"] = describe(output)
        if BLOCK.match(name):
            # Runs after FSDP2's own post-forward hook (registered earlier), i.e. after its
            # reshard-after-forward decision.
            entry["params_after_forward"] = params_state(mod)

    # Hooks inside a compiled block would be traced into its graph: watch only outside them.
    if compiled and name.startswith("layers."):
        return
    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)


def param_layouts(part: nn.Module) -> dict[str, Any]:
    """Dtype, type and placements of a few master parameters after the step."""
    out = {}
    for name, p in part.named_parameters():
        if name in ("tok_embeddings.weight", "norm.weight", "output.weight") or name.endswith(".wq.weight"):
            out[name] = {
                "dtype": str(p.dtype).removeprefix("torch."),
                "type": "DTensor" if isinstance(p, DTensor) else "Tensor",
                "placements": placements(p),
                "mesh_dims": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else None,
            }
    return out


def pipeline_facts(trainer) -> dict[str, Any] | None:
    """Schedule class and the stage indices this rank runs (None without pipeline parallel)."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None or not trainer.parallel_dims.pp_enabled:
        return None
    # torch's schedules keep their stages in `_stages` (multi-stage) or `_stage` (single):
    # there is no public accessor, so fall back to the layer keys of the parts if they move.
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return {
        "schedule_class": type(schedule).__name__,
        "stage_indices": [s.stage_index for s in stages if s is not None],
        "num_stages": next((s.num_stages for s in stages if s is not None), None),
    }


def compile_facts(trainer) -> dict[str, Any]:
    """Which blocks carry a compiled call and what dynamo / inductor counted."""
    from torch._dynamo.utils import counters

    # nn.Module.compile stores the compiled call here; there is no public accessor.
    blocks = {
        f"{i}:{name}": getattr(m, "_compiled_call_impl", None) is not None
        for i, part in enumerate(trainer.model_parts)
        for name, m in part.named_modules()
        if BLOCK.match(name)
    }
    return {
        "blocks_compiled": blocks,
        "dynamo_stats": dict(counters["stats"]),
        "inductor": dict(counters["inductor"]),
    }


def mesh_facts(trainer) -> dict[str, Any] | None:
    """Root mesh and FSDP mesh dim names and sizes (None at world size 1)."""
    if trainer.mesh is None:
        return None
    out = {"root": dict(zip(trainer.mesh.mesh_dim_names, trainer.mesh.shape, strict=True))}
    if trainer.parallel_dims.uses_fully_shard:
        fsdp = trainer.parallel_dims.mesh("fsdp")
        out["fsdp"] = dict(zip(fsdp.mesh_dim_names, fsdp.shape, strict=True))
    return out


class CollectiveDtypes(TorchDispatchMode):
    """Counts the functional collectives of the step by op and the dtype they move (a float8
    tensor's payload: its float8 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("_c10d_functional::") and args and isinstance(args[0], torch.Tensor):
            # A float8 tensor subclass (torchao's) sends the bytes it wraps.
            payload = getattr(args[0], "_data", args[0])
            key = f"{name.split('::')[1].split('.')[0]}:{str(payload.dtype).removeprefix('torch.')}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def observe(out_dir: Path, flags: list[str]) -> None:
    """Parse the flags like `titan train`, run one watched step, write the observations."""
    from titan.train.trainer import Trainer
    from torch._dynamo.utils import counters

    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    counters.clear()  # what dynamo and inductor count belongs to this run only
    config = parse_train_args(flags)
    trainer = Trainer(config, model_spec=model_spec(config.model.name))
    try:
        seen: dict[str, Any] = {}
        for i, part in enumerate(trainer.model_parts):
            for name, module in part.named_modules():
                if WATCHED.match(name):
                    watch(i, name, module, seen, compiled=config.compile.enable)
        collectives = CollectiveDtypes()
        with collectives if "--parallelism.tensor_parallel_degree" in flags else contextlib.nullcontext():
            records = trainer.train()
        dims = trainer.parallel_dims
        facts = {
            "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            "degrees": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")},
            "mesh": mesh_facts(trainer),
            "forward": seen,
            "params": {str(i): param_layouts(part) for i, part in enumerate(trainer.model_parts)},
            "part_layers": [list(part.layers.keys()) for part in trainer.model_parts],
            "pipeline": pipeline_facts(trainer),
            "compile": compile_facts(trainer),
            "losses": [r["loss"] for r in records],
            "collectives": collectives.counts,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank{facts['rank']}.json").write_text(json.dumps(facts, indent=1))
    finally:
        trainer.close()


def main(runs_file: str) -> None:
    """Observe every run of `runs_file`, in order, in one process group."""
    from train_runs_worker import one_process_group

    runs = json.loads(Path(runs_file).read_text())
    with one_process_group():
        for out_dir, flags in runs:
            print(f"techniques_worker: run {out_dir}", file=sys.stderr, flush=True)
            observe(Path(out_dir), flags)


if __name__ == "__main__":
    main(sys.argv[1])
