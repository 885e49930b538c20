"""``titan plan``: rank the parallel layouts of a recipe's model for a cluster you do not have.

The recipe and its flags resolve exactly as for ``titan train``; the model is built once on
the meta device and described to ``titan.dist.planner`` (which parameters TP shards or
replicates, the routed experts, FLOPs per token). Every layout the engine would accept is
predicted (memory per rank, step time) and the fastest that fit are printed with the exact
``titan train`` flags of each; ``--verify N`` also runs the real dry run of the first N.
Layout flags given on the command line (``--parallelism.tensor_parallel_degree 8``,
``--activation_checkpoint.mode full``, ...) pin those choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Sequence

import torch
from titan.dist.compile import check_compile_options
from titan.dist.config import ActivationCheckpointConfig
from titan.dist.dry_run import (
    TIMED_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    measure_block_units,
    validate_against_model,
    zero_bubble_timeable,
)
from titan.dist.fsdp import DTYPES, check_reshard_under_zero_bubble
from titan.dist.pipeline import configured_stage_sizes, stage_weights
from titan.dist.planner import (
    HARDWARE,
    Hardware,
    Layout,
    ModelFacts,
    Prediction,
    Workload,
    enumerate_layouts,
    layout_dims,
    parse_gpus,
    rank_layouts,
)
from titan.models.common.moe import moe_modules
from titan.train.config import TrainerConfig
from titan.train.quantize import check_quantize_layout, float8_available, float8_linears

from titan.recipes.dry_run import (
    converting,
    float8_tp_applies,
    float8_tp_casting,
    model_builder,
    model_key,
    run_dry_run,
)

USAGE = ("titan plan --gpus <N>x<" + "|".join(HARDWARE) + "> [--config RECIPE] [--nodes K] "
         "[--global_batch_tokens T] [--top 10] [--json] [--verify N] [--memory_headroom 0.1] "
         "[--hardware.FIELD VALUE ...] [--section.field VALUE ...]")


def parse_plan_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The planner's own flags, and the rest (recipe flags for ``parse_train_args``)."""
    parser = argparse.ArgumentParser(prog="titan plan", usage=USAGE, add_help=True)
    parser.add_argument("--gpus", required=True, help="cluster size and device, e.g. 256xH100")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (devices per node = gpus / nodes)")
    parser.add_argument("--global_batch_tokens", type=int, default=None,
                        help="tokens per optimizer step (default: the recipe's global batch, or its "
                             "local batch x the GPUs, times seq_len)")
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    parser.add_argument("--json", action="store_true", help="print every ranked layout as JSON")
    parser.add_argument("--verify", type=int, default=0, help="run the real dry run of the first N rows")
    parser.add_argument("--memory_headroom", type=float, default=0.10,
                        help="fraction added on top of the memory estimate (allocator, workspaces)")
    hw_fields = [f for f in dataclasses.fields(Hardware) if f.type in ("float", "int", "float | None")]
    for f in hw_fields:
        parser.add_argument(f"--hardware.{f.name}", dest=f"hw_{f.name}", type=float, default=None)
    opts, rest = parser.parse_known_args(list(argv))
    opts.hardware = {f.name: (int if f.type == "int" else float)(getattr(opts, f"hw_{f.name}"))
                     for f in hw_fields if getattr(opts, f"hw_{f.name}") is not None}
    return opts, rest


# Layout choices a user may pin on the command line: flag -> (Layout field, parser).
PINNABLE = {
    "--parallelism.data_parallel_replicate_degree": ("dp_replicate", int),
    "--parallelism.data_parallel_shard_degree": ("dp_shard", int),
    "--parallelism.tensor_parallel_degree": ("tp", int),
    "--parallelism.context_parallel_degree": ("cp", int),
    "--parallelism.pipeline_parallel_degree": ("pp", int),
    "--parallelism.expert_parallel_degree": ("ep", int),
    "--parallelism.pipeline_parallel_schedule": ("schedule", str),
    "--parallelism.pipeline_parallel_microbatch_size": ("microbatch_size", int),
    "--parallelism.fsdp_reshard_after_forward": ("reshard_after_forward", str),
}
AC_FLAGS = {"--activation_checkpoint.mode": True, "--activation_checkpoint.selective_layer_every": True,
            "--activation_checkpoint.selective_op": False, "--activation_checkpoint.no_selective_op": False,
            "--activation_checkpoint.selective_ac_option": True}
"""The AC flags (-> whether each takes a value): given on the command line, together they pin
the layout's `ac` and `ac_every` (`ac_choice`)."""


def ac_choice(ac: ActivationCheckpointConfig) -> tuple[str, int]:
    """The planner's (`Layout.ac`, `Layout.ac_every`) of an AC config, as the engine runs it:
    "selective" without `selective_op` checkpoints whole blocks, every k-th ("full" every k)."""
    if ac.mode == "selective":
        return ("selective" if ac.selective_op else "full"), ac.checkpoint_every()
    return ac.mode, 1


def pinned_choices(argv: Sequence[str], config: TrainerConfig | None = None) -> dict[str, object]:
    """Layout fields the command line fixes (`--parallelism.tensor_parallel_degree 8`, ...):
    the planner ranks only layouts with those values instead of ignoring the flags.
    `data_parallel_shard_degree -1` (fill the rest) pins nothing. Any AC flag pins the AC
    that `config` (the recipe with those flags) runs."""
    args, pinned = list(argv), {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in PINNABLE and (eq or i + 1 < len(args)):
            field, parse = PINNABLE[flag]
            value = parse(value if eq else args[i + 1])
            if not (field == "dp_shard" and value == -1):
                pinned[field] = value
    if config is not None and any(arg.partition("=")[0] in AC_FLAGS for arg in args):
        pinned["ac"], pinned["ac_every"] = ac_choice(config.activation_checkpoint)
    return pinned


def model_facts(config: TrainerConfig):
    """(ModelFacts, routed experts per MoE layer or 0, the meta model) of the recipe's model."""
    build, vocab, _ = model_builder(config)
    seq = config.training.seq_len
    with torch.device("meta"):
        model = build()
    moes = [m for _, m in moe_modules(model)]
    converted, _ = float8_linears(model, config.quantize.linear.float8)
    measured, is_converted = _measured_model(config, build)
    facts = ModelFacts.from_model(model, flops_per_token=model.flops_per_token(seq),
                                  experts_per_token=moes[0].top_k if moes else 0, float8_linears=converted,
                                  block_units=measure_block_units(measured, seq_len=min(seq, 64),
                                                                  dtype=DTYPES[config.training.mixed_precision_param],
                                                                  compiled=config.compile.compiles_model,
                                                                  converted=is_converted,
                                                                  model_key=model_key(config, vocab)),
                                  matmul_flops_per_token=_matmul_flops_per_token(model, seq),
                                  float8_tp_block_units=_float8_tp_block_units(config, build, vocab))
    return facts, (moes[0].n_experts if moes else 0), model


def _float8_state(work: Workload) -> str:
    """'float8 off', 'float8 on', or 'float8 on (TP gathers in float8)' for the header."""
    if not work.float8:
        return "float8 off"
    return "float8 on" + (" (TP gathers in float8)" if work.float8_tensor_parallel else "")


def _float8_tp_block_units(config: TrainerConfig, build, vocab: int) -> dict[str, float] | None:
    """What a block keeps under float8 tensor parallel's casts (its TP layouts), or None when
    the recipe does not run it."""
    if not float8_tp_applies(config):
        return None
    return measure_block_units(float8_tp_casting(config, build), seq_len=min(config.training.seq_len, 64),
                               dtype=DTYPES[config.training.mixed_precision_param],
                               compiled=config.compile.compiles_model, converted=True,
                               model_key=(model_key(config, vocab), "float8_tp"))


def _measured_model(config: TrainerConfig, build):
    """(the builder whose blocks' activations are measured, whether it converts linears): the
    recipe's model converted to float8 as `titan train` converts it, when it asks for float8
    and torchao is installed (compiled, a float8 block keeps its linears' inputs in float8);
    otherwise unconverted, and a float8 block counts what a bf16 one keeps."""
    if not config.quantize.linear.float8.enabled or not float8_available():
        return build, False
    return converting(config, build), True


def _matmul_flops_per_token(model, seq: int) -> float | None:
    """The part of the model's FLOPs per token that does not grow with the sequence: its
    matmuls against weights (attention's grows linearly with it), or None when the count is
    not of that form."""
    short, long = model.flops_per_token(seq), model.flops_per_token(2 * seq)
    matmuls = 2 * short - long
    return matmuls if 0 < matmuls <= short else None


def unmodeled_flags(config: TrainerConfig) -> list[str]:
    """The flags set in `config` that change a layout's memory or time in ways the planner does
    not model, each with what it would leave out (a ranking that ignored them would be wrong
    without saying so)."""
    p, q = config.parallelism, config.quantize
    found = []
    if q.linear.mx.enabled or q.grouped_mm.mx.enabled:
        found.append("MXFP8 (--quantize.linear.mx / --quantize.grouped_mm.mx) yet (float8 is modeled)")
    if q.grouped_mm.float8.enabled:
        found.append("float8 grouped experts (--quantize.grouped_mm.float8.fqns) yet (float8 linears are modeled)")
    if p.fsdp_cpu_offload:
        found.append("--parallelism.fsdp_cpu_offload (the states' host transfers and the optimizer step on the CPU)")
    return found


def workload_for(config: TrainerConfig, gpus: int, global_batch_tokens: int | None, headroom: float) -> Workload:
    """The step the planner times: batch, sequence and the recipe's compile / float8 / SP."""
    t = config.training
    unmodeled = unmodeled_flags(config)
    if unmodeled:
        raise ValueError(f"titan plan does not model {unmodeled[0]}: plan without it, or check a layout with it "
                         "using titan dry-run")
    if global_batch_tokens is not None:
        if global_batch_tokens < t.seq_len:
            raise ValueError(f"--global_batch_tokens {global_batch_tokens} is less than one sequence "
                             f"(--training.seq_len {t.seq_len})")
        if global_batch_tokens % t.seq_len:
            raise ValueError(f"--global_batch_tokens {global_batch_tokens} is not a multiple of "
                             f"--training.seq_len {t.seq_len}")
        sequences = global_batch_tokens // t.seq_len
    elif t.global_batch_size > 0:
        sequences = t.global_batch_size
    else:
        sequences = t.local_batch_size * gpus
    return Workload(global_batch_size=sequences, seq_len=t.seq_len,
                    compute_dtype_bytes=DTYPES[t.mixed_precision_param].itemsize,
                    compile=config.compile.compiles_model, compile_loss=config.compile.compiles_loss,
                    float8=config.quantize.linear.float8.recipe is not None,
                    sequence_parallel=config.parallelism.enable_sequence_parallel,
                    loss_parallel=config.parallelism.enable_loss_parallel,
                    async_tp=config.parallelism.enable_async_tensor_parallel, memory_headroom=headroom,
                    loss_chunk_tokens=t.loss_chunk_tokens,
                    reduce_dtype_bytes=DTYPES[t.mixed_precision_reduce].itemsize,
                    float8_all_gather=config.quantize.linear.float8.enable_fsdp_float8_all_gather,
                    float8_tensor_parallel=config.quantize.linear.float8.recipe == "tensorwise")


def enumeration_for(pinned: dict[str, object]) -> dict[str, object]:
    """`enumerate_layouts`' bounds widened to what the user pinned (a TP or CP degree above 8,
    a pipeline microbatch size other than 1, 2, 4, replicas inside a node, a schedule outside
    the default set), so a pinned layout is ranked instead of reported as invalid; a schedule
    whose order the planner cannot build is refused by name."""
    bounds: dict[str, object] = {}
    schedule = pinned.get("schedule")
    if schedule is not None:
        if schedule not in TIMED_SCHEDULES:
            raise ValueError(f"titan plan times the pipeline schedules {', '.join(TIMED_SCHEDULES)}, not {schedule}; "
                             "plan with one of those, or check the layout with titan dry-run")
        if schedule in ZERO_BUBBLE_SCHEDULES and not zero_bubble_timeable():
            raise ValueError(f"titan plan reads {schedule}'s order from torch's schedule builder "
                             "(torch.distributed.pipelining._schedule_visualizer), which this torch lacks")
        bounds["schedules"] = (schedule,)
    if "tp" in pinned:
        bounds["max_tp"] = max(8, pinned["tp"])
    if "cp" in pinned:
        bounds["max_cp"] = max(8, pinned["cp"])
    if "microbatch_size" in pinned:
        bounds["microbatch_sizes"] = (pinned["microbatch_size"],)
    if "dp_replicate" in pinned:
        bounds["replicas_across_nodes_only"] = False
    if "reshard_after_forward" in pinned:
        bounds["reshard_policies"] = (pinned["reshard_after_forward"],)
    if "ac" in pinned:
        bounds["ac_modes"] = (pinned["ac"],)
        bounds["ac_every"] = {pinned["ac"]: (pinned.get("ac_every", 1),)}
    return bounds


def _has_pinned(layout: Layout, pinned: dict[str, object] | None) -> bool:
    return not pinned or all(getattr(layout, field) == value for field, value in pinned.items())


def check_layout_options(config: TrainerConfig, dims) -> None:
    """The checks of the recipe's options against a layout that `titan train` and the dry run
    make before building anything (ValueError): whole-model compile or async TP where the
    layout cannot run them, float8's FSDP all-gather without FSDP."""
    check_quantize_layout(config.quantize, uses_fully_shard=dims.uses_fully_shard)
    check_reshard_under_zero_bubble(config.parallelism, dims)
    check_compile_options(config.compile, dims, async_tp=config.parallelism.enable_async_tensor_parallel,
                          sequence_parallel=config.parallelism.enable_sequence_parallel,
                          pipeline_schedule=config.parallelism.pipeline_parallel_schedule)


def engine_refusal(layout: Layout, probe, seq_len: int, global_batch: int,
                   config: TrainerConfig | None = None) -> str | None:
    """Why the checks `titan train` runs before building anything refuse `layout` (one
    line), or None when it passes them: the model's (`validate_against_model`) and, given the
    recipe's `config`, its options' (`check_layout_options`)."""
    dims = layout_dims(layout)
    try:
        validate_against_model(dims, probe, seq_len=seq_len, global_batch_size=global_batch,
                               local_batch_size=layout.engine_local_batch_size)
        if config is not None:
            check_layout_options(config, dims)
    except ValueError as err:
        return " ".join(str(err).split())
    return None


def passes_engine_checks(probe, seq_len: int, global_batch: int, pinned: dict[str, object] | None = None,
                         config: TrainerConfig | None = None):
    """A filter: the layout has the `pinned` values and passes the checks `titan train` runs
    before building anything (`engine_refusal`)."""
    # The checks read only the mesh and the local batch: the layouts that differ in AC, the
    # schedule, the microbatch or the reshard policy (most of them) share one verdict.
    verdicts: dict[tuple, bool] = {}

    def check(layout: Layout) -> bool:
        if not _has_pinned(layout, pinned):
            return False
        key = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep,
               layout.engine_local_batch_size)
        if key not in verdicts:
            verdicts[key] = engine_refusal(layout, probe, seq_len, global_batch, config) is None
        return verdicts[key]
    return check


def _first_refusal(layouts: list[Layout], probe, work: Workload, pinned: dict[str, object],
                   config: TrainerConfig | None = None) -> str:
    """Why the engine refuses the first enumerated layout with the pinned values (', e.g. ...'),
    or '' when none has them."""
    for layout in layouts:
        if _has_pinned(layout, pinned):
            reason = engine_refusal(layout, probe, work.seq_len, work.global_batch_size, config)
            if reason:
                return f" (e.g. {layout.describe()}: {reason})"
    return ""


def config_for(config: TrainerConfig, layout: Layout) -> TrainerConfig:
    """``config`` with the layout's degrees, FSDP reshard policy, AC and batch (what its flags
    select)."""
    # The schedule and its microbatch only under PP, as the layout's flags set them.
    pipeline = (dict(pipeline_parallel_schedule=layout.schedule, pipeline_parallel_microbatch_size=layout.microbatch_size)
                if layout.pp > 1 else {})
    p = dataclasses.replace(
        config.parallelism, data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard, tensor_parallel_degree=layout.tp,
        context_parallel_degree=layout.cp, pipeline_parallel_degree=layout.pp,
        expert_parallel_degree=layout.ep, fsdp_reshard_after_forward=layout.reshard_after_forward, **pipeline)
    chosen = layout.ac_config
    ac = dataclasses.replace(config.activation_checkpoint, mode=chosen.mode, selective_op=chosen.selective_op,
                             selective_layer_every=chosen.selective_layer_every)
    training = dataclasses.replace(config.training, local_batch_size=layout.engine_local_batch_size,
                                   global_batch_size=layout.global_batch_size)
    return dataclasses.replace(config, parallelism=p, activation_checkpoint=ac, training=training)


# Recipe flags the printed command leaves to the layout: flag -> whether it takes a value.
LAYOUT_FLAGS = {**dict.fromkeys(PINNABLE, True), **AC_FLAGS, "--training.local_batch_size": True,
                 "--training.global_batch_size": True}


TP_ONLY_FLAGS = ("--parallelism.enable_async_tensor_parallel",)
"""Recipe switches that act under TP only: a row without TP leaves them out of its command
(which `titan train` would refuse as having no effect)."""

PP_ONLY_FLAGS = ("--parallelism.pipeline_parallel_first_stage_less_layers",
                 "--parallelism.pipeline_parallel_last_stage_less_layers")
"""Recipe flags (with a value) that act under PP only: a row without PP leaves them out."""


def train_argv(recipe_argv: Sequence[str], layout: Layout) -> list[str]:
    """The `titan train` arguments of a planned row: the recipe flags given to `titan plan`
    (`--config`, `--compile.enable`, `--training.seq_len`, ...), less those the layout sets
    (and, without TP, `TP_ONLY_FLAGS`; without PP, `PP_ONLY_FLAGS`), then the layout's own
    (`Layout.flags`)."""
    kept, args = [], list(recipe_argv)
    i = 0
    while i < len(args):
        flag, eq, _ = args[i].partition("=")
        if flag in LAYOUT_FLAGS:
            i += 1 if eq or not LAYOUT_FLAGS[flag] else 2
            continue
        if flag in PP_ONLY_FLAGS and layout.pp == 1:
            i += 1 if eq else 2
            continue
        if not (flag in TP_ONLY_FLAGS and layout.tp == 1):
            kept.append(args[i])
        i += 1
    return [*kept, *layout.flags()]


def format_table(preds: list[Prediction], hw: Hardware, top: int, recipe_argv: Sequence[str] = ()) -> str:
    """The ranked markdown table and each row's `titan train` command (`train_argv`)."""
    lines = ["| # | layout | AC | batch (micro, schedule) | tokens/s/GPU | MFU | memory/rank | dominant |",
             "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(preds[:top], 1):
        lay = p.layout
        batch = f"{lay.local_batch_size}" + (f" ({lay.microbatch_size}, {lay.schedule})" if lay.pp > 1 else
                                             f" ({lay.microbatch_size} x {lay.accumulation_steps} accumulated)"
                                             if lay.accumulation_steps > 1 else "")
        mem = f"{p.memory['total'] / 1024**3:.1f} / {hw.memory_gib:.0f} GiB" + ("" if p.fits else " (does not fit)")
        lines.append(f"| {i} | {lay.describe()} | {lay.ac_label} | {batch} | {p.tokens_per_s_per_device:,.0f} | "
                     f"{100 * p.mfu:.1f}% | {mem} | {p.dominant} |")
    close = sum(p.fits and p.tokens_per_s_per_device >= (1 - NEAR_TIE) * preds[0].tokens_per_s_per_device
                for p in preds)
    if close > 1:
        lines.append(f"\n{close} layouts predict within {100 * NEAR_TIE:.0f}% of the first: closer than the model's "
                     "error against published runs (within 20% on 18 of 19), so their order is not a finding; "
                     "--verify dry-runs the first ones, a short run on the cluster decides")
    lines.append("")
    for i, p in enumerate(preds[:top], 1):
        lines.append(f"{i}: titan train " + shlex.join(train_argv(recipe_argv, p.layout)))
    return "\n".join(lines)


NEAR_TIE = 0.05
"""Predictions this close to the first one are reported as ties: within the model's error."""


def plan(argv: Sequence[str], parse_train_args) -> int:
    """Run ``titan plan``; returns the exit code."""
    start = time.perf_counter()
    opts, rest = parse_plan_args(argv)
    config = parse_train_args(rest)
    gpus, hw = parse_gpus(opts.gpus, opts.hardware)
    if opts.nodes is not None:
        if opts.nodes < 1 or gpus % opts.nodes:
            raise ValueError(f"--nodes {opts.nodes} must divide --gpus {gpus}")
        hw = dataclasses.replace(hw, devices_per_node=gpus // opts.nodes)
    facts, n_experts, probe = model_facts(config)
    work = workload_for(config, gpus, opts.global_batch_tokens, opts.memory_headroom)
    pinned = pinned_choices(rest, config)
    bounds = enumeration_for(pinned)
    stage_sizes = configured_stage_sizes(probe, config.parallelism)
    bounds["stage_weights"] = stage_weights(config.parallelism)
    if stage_sizes:  # the run's own split (split points or a stage size): every layout pipelines it
        bounds["stage_sizes"] = stage_sizes
        if not any(len(stage_sizes) % pp == 0 for pp in range(2, min(gpus, len(stage_sizes)) + 1) if gpus % pp == 0):
            raise ValueError(f"the run's {len(stage_sizes)} pipeline stages (--parallelism.pipeline_parallel_split_points "
                             f"/ layers_per_stage) divide over no pipeline degree > 1 of {gpus} ranks; split the "
                             "layers into a number of stages that does")
    valid = passes_engine_checks(probe, work.seq_len, work.global_batch_size, pinned, config)
    layouts = list(enumerate_layouts(facts, gpus, work, n_experts=n_experts, **bounds))
    preds = rank_layouts(facts, layouts, work, hw, valid=valid)
    if not preds and bounds.get("replicas_across_nodes_only", True):
        # The pruning left nothing (e.g. whole-model compile, which FSDP cannot run, on one
        # node): data-parallel replicas inside a node too.
        layouts = list(enumerate_layouts(facts, gpus, work, n_experts=n_experts,
                                         **{**bounds, "replicas_across_nodes_only": False}))
        preds = rank_layouts(facts, layouts, work, hw, valid=valid)
    if not preds:
        fixed = f" with {pinned}" if pinned else ""
        raise ValueError(f"no layout of {gpus} ranks{fixed} passes the model's checks for a global batch of "
                         f"{work.global_batch_size} x {work.seq_len} tokens{_first_refusal(layouts, probe, work, pinned, config)}; "
                         "change --global_batch_tokens or the recipe's flags"
                         + (" or the pinned --parallelism / --activation_checkpoint flags" if pinned else ""))
    for p in preds[: opts.verify]:
        run_dry_run(config_for(config, p.layout), world_size=gpus, print_fn=lambda s: None)
    if opts.json:
        print(json.dumps({"hardware": dataclasses.asdict(hw), "gpus": gpus, "workload": dataclasses.asdict(work),
                          "layouts": [{**p.as_dict(), "train_argv": train_argv(rest, p.layout)} for p in preds]}))
        return 0
    fitting = sum(p.fits for p in preds)
    size = f"{facts.num_params / 1e9:.1f}B" if facts.num_params >= 1e9 else f"{facts.num_params / 1e6:.1f}M"
    print(f"titan plan: {config.model.name} {config.model.flavor} ({size} params) on "
          f"{gpus} x {hw.name} ({min(hw.devices_per_node, gpus)} per node); batch {work.global_batch_size} x "
          f"{work.seq_len} tokens; compile {'on' if work.compile else 'off'}, "
          f"{_float8_state(work)}; {len(preds)} valid layouts, {fitting} fit in memory")
    none, selective = facts.none_units, facts.selective_units
    if work.compile:  # what the compiled block keeps, where it was measured
        none, selective = facts.none_units_compiled or none, facts.selective_units_compiled or selective
    print(f"a{' compiled' if work.compile else ''}{' float8' if work.float8 else ''} block keeps {none:.1f} / "
          f"{selective:.1f} / 1 model-width activations per token (AC none / selective / full); its backward "
          f"holds {facts.backward_units:.1f} more" + (f" and {facts.backward_fixed_bytes / 2**20:,.0f} MiB of weight "
                                                      "casts" if facts.backward_fixed_bytes else ""))
    if work.float8 and work.float8_tensor_parallel and facts.float8_tp_block_units:
        tp_units = facts.under_float8_tp
        kept = tp_units.none_units_compiled or tp_units.none_units if work.compile else tp_units.none_units
        print(f"under float8 tensor parallel it keeps {kept:.1f} without AC (its linears' inputs in float8) and "
              f"its TP gathers move float8")
    if config.training.document_mask:
        print("note: attention is counted causal over whole rows; with --training.document_mask each packed "
              "document attends only to itself, so its share of the time is an upper bound", file=sys.stderr)
    if work.float8 and not float8_available():
        print("note: torchao is not installed, so the float8 blocks' activations were not measured: counted as "
              "bf16's (an upper bound when compiled); pip install 'titan-train[float8]'", file=sys.stderr)
    print(format_table(preds, hw, opts.top, rest))
    verified = f"; the first {min(opts.verify, len(preds))} passed the dry run" if opts.verify else ""
    print(f"planned in {time.perf_counter() - start:.1f} s{verified}", file=sys.stderr)
    return 0
