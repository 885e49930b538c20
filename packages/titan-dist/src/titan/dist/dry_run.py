"""Dry run: validate, build the mesh and parallelize for any world size on one CPU.

A fake process group (torch's testing "fake" backend: every collective returns at once)
stands in for the cluster, and the model lives on the meta device, so a 512-rank 405B
configuration is checked in seconds without a GPU or any memory for weights. Ranks that
differ only along data/tensor/context axes hold same-sized shards, so one representative
rank per pipeline rank is parallelized and reported. That holds with expert parallel too:
every EP rank owns n_experts / ep experts, FSDP-sharded over the expert mesh, and the local
parameter count is read off the DTensor shards, so experts are counted sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan.dist.dims import ParallelDims
from titan.dist.plan import blocks_of, match_modules, sharding_plan

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Activation elements kept per token per block, in units of the model dim: everything, only
# what per-op selective checkpointing keeps (matmul outputs), or only the block input (a
# checkpointed block: full, or layer-selective's every k-th block). "none" is
# what autograd saves for titan's pre-norm attention + SwiGLU block in eager mode (measured with
# saved-tensor hooks, tests/test_dry_run.py: 22; the earlier 17 left out RoPE's float32
# intermediates and read 1.27x low); compiled blocks save less.
ACT_UNITS_PER_TOKEN = {"none": 22, "full": 1}
"""Activation elements kept per token per block, in model-dim units, with no AC and with the
whole block checkpointed; per-op selective AC depends on the block's linears
(`selective_op_units`). The layout planner (`titan.dist.planner`) uses the same figures."""


def selective_op_units(block: nn.Module, dim: int) -> float:
    """Model-width units per token `block` keeps under per-op selective AC
    (`titan.dist.activation_checkpoint` saves every matmul's output and recomputes the rest):
    its input, the attention's output and each linear's output; routed experts' grouped
    matmuls are recomputed. Measured with torch's `MemTracker` (tests/test_plan.py): 12.0 for
    the Llama debug block (12 predicted), 5.1 for the Qwen3-MoE one (5.0); Llama 3 8B: 12.5."""
    outputs = sum(m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    return 2 + outputs / dim


@dataclass
class RankEstimate:
    """Per-rank parameter count and memory estimate (bytes) for one pipeline rank."""

    ranks: str
    pp_rank: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    recompute_bytes: int = 0
    """With activation checkpointing: the activations of the one block whose backward is
    running, rebuilt by its recomputation and freed after it (a transient the peak includes)."""

    @property
    def total_bytes(self) -> int:
        """Params + grads + optimizer states + activations (+ one block's recomputation)."""
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes
                + self.recompute_bytes)

    def components(self) -> str:
        """The estimate's parts, e.g. ``params 18.64 MiB, grads ..., activations 1.61 GiB``."""
        parts = [f"params {format_bytes(self.param_bytes)}", f"grads {format_bytes(self.grad_bytes)}",
                 f"optimizer {format_bytes(self.optimizer_bytes)}", f"activations {format_bytes(self.activation_bytes)}"]
        if self.recompute_bytes:
            parts.append(f"recomputed block {format_bytes(self.recompute_bytes)}")
        return ", ".join(parts)

    def line(self) -> str:
        """One human-readable report line."""
        return (f"ranks {self.ranks:>12} (pp {self.pp_rank}): {self.params:,} params | "
                f"{self.components()}, total {format_bytes(self.total_bytes)}")


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _local_numel(module: nn.Module) -> int:
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
               for p in module.parameters())


def _output_modules(model: nn.Module) -> list[nn.Module]:
    """The modules the plan marks as the final ("output") projection that this part holds."""
    plan = sharding_plan(model)
    globs = [g for g, style in getattr(plan, "tensor_parallel", {}).items() if style == "output"]
    return [m for g in globs for _, m in match_modules(model, g) if m is not None]


def _model_shape(model: nn.Module) -> tuple[int, int]:
    """(model dim, vocab size) from the shape of the output projection's [vocab, dim] weight,
    which the model's sharding plan names: no family attribute is read."""
    outputs = _output_modules(model)
    if not outputs:
        raise ValueError("the dry run needs the model's sharding plan to name its output projection "
                         "(tensor_parallel style \"output\")")
    vocab, dim = outputs[0].weight.shape
    return int(dim), int(vocab)


def kept_units(ac, n_layers: int, selective_units: float) -> tuple[float, float]:
    """(activation units kept per token over `n_layers` blocks, units one checkpointed block
    rebuilds in its backward) under the activation-checkpointing config `ac`: "selective"
    with `selective_op` keeps `selective_units` (the blocks' `selective_op_units`) in every
    block; otherwise it checkpoints whole blocks 0, k, 2k, ... (k = `selective_layer_every`),
    which keep their input only."""
    none, full = ACT_UNITS_PER_TOKEN["none"], ACT_UNITS_PER_TOKEN["full"]
    if ac.mode == "none" or not n_layers:
        return none * n_layers, 0.0
    if ac.mode == "selective" and ac.selective_op:
        return selective_units * n_layers, none - selective_units
    every = 1 if ac.mode == "full" else ac.selective_layer_every
    checkpointed = -(-n_layers // every)
    return checkpointed * full + (n_layers - checkpointed) * none, none - full


def _activation_bytes(parts: list[nn.Module], dims: ParallelDims, cfg, ac,
                      dim: int, vocab: int, tokens: int, logit_tokens: int,
                      activation_dtype: str) -> tuple[int, int]:
    """(bytes of the activations kept for backward, bytes of one block's recomputation)."""
    act_bytes = _BYTES[activation_dtype]
    blocks = [block for p in parts for _, block in blocks_of(p)]
    layers = len(blocks)
    selective = sum(selective_op_units(b, dim) for b in blocks) / max(layers, 1)
    # Sequence parallel shards the residual stream over tp; without it only matmul
    # intermediates are sharded: count half of it as sharded.
    tp_div = dims.tp if cfg.enable_sequence_parallel else max(1.0, dims.tp / 2)
    per_dim = dim * tokens * act_bytes / tp_div  # one model-dim-wide tensor of the microbatch
    kept, rebuilt = kept_units(ac, layers, selective)
    # fp32 logits live for one microbatch only: the last stage runs its backward right after
    # its forward, so they are not multiplied by the microbatches in flight.
    logits = logit_tokens * vocab * 4 / dims.tp if any(_output_modules(p) for p in parts) else 0
    # A checkpointed block's backward first recomputes everything its forward saved, for one
    # microbatch (logit_tokens: a microbatch's tokens, also under pipeline parallel).
    recompute = rebuilt * per_dim * logit_tokens / tokens
    return int(kept * per_dim + logits), int(recompute)


def _estimate_rank(model_fn, dims: ParallelDims, rank: int, *, parallelism, activation_checkpoint,
                   compile, local_batch_size: int, seq_len: int, optimizer_states: int,
                   activation_dtype: str):
    from titan.dist.parallelize import parallelize
    from titan.dist.pipeline import build_pipeline
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        dims.rank = rank
        root = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = model_fn()
        dim, vocab = _model_shape(model)
        if dims.pp_enabled:
            _, parts, _, _ = build_pipeline(
                model, dims, parallelism=parallelism, activation_checkpoint=activation_checkpoint,
                compile=compile, loss_fn=lambda out, tgt: out.sum(),
                local_batch_size=local_batch_size, device=torch.device("cpu"))
            # 1F1B-style schedules keep up to pp microbatches in flight on the first stage.
            micro = parallelism.pipeline_parallel_microbatch_size
            tokens = micro * min(dims.pp, local_batch_size // micro) * seq_len // dims.cp
            logit_tokens = micro * seq_len // dims.cp
        else:
            parts = [parallelize(model, dims, root, parallelism=parallelism,
                                 activation_checkpoint=activation_checkpoint, compile=compile)]
            tokens = logit_tokens = local_batch_size * seq_len // dims.cp
        params = sum(_local_numel(p) for p in parts)
        acts = _activation_bytes(parts, dims, parallelism, activation_checkpoint, dim, vocab,
                                 tokens, logit_tokens, activation_dtype)
        return params, *acts
    finally:
        dist.destroy_process_group()


def dry_run(model_fn: Callable[[], nn.Module], parallelism, *, world_size: int,
            activation_checkpoint, compile, local_batch_size: int, seq_len: int,
            global_batch_size: int = -1, optimizer_states: int = 2,
            activation_dtype: str = "float32", print_fn: Callable[[str], None] | None = print) -> list[RankEstimate]:
    """Validate and parallelize a configuration for `world_size` ranks on this one CPU.

    `model_fn()` builds the model (it is called under the meta device). Prints, and returns,
    one `RankEstimate` per pipeline rank: the local parameter count and a memory estimate of
    fp32 params, fp32 grads, `optimizer_states` fp32 states per param (AdamW: 2) and
    activations (in `activation_dtype`, the FSDP compute dtype). Must run in a process
    without a process group.
    """
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group")
    dims = ParallelDims.from_config(parallelism, world_size)
    with torch.device("meta"):
        probe = model_fn()
    validate_against_model(dims, probe, seq_len=seq_len, global_batch_size=global_batch_size,
                           local_batch_size=local_batch_size)
    per_pp = world_size // dims.pp
    estimates = []
    for pp_rank in range(dims.pp):
        params, acts, recompute = _estimate_rank(
            model_fn, dims, pp_rank * per_pp, parallelism=parallelism,
            activation_checkpoint=activation_checkpoint, compile=compile,
            local_batch_size=local_batch_size, seq_len=seq_len,
            optimizer_states=optimizer_states, activation_dtype=activation_dtype)
        est = RankEstimate(ranks=f"{pp_rank * per_pp}-{(pp_rank + 1) * per_pp - 1}",
                           pp_rank=pp_rank, params=params, param_bytes=4 * params,
                           grad_bytes=4 * params, optimizer_bytes=4 * optimizer_states * params,
                           activation_bytes=acts, recompute_bytes=recompute)
        estimates.append(est)
        if print_fn is not None:
            print_fn(est.line())
    return estimates


def validate_against_model(dims: ParallelDims, model: nn.Module, *, seq_len: int,
                           global_batch_size: int, local_batch_size: int) -> None:
    """ParallelDims.validate_model with what the (meta) model's sharding plan declares (sizes
    the TP / EP degrees must divide, the blocks PP splits, tied parameters, expert modules
    for EP), before any parallelization: raises ValueError naming the values and the fix."""
    from titan.dist.pipeline import check_pipeline_ties

    plan = sharding_plan(model)
    if dims.ep_enabled and not getattr(plan, "expert_modules", None):
        raise ValueError(
            f"expert_parallel_degree={dims.ep} needs an MoE model whose sharding plan names "
            f"its expert_modules; {type(model).__name__} declares none. Set "
            f"--parallelism.expert_parallel_degree 1")
    dims.validate_model(
        n_layers=len(list(blocks_of(model))), seq_len=seq_len, global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        tensor_parallel_divisible=getattr(plan, "tensor_parallel_divisible", None),
        expert_parallel_divisible=getattr(plan, "expert_parallel_divisible", None))
    check_pipeline_ties(model, dims.pp)
