"""torch.compile per transformer block, or of the whole model."""

from __future__ import annotations

import torch.nn as nn

from titan.dist.config import ZERO_BUBBLE_SCHEDULES
from titan.dist.plan import blocks_of


def apply_compile(model: nn.Module, mesh, config) -> nn.Module:
    """Compile each block of the model's layer container in place (`CompileConfig`).

    Blocks are compiled one by one rather than the whole model: every block has the same
    code, so one compiled graph is reused for all, and FSDP's per-block hooks stay outside
    the graphs. Module names are unchanged (`nn.Module.compile` works in place).
    `mesh` is unused but kept for the `apply_*` signature.

    With ``granularity="model"`` the model is one graph instead (callers refuse it under FSDP
    and pipeline parallel, see `check_compile_options`).
    """
    if not config.compiles_model:
        return model
    if config.granularity == "model":
        model.compile(backend=config.backend, fullgraph=config.fullgraph)
        return model
    for _, block in blocks_of(model):
        block.compile(backend=config.backend, fullgraph=config.fullgraph)
    return model


def check_compile_options(config, parallel_dims, *, async_tp: bool = False, sequence_parallel: bool = True,
                          pipeline_schedule: str | None = None) -> None:
    """Refuse, before anything is built, what compile cannot do on this layout (ValueError
    naming the flags): whole-model compile where FSDP2's per-block hooks or pipeline stages
    would cut the model's graph apart; a compiled model under a zero-bubble
    `pipeline_schedule` (a compiled block's backward computes the input and the weight
    gradients in one call, which those schedules run apart: torch refuses them for stages
    compiled with `torch.compile(module)`, and through titan's in-place `module.compile()`
    the step fails on the compiled backward's donated buffers); async TP (`async_tp`,
    `--parallelism.enable_async_tensor_parallel`) under TP without inductor compiling the
    model, whose graphs are where it fuses TP's collectives with the matmuls, or without
    sequence parallel (`sequence_parallel`), whose all-gathers and reduce-scatters are the
    only collectives it fuses (TP without SP all-reduces): either way the flag would change
    nothing."""
    if async_tp and parallel_dims.tp_enabled and not (config.compiles_model and config.backend == "inductor"):
        raise ValueError("--parallelism.enable_async_tensor_parallel overlaps TP's collectives with the matmuls "
                         "inside inductor's compiled graphs; it needs --compile.enable (the model compiled, "
                         "--compile.backend inductor), or drop the flag")
    if parallel_dims.pp_enabled and config.compiles_model and pipeline_schedule in ZERO_BUBBLE_SCHEDULES:
        raise ValueError(f"--parallelism.pipeline_parallel_schedule {pipeline_schedule} runs each backward as an "
                         "input-gradient and a weight-gradient pass, which a compiled block cannot split (its "
                         "backward computes both at once); with --compile.enable pick 1F1B, Interleaved1F1B, GPipe "
                         "or LoopedBFS, or compile the loss only (--compile.components loss)")
    if async_tp and parallel_dims.tp_enabled and not sequence_parallel:
        raise ValueError("--parallelism.enable_async_tensor_parallel fuses sequence parallel's all-gathers and "
                         "reduce-scatters with the matmuls; without sequence parallel TP all-reduces instead, which "
                         "it cannot fuse: drop --parallelism.no_enable_sequence_parallel or the async flag")
    if not (config.compiles_model and config.granularity == "model"):
        return
    if parallel_dims.uses_fully_shard or parallel_dims.pp_enabled:
        raise ValueError("--compile.granularity model compiles one graph of the whole model, which FSDP2's per-block "
                         "hooks and pipeline stages cut apart; use --compile.granularity block (the default) with "
                         "FSDP/HSDP or pipeline parallel")
