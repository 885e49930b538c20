"""``titan dry-run`` / ``COMM_MODE=fake_backend titan train``: a cluster config checked on one CPU.

The recipe and flags resolve exactly as for ``titan train``; the model family's builder is
handed to ``titan.dist.dry_run`` as a ``model_fn`` (titan.dist never names a family), which
validates the degrees, builds the mesh over a fake process group, parallelizes on the meta
device and prints one memory estimate per pipeline rank. Nothing is allocated or trained.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from titan.dist import ParallelDims, RankEstimate, check_compile_options, dry_run
from titan.dist.dry_run import float8_gathered_units, format_bytes, gathered_bytes_per_param
from titan.dist.fsdp import DTYPES
from titan.dist.plan import blocks_of, sharding_plan
from titan.dist.planner import float8_tp_gathers
from titan.train.config import TrainerConfig
from titan.train.float8_tensor_parallel import add_float8_tp_casts, float8_tensor_parallel
from titan.train.quantize import (
    apply_quantization,
    check_quantize_supported,
    float8_available,
    float8_linears,
)
from torch import nn

from titan.recipes.families import HF_FLAVOR, model_spec_for

FAKE_BACKEND = "fake_backend"


def fake_backend_requested(env: Mapping[str, str] = os.environ) -> bool:
    """True when ``COMM_MODE=fake_backend``: ``titan train`` then dry-runs instead of training."""
    mode = env.get("COMM_MODE", "")
    if mode and mode != FAKE_BACKEND:
        raise SystemExit(f"titan train: COMM_MODE={mode!r} is not supported; use COMM_MODE={FAKE_BACKEND} or unset it")
    return mode == FAKE_BACKEND


def world_size_from_env(env: Mapping[str, str] = os.environ) -> int:
    """The simulated world size: ``WORLD_SIZE``, else ``NGPU`` (or ``NPROC``) x ``NNODES``."""
    try:
        if env.get("WORLD_SIZE"):
            return int(env["WORLD_SIZE"])
        per_node = int(env.get("NGPU") or env.get("NPROC") or 1)
        return per_node * int(env.get("NNODES") or 1)
    except ValueError as err:
        raise SystemExit(f"titan train: WORLD_SIZE / NGPU / NNODES must be integers ({err})") from None


def split_world_size_flag(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Pull ``--world_size N`` / ``--world_size=N`` out of ``argv`` (``titan dry-run`` only)."""
    size, rest, args, i = None, [], list(argv), 0
    while i < len(args):
        arg = args[i]
        if arg in ("--world_size", "--world-size"):
            if i + 1 >= len(args):
                raise SystemExit("titan dry-run: --world_size needs a number of ranks")
            size, i = args[i + 1], i + 2
            continue
        if arg.startswith(("--world_size=", "--world-size=")):
            size = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if size is None:
        return None, rest
    if not size.isdigit() or int(size) < 1:
        raise SystemExit(f"titan dry-run: --world_size must be a positive integer, got {size!r}")
    return int(size), rest


def vocab_size_for(config: TrainerConfig) -> tuple[int, str]:
    """The vocabulary the trainer would build (`ModelConfig.resolve_vocab_size`: the
    trainer's own rule), and where it came from. A tokenizer file that is not on this machine
    falls back to the flavor's published vocabulary."""
    tok, model = config.tokenizer, config.model
    # `--model.flavor hf` set the size from the checkpoint's config.json (`resolve_hf_flavor`)
    given = "the checkpoint's config.json" if model.flavor == HF_FLAVOR else "--model.vocab_size"
    if tok.kind == "byte" or (tok.path and os.path.exists(tok.path)):
        size, source = tok.build().vocab_size, "tokenizer"
    elif model.vocab_size is None:
        size, source = model_spec_for(config).flavors[model.flavor].vocab_size, "flavor"
    else:  # no tokenizer here to check the given size against
        return model.vocab_size, given
    return model.resolve_vocab_size(size), source if model.vocab_size is None else given


def model_builder(config: TrainerConfig) -> tuple[Callable[[], nn.Module], int, str]:
    """(a function building the recipe's model as the trainer would, before any conversion or
    parallelism — a reward model's with its score head —; its vocabulary; where that came
    from, as `vocab_size_for`)."""
    spec = model_spec_for(config)
    spec.check_flavor(config.model.flavor)
    vocab, source = vocab_size_for(config)
    from titan.rl.reward_trainer import RewardConfig, with_score_head

    if isinstance(config, RewardConfig):  # titan reward trains a one-column score head, not the LM head
        spec = with_score_head(spec, config.model.flavor)

    def build() -> nn.Module:
        return spec.build(config.model.flavor, **config.model.overrides(), vocab_size=vocab,
                          max_seq_len=config.training.seq_len)

    return build, vocab, source


def model_key(config: TrainerConfig, vocab: int) -> tuple:
    """What identifies the model `model_builder` and `converting` build for `config` (family,
    flavor, overrides, vocabulary, context, and the quantization flags when float8 converts
    it): the key of `measure_block_units`' per-process memo."""
    m = config.model
    float8 = repr(config.quantize) if config.quantize.linear.float8.enabled else None
    return (m.name, m.flavor, tuple(sorted(m.overrides().items())), vocab, config.training.seq_len, float8)


def gathered_param_bytes(config: TrainerConfig, build) -> float | None:
    """Bytes per block parameter FSDP gathers when the float8 weights are gathered in float8
    (`--quantize.linear.float8.enable_fsdp_float8_all_gather`: 1 byte each, the rest in the
    compute dtype); None otherwise (the compute dtype's)."""
    float8 = config.quantize.linear.float8
    if not (float8.enabled and float8.enable_fsdp_float8_all_gather):
        return None
    with torch.device("meta"):
        model = build()
    converted, _ = float8_linears(model, float8)
    in_blocks = sum(p.numel() for _, block in blocks_of(model) for p in block.parameters())
    share = sum(model.get_submodule(name).weight.numel() for name in converted) / in_blocks
    return gathered_bytes_per_param(DTYPES[config.training.mixed_precision_param].itemsize, share)


def converting(config: TrainerConfig, build: Callable[[], nn.Module],
               reports: list | None = None) -> Callable[[], nn.Module]:
    """`build`, then the recipe's quantization applied as `titan train` applies it, before any
    parallelism (each conversion's report appended to `reports`)."""
    def model_fn() -> nn.Module:
        model = build()
        report = apply_quantization(model, config.quantize)
        if reports is not None:
            reports.append(report)
        return model

    return model_fn


def float8_tp_applies(config: TrainerConfig) -> bool:
    """Whether `titan train` would run the recipe's TP under float8 tensor parallel (tensorwise
    float8 with SP; torchao installed to measure it)."""
    return (config.quantize.linear.float8.recipe == "tensorwise" and config.parallelism.enable_sequence_parallel
            and float8_available())


def float8_tp_casting(config: TrainerConfig, build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`converting(config, build)`, then the casts float8 tensor parallel makes, made in one
    process (`add_float8_tp_casts`): the model whose blocks keep what a float8 TP rank's keep."""
    convert = converting(config, build)

    def model_fn() -> nn.Module:
        model = convert()
        add_float8_tp_casts(model)
        return model

    return model_fn


def float8_tp_input_units(config: TrainerConfig, build: Callable[[], nn.Module]) -> float:
    """What a block's two SP-gathered inputs weigh under float8 tensor parallel, in units of the
    compute dtype (`float8_gathered_units` of the blocks' float8 gathers)."""
    with torch.device("meta"):
        model = build()
    converted, _ = float8_linears(model, config.quantize.linear.float8)
    inputs, _ = float8_tp_gathers(model, sharding_plan(model), frozenset(converted))
    return float8_gathered_units(inputs, DTYPES[config.training.mixed_precision_param].itemsize)


def run_dry_run(config: TrainerConfig, world_size: int, print_fn=print) -> list[RankEstimate]:
    """Validate and parallelize ``config`` for ``world_size`` ranks on the meta device with a
    fake process group; prints and returns one estimate per pipeline rank."""
    unconverted, vocab, source = model_builder(config)
    training = config.training

    conversions = []
    model_fn = converting(config, unconverted, conversions)

    d = ParallelDims.from_config(config.parallelism, world_size)  # resolves dp_shard -1; raises early
    check_quantize_supported(config.quantize, None, uses_fully_shard=d.uses_fully_shard)
    check_compile_options(config.compile, d, async_tp=config.parallelism.enable_async_tensor_parallel,
                          sequence_parallel=config.parallelism.enable_sequence_parallel,
                          pipeline_schedule=config.parallelism.pipeline_parallel_schedule)
    with torch.device("meta"):
        params = model_fn().num_params()  # the count `titan train` logs for the same flags
    if conversions[0] is not None:
        print_fn(f"dry run: {conversions[0].summary(config.quantize.recipe)}")
    print_fn(
        f"dry run: {config.model.name} {config.model.flavor}: {params / 1e6:.2f}M params (vocab {vocab:,} from "
        f"{source}) on {world_size} "
        f"ranks: pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x "
        f"tp {d.tp}{f' (ep {d.ep})' if d.ep_enabled else ''}; local batch {training.local_batch_size} x seq {training.seq_len}, "
        f"AC {config.activation_checkpoint.mode}, params {training.mixed_precision_param} in compute"
    )
    float8_tp = float8_tensor_parallel(config.quantize, tp_enabled=d.tp_enabled)
    estimates = dry_run(
        model_fn,
        config.parallelism,
        world_size=world_size,
        activation_checkpoint=config.activation_checkpoint,
        compile=config.compile,
        local_batch_size=training.local_batch_size,
        seq_len=training.seq_len,
        global_batch_size=training.global_batch_size,
        activation_dtype=training.mixed_precision_param,
        loss_chunk_tokens=training.loss_chunk_tokens,
        reduce_dtype=training.mixed_precision_reduce,
        gathered_param_bytes=gathered_param_bytes(config, unconverted),
        print_fn=print_fn,
        # TP parallelized as `titan train` does it (float8's own styles included).
        tensor_parallel_overrides=float8_tp,
        **_measured_blocks(config, d, unconverted, model_fn, vocab),
    )
    if float8_tp is not None:  # one pipeline rank of each stage was parallelized: the whole model
        print_fn(f"dry run: {float8_tp.summary()}")
    return estimates


def _measured_blocks(config: TrainerConfig, dims: ParallelDims, unconverted, converted, vocab: int) -> dict:
    """`dry_run`'s arguments for measuring what a block keeps: float8 blocks measured
    converted (compiled, they keep less: the inputs' casts), and under float8 tensor parallel
    with its casts and float8 gathered inputs. MXFP8 blocks are measured unconverted (their
    saving is not modeled)."""
    float8 = config.quantize.linear.float8.enabled
    args = dict(measure_fn=converted if float8 else unconverted, measure_converted=float8,
                model_key=model_key(config, vocab))
    if dims.tp > 1 and float8_tp_applies(config):
        args.update(measure_fn=float8_tp_casting(config, unconverted), model_key=(args["model_key"], "float8_tp"),
                    gathered_input_units=float8_tp_input_units(config, unconverted))
    return args


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _is_rl(config: Any) -> bool:
    """Whether ``config`` is a ``titan rl`` run's."""
    return hasattr(getattr(config, "rl", None), "advantage_estimator")


def policy_params(config: Any) -> int:
    """The parameter count of the recipe's model (built on the meta device)."""
    build, _, _ = model_builder(config)
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def rl_model_copies(config: Any, params: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The whole model copies a ``titan rl`` run of a ``params``-parameter policy keeps beside
    the trainer's shards: (those every trainer rank holds, those rank 0 adds), each as (name,
    bytes). Colocated, the generator (native: float32; vLLM: its dtype plus its KV cache) on
    rank 0, or on every rank with every_rank generation; the KL reference (a float32 native
    copy) where the generator is, or in its place the teacher (``--rl.teacher_model``, float32,
    its size read from its folder: :func:`teacher_size`). The generators' activations are not
    counted; PPO's critic is sharded as the policy is (:func:`with_rl_models` adds it)."""
    rl = config.rl
    generator = generator_bytes(config.generator, params)
    where_generated: list[tuple[str, int]] = []
    if not rl.generator_ranks:
        where_generated.append(("generator", generator))
    if rl.uses_reference and not rl.teacher_model:
        where_generated.append(("KL reference", params * 4))
    teacher = teacher_size(config, rl.teacher_model or "", flag="--rl.teacher_model")
    if teacher is not None:
        where_generated.append(("teacher", teacher[0] * 4))
    every_rank = rl.colocated_generation == "every_rank" and not rl.generator_ranks
    return (where_generated, []) if every_rank else ([], where_generated)


def generator_bytes(generator: Any, params: int) -> int:
    """The bytes of one generating copy of a ``params``-parameter model under ``--generator.*``
    on one rank: native float32 weights, or vLLM's in its dtype (this rank's 1/N under
    ``--generator.tensor_parallel_size`` N) plus its KV cache (a bound per rank; activations
    not counted)."""
    if generator.kind == "native":
        return params * 4
    weights = params * _DTYPE_BYTES[generator.dtype] // generator.tensor_parallel_size
    return weights + generator.kv_cache_memory_bytes


def _critic_scale(config: Any, params: int) -> float:
    """PPO's critic's parameters over the ``params`` of the policy: 1, or for
    --rl.critic_model (a local folder; its ``config.json`` is the critic's architecture) their
    ratio."""
    folder = config.rl.critic_model
    if not folder or not os.path.isdir(folder):
        return 1.0
    from titan.rl.critic import CRITIC_FLAVOR, reward_model_spec

    _, vocab, _ = model_builder(config)
    critic_spec, _ = reward_model_spec(folder, model_spec_for(config), vocab)
    with torch.device("meta"):
        critic = critic_spec.build(CRITIC_FLAVOR)
    return sum(p.numel() for p in critic.parameters()) / params


def _with_copies(estimate: RankEstimate, copies: list[tuple[str, int]]) -> RankEstimate:
    if not copies:
        return estimate
    described = ", ".join(f"{name} {format_bytes(size)}" for name, size in copies)
    return dataclasses.replace(estimate, copy_bytes=estimate.copy_bytes + sum(size for _, size in copies),
                               copies=", ".join(filter(None, (estimate.copies, described))))


def _is_gkd(config: Any) -> bool:
    """Whether ``config`` is a ``titan gkd`` run's."""
    return hasattr(getattr(config, "gkd", None), "lmbda")


def teacher_size(config: Any, folder: str, *, flag: str) -> tuple[int, int] | None:
    """(parameters, vocabulary) of the teacher in ``folder`` (a local Hugging Face folder; its
    family is its ``config.json``'s), built on the meta device; None without one (no teacher,
    or a Hub id not downloaded yet)."""
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    from titan.rl.generate.build import folder_architecture

    from titan.recipes.families import family_of_folder

    spec, args = folder_architecture(folder, family_of_folder(folder, model_spec_for(config)), flag=flag,
                                     role="teacher", flavor="teacher", labels=0)
    with torch.device("meta"):
        return sum(p.numel() for p in spec.build("teacher").parameters()), args.vocab_size


def gkd_model_copies(config: Any, params: int, student_param_bytes: int) -> list[tuple[str, int]]:
    """What every rank of a ``titan gkd`` run of a ``params``-parameter student holds beside the
    student's shards, each as (name, bytes): the teacher (its size read from its folder's
    ``config.json``; a Hub id not yet downloaded is not counted): sharded as the student
    (``--gkd.teacher_layout sharded``: the student's ``student_param_bytes`` on this rank scaled
    to the teacher's size) or a whole copy in ``--gkd.teacher_dtype``; its logits of one
    microbatch (``[local batch, seq, teacher vocab]``, whole over the sequence, float32 or the
    whole teacher's dtype; whole over the vocabulary, but for a sharded teacher of the
    student's vocabulary under loss parallel, which keeps this rank's columns); with
    ``--gkd.lmbda`` above 0 the student's copy that generates (:func:`generator_bytes`); and
    with ``--gkd.seq_kd`` under vLLM the engine that samples the teacher."""
    copies = []
    gkd = config.gkd
    found = teacher_size(config, gkd.teacher_model, flag="--gkd.teacher_model")
    if found is not None:
        teacher, vocab = found
        size = _DTYPE_BYTES[gkd.teacher_dtype] if gkd.teacher_layout == "whole" else 4
        held = teacher * size if gkd.teacher_layout == "whole" else int(student_param_bytes * teacher / params)
        from titan.rl.distill_teacher import keeps_vocab_shards

        training, par = config.training, config.parallelism
        shards = gkd.teacher_layout == "sharded" and keeps_vocab_shards(par, vocab, model_builder(config)[1])
        copies += [(f"teacher ({gkd.teacher_layout})", held),
                   ("teacher logits", training.local_batch_size * training.seq_len * vocab * size
                    // (par.tensor_parallel_degree if shards else 1))]
    if gkd.lmbda > 0:
        copies.append(("generating copy", generator_bytes(config.generator, params)))
    if gkd.seq_kd and config.generator.kind == "vllm" and found is not None:  # vLLM's own copy of the teacher
        copies.append(("teacher's generator", generator_bytes(config.generator, found[0])))
    return copies


def with_rl_models(config: Any, estimates: list[RankEstimate]) -> list[RankEstimate]:
    """The dry run's per-pipeline-rank ``estimates`` with what a ``titan rl`` run holds beside
    the policy's shards (:func:`rl_model_copies`, PPO's critic), or a ``titan gkd`` run beside
    the student's (:func:`gkd_model_copies`: on the last pipeline rank, which computes the
    loss); unchanged for other runs."""
    if _is_gkd(config):
        estimates = list(estimates)
        last = estimates[-1]
        estimates[-1] = _with_copies(last, gkd_model_copies(config, policy_params(config), last.param_bytes))
        return estimates
    if not _is_rl(config):
        return estimates
    params = policy_params(config)
    shared, rank0 = rl_model_copies(config, params)
    if config.rl.advantage_estimator == "gae":
        # PPO's critic: a second model sharded as the policy, with its gradients and optimizer
        # states (its score head in place of the LM head: counted as the policy's, an upper
        # bound), scaled to a reward model's size when it starts from one.
        scale = _critic_scale(config, params)
        estimates = [_with_copies(e, [("critic", int(e.state_bytes * scale))]) for e in estimates]
    estimates = [_with_copies(e, shared) for e in estimates]
    estimates[0] = _with_copies(estimates[0], rank0)  # pipeline rank 0 holds global rank 0
    return estimates


def generator_ranks_of(config: Any, world_size: int) -> int:
    """The ranks of a ``world_size``-rank launch that generate rather than train: a
    disaggregated ``titan rl`` run's last ``--rl.generator_ranks``; 0 for other runs. A launch
    with no rank left to train is refused, as the run would refuse it."""
    generators = config.rl.generator_ranks if _is_rl(config) else 0
    if generators and generators >= world_size:
        raise ValueError(f"--rl.generator_ranks {generators} leaves no trainer rank in a launch of {world_size} "
                         f"rank(s); plan {generators + 1} or more ranks")
    return generators


def generator_copy_description(generator: Any) -> str:
    """What one generator rank's generating copy is under ``--generator.*``, in words."""
    if generator.kind == "native":
        return "a native float32 model copy"
    tp = generator.tensor_parallel_size
    share = f"1/{tp} of a vLLM engine's {generator.dtype} weights" if tp > 1 else f"vLLM's {generator.dtype} weights"
    return f"{share} and its {format_bytes(generator.kv_cache_memory_bytes)} KV cache"


def generator_rank_line(config: Any, trainer_ranks: int, generator_ranks: int) -> str:
    """What each generator rank of a disaggregated ``titan rl`` run holds: its generating copy
    (:func:`generator_bytes`: a native float32 copy, or vLLM's share of the weights in its
    dtype plus its KV cache bound), activations not counted."""
    held = generator_bytes(config.generator, policy_params(config))
    last = trainer_ranks + generator_ranks - 1
    ranks = f"rank {last} holds" if generator_ranks == 1 else f"ranks {trainer_ranks}-{last} each hold"
    return (f"dry run: generator {ranks} {format_bytes(held)} (--rl.generator_ranks {generator_ranks}): "
            f"{generator_copy_description(config.generator)}; the first {trainer_ranks} rank(s) train")


def dry_run_main(config: TrainerConfig, world_size: int) -> int:
    """Run the dry run for the CLI: a user error prints its message and returns 2. A
    disaggregated ``titan rl`` run trains on the launch's first ranks and generates on the
    rest: the layout is checked over the trainer ranks, and the generator ranks' share shown."""
    start = time.perf_counter()
    try:
        generators = generator_ranks_of(config, world_size)
        estimates = with_rl_models(config, run_dry_run(config, world_size - generators))
    except ValueError as err:
        print(f"titan dry-run: {err}", file=sys.stderr)
        return 2
    for estimate in estimates:
        if estimate.copy_bytes:
            print(f"dry run: pp rank {estimate.pp_rank} also holds {format_bytes(estimate.copy_bytes)} of other models "
                  f"({estimate.copies}): total {format_bytes(estimate.total_bytes)}")
    if generators:
        print(generator_rank_line(config, world_size - generators, generators))
    peak = max(estimates, key=lambda e: e.total_bytes)
    print(
        f"dry run OK in {time.perf_counter() - start:.1f} s: {len(estimates)} pipeline rank(s), "
        f"largest estimate {peak.total_bytes / 1024 ** 3:.2f} GiB (pp {peak.pp_rank})"
    )
    return 0
