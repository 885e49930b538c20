"""Pipeline parallel: split the model into stages by layer and build a schedule by name.

Splitting works on the model object itself (typically on the meta device, before any
weights exist): each stage is a deep copy with the other stages' blocks deleted from the
layer container and the first/last modules of the plan set to None, so the model's own
forward runs unchanged on its piece.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
from titan.dist.dims import ParallelDims
from titan.dist.plan import layer_container_name, sharding_plan, tied_parameter_groups

# `--parallelism.pipeline_parallel_schedule` name -> torch.distributed.pipelining class name.
# The module is imported only when a pipeline is built: it pulls in torch._dynamo (~0.5 s at
# every start of `titan`, also for runs without pipeline parallelism).
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
IN_ROUNDS = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules that run the microbatches in rounds of about pp (torch refuses an uneven split)."""


def _splits_into_rounds(microbatches: int, pp: int) -> bool:
    """Whether max(1, m // pp) equal rounds hold the m microbatches (torch's interleaved rule)."""
    return microbatches % max(1, microbatches // pp) == 0


def microbatch_count_problem(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why torch's `schedule` cannot run `microbatches` over `pp` ranks, or None: the
    interleaved schedules split the microbatches into max(1, m // pp) equal rounds; DualPipeV
    needs a microbatch per stage (its 2 x pp stages), 1F1B one per rank."""
    if schedule == "1F1B" and microbatches < pp:
        return (f"1F1B needs at least one microbatch per pipeline rank (pipeline_parallel_degree = {pp}), got "
                f"{microbatches}; raise --training.local_batch_size or lower "
                "--parallelism.pipeline_parallel_microbatch_size")
    if schedule == "DualPipeV" and microbatches < 2 * pp:
        return (f"DualPipeV needs at least as many microbatches as stages (2 x pipeline_parallel_degree = {2 * pp}), "
                f"got {microbatches}; raise --training.local_batch_size or lower "
                "--parallelism.pipeline_parallel_microbatch_size")
    if schedule in IN_ROUNDS and not _splits_into_rounds(microbatches, pp):
        rounds = max(1, microbatches // pp)
        fits = [m for m in range(pp, 4 * pp + 1) if _splits_into_rounds(m, pp)]
        return (f"{schedule} runs the {microbatches} microbatches in {rounds} equal rounds (microbatches // "
                f"pipeline_parallel_degree {pp}), which {microbatches} does not split into; run "
                f"{', '.join(map(str, fits[:6]))}, ... microbatches (--training.local_batch_size / "
                f"--parallelism.pipeline_parallel_microbatch_size)")
    return None


def even_stage_sizes(n_blocks: int, num_stages: int, first_less: int = 0, last_less: int = 0) -> list[int]:
    """Blocks of each stage when the layers are split evenly: ``n_blocks + first_less +
    last_less`` units dealt out to the stages, the first ``units % num_stages`` stages one more,
    then the first stage ``first_less`` blocks fewer (its embedding's share) and the last
    ``last_less`` fewer (the output projection's and loss's), as torchtitan splits with its
    ``pipeline_parallel_{first,last}_stage_less_layers``. The planner times and sizes stages
    by the same rule. A stage may come out empty (``stage_layer_keys`` refuses it)."""
    if num_stages == 1:
        return [n_blocks]
    base, extra = divmod(n_blocks + first_less + last_less, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[0] -= first_less
    sizes[-1] -= last_less
    return sizes


def stage_weights(config) -> tuple[int, int]:
    """``(first_less, last_less)`` of a `ParallelismConfig` (any object with the fields)."""
    return (getattr(config, "pipeline_parallel_first_stage_less_layers", 0),
            getattr(config, "pipeline_parallel_last_stage_less_layers", 0))


def stage_layer_keys(layer_keys: list[str], num_stages: int, config) -> list[list[str]]:
    """Which blocks each stage holds: from explicit split points, or evenly (earlier stages
    get the remainder; the first and last stage fewer by the config's stage weights)."""
    points = config.pipeline_parallel_split_points
    if points:
        starts = [_split_index(p, layer_keys) for p in points]
        if starts != sorted(set(starts)) or len(starts) != num_stages - 1:
            raise ValueError(f"--parallelism.pipeline_parallel_split_points={points} must name "
                             f"{num_stages - 1} distinct blocks in model order")
        bounds = [0, *starts, len(layer_keys)]
    else:
        sizes = even_stage_sizes(len(layer_keys), num_stages, *stage_weights(config))
        if min(sizes) < 1:
            first, last = stage_weights(config)
            raise ValueError(f"{num_stages} pipeline stages for {len(layer_keys)} blocks, the first stage "
                             f"{first} and the last {last} blocks lighter (--parallelism.pipeline_parallel_"
                             f"first/last_stage_less_layers), gives stages of {sizes} blocks; every stage needs one "
                             "at least: lower those, the pipeline degree or the stages per rank")
        bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
    stages = [layer_keys[bounds[s]:bounds[s + 1]] for s in range(num_stages)]
    if any(not s for s in stages):
        raise ValueError(f"{num_stages} pipeline stages for {len(layer_keys)} blocks leaves a "
                         f"stage empty; lower the pipeline degree or layers per stage")
    return stages


def configured_stage_sizes(model: nn.Module, config) -> list[int] | None:
    """Blocks of each stage where `config` (`ParallelismConfig`) splits `model`'s layers itself:
    at `pipeline_parallel_split_points`, or in stages of `pipeline_parallel_layers_per_stage`
    (raises ValueError as the engine does for a split it cannot make); None for the engine's
    even split, whose stage count follows the schedule and the degree."""
    if not (config.pipeline_parallel_split_points or config.pipeline_parallel_layers_per_stage):
        return None
    keys = list(getattr(model, layer_container_name(model)).keys())
    if config.pipeline_parallel_split_points:
        total = len(config.pipeline_parallel_split_points) + 1
    else:
        total = _stages_of_size(len(keys), config)
    return [len(stage) for stage in stage_layer_keys(keys, total, config)]


def _stages_of_size(n_layers: int, config) -> int:
    """Stages of ``pipeline_parallel_layers_per_stage`` units each: the blocks plus the first
    and last stages' weights (``..._stage_less_layers``), which the size must divide."""
    lps = config.pipeline_parallel_layers_per_stage
    first, last = stage_weights(config)
    units = n_layers + first + last
    if units % lps:
        weights = f" plus the first and last stages' {first} + {last}" if first or last else ""
        raise ValueError(f"--parallelism.pipeline_parallel_layers_per_stage={lps} must divide the model's "
                         f"{n_layers} layers{weights}")
    return units // lps


def _split_index(point: str, layer_keys: list[str]) -> int:
    key = point.rsplit(".", 1)[-1]
    if key not in layer_keys:
        raise ValueError(f"pipeline split point {point!r} is not a block of the model "
                         f"(blocks: {', '.join(layer_keys)})")
    return layer_keys.index(key)


def num_stages_for(n_layers: int, pp: int, config) -> int:
    """Total stages: explicit split points, or n_layers / layers_per_stage, or one per rank
    (two per rank for schedules that need several stages per rank)."""
    if config.pipeline_parallel_split_points:
        total = len(config.pipeline_parallel_split_points) + 1
    elif config.pipeline_parallel_layers_per_stage:
        total = _stages_of_size(n_layers, config)
    else:
        total = pp if config.pipeline_parallel_schedule in SINGLE_STAGE else 2 * pp
    _check_stage_count(total, pp, config.pipeline_parallel_schedule)
    return total


def _check_stage_count(total: int, pp: int, schedule: str) -> None:
    problem = stage_count_problem(total, pp, schedule)
    if problem:
        raise ValueError(problem)


def stage_count_problem(total: int, pp: int, schedule: str) -> str | None:
    """Why `schedule` cannot run `total` pipeline stages over `pp` ranks (the engine's check,
    one line), or None."""
    per_rank, rest = divmod(total, pp)
    if rest or per_rank < 1:
        return (f"{total} pipeline stages do not divide evenly over "
                f"pipeline_parallel_degree={pp}; adjust the layers per stage")
    if schedule in SINGLE_STAGE and per_rank != 1:
        return (f"schedule {schedule} runs one stage per rank, but {total} stages over "
                f"{pp} ranks gives {per_rank}; use Interleaved1F1B or change the split")
    if schedule in V_SHAPED and per_rank != 2:
        return f"schedule {schedule} needs exactly 2 stages per rank, got {per_rank}"
    return None


def stage_ids_of_rank(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """Stages this pipeline rank runs: looped (s % pp == rank) or V-shaped (rank, 2pp-1-rank)."""
    if schedule in V_SHAPED:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def check_pipeline_ties(model: nn.Module, pp_degree: int) -> None:
    """Refuse pipeline parallel for a model whose tied parameters (plan `tied_parameters`)
    live in modules that different stages hold, e.g. a tied embedding (first stage) and
    output projection (last stage).

    Stages are separate modules with their own optimizers and data-parallel sharding even
    where one rank runs both (ZBVZeroBubble/DualPipeV put the first and last stage on pp
    rank 0), so they cannot share a Parameter. Runs on the unsplit (meta) model, before any
    process-group work.
    """
    if pp_degree <= 1:
        return
    for group in tied_parameter_groups(model):
        homes = {_stage_home(model, name) for name in group}
        if len(homes) > 1:
            raise ValueError(
                f"--parallelism.pipeline_parallel_degree {pp_degree}: the model ties "
                f"{' and '.join(group)} (one shared parameter), but pipeline stages would hold "
                f"them apart ({', '.join(sorted(homes))}) and stages cannot share a parameter. "
                "Use --parallelism.pipeline_parallel_degree 1 (FSDP and tensor parallel keep "
                "the tie) or a model with untied embeddings (tie_word_embeddings false)")


def _stage_home(model: nn.Module, param_name: str) -> str:
    """Which part of the pipeline split holds `param_name`: "first stage", "last stage" or
    the block it belongs to (blocks may land on different stages)."""
    plan = sharding_plan(model)
    top = param_name.split(".", 1)[0]
    if top in getattr(plan, "pipeline_first", ("tok_embeddings",)):
        return "first stage"
    if top in getattr(plan, "pipeline_last", ("norm", "output")):
        return "last stage"
    container = layer_container_name(model)
    if param_name.startswith(container + "."):
        return f"block {param_name.split('.')[1]}"
    return "every stage"


def split_stage(model: nn.Module, keep: list[str], *, first: bool, last: bool) -> nn.Module:
    """A deep copy of `model` holding only the blocks `keep`, without the plan's first-stage
    modules unless `first`, nor its last-stage modules unless `last`."""
    plan = sharding_plan(model)
    stage = copy.deepcopy(model)
    container = getattr(stage, layer_container_name(model))
    for key in [k for k in container.keys() if k not in keep]:
        del container[key]
    if not first:
        for name in getattr(plan, "pipeline_first", ("tok_embeddings",)):
            setattr(stage, name, None)
    if not last:
        for name in getattr(plan, "pipeline_last", ("norm", "output")):
            setattr(stage, name, None)
    return stage


def build_pipeline(model: nn.Module, parallel_dims: ParallelDims, *, parallelism,
                   activation_checkpoint, compile, loss_fn: Callable, local_batch_size: int,
                   device: torch.device, mp_policy=None, scale_grads: bool = True,
                   tensor_parallel_overrides=None):
    """Split `model` into this rank's stages, parallelize each, and build the schedule.

    Returns (schedule, model_parts, has_first_stage, has_last_stage). Drive it with
    `schedule.step(inputs)` on the first stage, `schedule.step(target=labels, losses=list)`
    on the last, `schedule.step()` elsewhere. Microbatches: local_batch_size /
    pipeline_parallel_microbatch_size; `loss_fn(output, target)` runs per microbatch on the
    last stage; with `scale_grads` the schedule divides gradients by the number of
    microbatches (right for a per-microbatch mean loss; pass False when the loss is already
    normalized over the whole batch). `mp_policy` is passed on to FSDP2 and
    `tensor_parallel_overrides` to tensor parallel.
    """
    from titan.dist.parallelize import parallelize

    dims, cfg = parallel_dims, parallelism
    check_pipeline_ties(model, dims.pp)
    name = cfg.pipeline_parallel_schedule
    keys = list(getattr(model, layer_container_name(model)).keys())
    total = num_stages_for(len(keys), dims.pp, cfg)
    layers = stage_layer_keys(keys, total, cfg)
    n_micro = _microbatches(local_batch_size, cfg)
    from torch.distributed import pipelining

    pp_rank, pp_mesh = dims.coords["pp"], dims.mesh("pp")
    parts, stages = [], []
    for sid in stage_ids_of_rank(pp_rank, dims.pp, total, name):
        part = split_stage(model, layers[sid], first=sid == 0, last=sid == total - 1)
        parallelize(part, dims, dims.mesh("root"), parallelism=cfg,
                    activation_checkpoint=activation_checkpoint, compile=compile,
                    mp_policy=mp_policy, tensor_parallel_overrides=tensor_parallel_overrides)
        parts.append(part)
        stage = pipelining.PipelineStage(part, sid, total, device, group=pp_mesh.get_group(),
                                         get_mesh=_mesh_lookup(dims))
        _keep_buffers_through_metadata_inference(stage)
        stages.append(stage)
    schedule_cls = getattr(pipelining, SCHEDULES[name])
    target = stages[0] if name in SINGLE_STAGE else stages
    schedule = schedule_cls(target, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=scale_grads)
    _run_steps_under_loss_parallel(schedule, dims, cfg)
    ids = [s.stage_index for s in stages]
    return schedule, parts, 0 in ids, total - 1 in ids


_METADATA_INFERENCE = ("_forward_metadata_inference", "_shape_inference")
"""The private `PipelineStage` methods (newer torch, older torch) that run the stage's forward
once, on the first step, to learn its output shapes."""


def _keep_buffers_through_metadata_inference(stage) -> None:
    """Restore the stage module's buffers after torch's metadata-inference forward. On the
    first step torch runs the stage once more than the schedule's microbatches to learn its
    output shapes; state the forward accumulates in buffers (an MoE router's per-expert
    token counts, which move the load-balancing bias after the step) must not count it:
    it did, and a DeepSeek-V3 debug run under PP 2 moved its expert bias from 5 microbatches'
    counts instead of 4 and drifted from one process from step 3 on."""
    for name in _METADATA_INFERENCE:
        infer = getattr(stage, name, None)
        if infer is None:
            continue

        def infer_keeping_buffers(*args, _infer=infer, **kwargs):
            saved = [(buf, buf.detach().clone()) for buf in stage.submod.buffers()]
            try:
                return _infer(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buf, value in saved:
                        # Only what the forward changed: a copy into a buffer autograd saved
                        # (a RoPE table) would invalidate the backward torch infers next.
                        if not torch.equal(buf, value):
                            buf.copy_(value)

        setattr(stage, name, infer_keeping_buffers)
        return


def _run_steps_under_loss_parallel(schedule, dims: ParallelDims, config) -> None:
    """The schedule computes the loss and its backward inside `step`: with TP loss parallel
    both must run in the loss-parallel context, so wrap this schedule's `step` in it."""
    from titan.dist.tensor_parallel import loss_parallel_context

    if not (dims.tp_enabled and config.enable_loss_parallel):
        return
    step = schedule.step

    def step_in_loss_parallel(*args, **kwargs):
        with loss_parallel_context(dims, config):
            return step(*args, **kwargs)

    schedule.step = step_in_loss_parallel


def _mesh_lookup(dims: ParallelDims):
    """Callback for the stage to find the mesh of DTensor activations it receives (e.g.
    sequence-parallel hidden states on the "tp" axis) by their axis names."""

    def get_mesh(mesh_dim_names, mesh_layout):
        if len(mesh_dim_names) == 1:
            return dims.mesh(mesh_dim_names[0])
        return dims.mesh("root")[tuple(mesh_dim_names)]

    return get_mesh


def _microbatches(local_batch_size: int, config) -> int:
    mbs = config.pipeline_parallel_microbatch_size
    if local_batch_size % mbs:
        raise ValueError(f"local_batch_size={local_batch_size} must be divisible by "
                         f"--parallelism.pipeline_parallel_microbatch_size={mbs}")
    problem = microbatch_count_problem(config.pipeline_parallel_schedule, config.pipeline_parallel_degree,
                                       local_batch_size // mbs)
    if problem:
        raise ValueError(problem)
    return local_batch_size // mbs
