"""`titan plan` against published measurements: predicted tokens/s/GPU of each published run's
own layout, and where the planner ranks that layout among every valid one.

    python tools/plan_vs_published.py            # markdown table
    python tools/plan_vs_published.py --json

The published rows are torchtitan's Llama 3.1 benchmarks on H100 (December 2024, the
`benchmarks/llama3_h100_202412_torchtitan.md` file of the torchtitan repository): Grand Teton
hosts, 8 H100 per host with 96 GB HBM2e (2.4 TB/s) at 500 W, 400 Gb/s RDMA per GPU, seq 8192.
The hardware profile is the H100 one with that memory; the planner's constants are fitted on
the 8B rows on 8 GPUs only (eager: the kernel efficiency; compiled: compile's speedup; float8:
the casts' memory traffic), so every other row is a prediction. Runs one
process on CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
from titan.dist.dry_run import measure_compiled_block_units
from titan.dist.fsdp import DTYPES
from titan.dist.pipeline import microbatch_count_problem
from titan.dist.plan import blocks_of
from titan.dist.planner import (
    Layout,
    Prediction,
    Workload,
    enumerate_layouts,
    parse_gpus,
    predict,
    rank_layouts,
)

from titan.recipes.cli import parse_train_args
from titan.recipes.dry_run import model_builder
from titan.recipes.plan import model_facts, passes_engine_checks


@dataclasses.dataclass(frozen=True, kw_only=True)
class Published:
    """One published run: its model, cluster, layout, options and measured tokens/s/GPU."""

    name: str
    recipe: str
    gpus: int
    layout: Layout
    global_batch: int
    seq_len: int
    compile: bool
    float8: bool
    tokens_per_s: float
    memory_gib: float | None
    """The published peak memory (GiB, the largest rank; None: not published)."""
    async_tp: bool = False
    note: str = ""


def _lay(pp=1, dp=1, tp=1, cp=1, ac="selective", local=1, micro=None, schedule="1F1B", stages=1) -> Layout:
    return Layout(pp=pp, dp_replicate=1, dp_shard=dp, cp=cp, tp=tp, ep=1, ac=ac, local_batch_size=local,
                  microbatch_size=micro or local, schedule=schedule, stages_per_rank=stages)


PUBLISHED = [
    Published(name="8B, 8 GPUs, FSDP (fitted)", recipe="llama3_8b", gpus=8, layout=_lay(dp=8, local=2),
              global_batch=16, seq_len=8192, compile=False, float8=False, tokens_per_s=5762, memory_gib=82.4),
    Published(name="8B, 8 GPUs, FSDP + compile", recipe="llama3_8b", gpus=8, layout=_lay(dp=8, local=2),
              global_batch=16, seq_len=8192, compile=True, float8=False, tokens_per_s=6667, memory_gib=77.0),
    Published(name="8B, 8 GPUs, FSDP + compile + float8", recipe="llama3_8b", gpus=8, layout=_lay(dp=8, local=2),
              global_batch=16, seq_len=8192, compile=True, float8=True, tokens_per_s=8532, memory_gib=76.8),
    Published(name="8B, 128 GPUs, FSDP", recipe="llama3_8b", gpus=128, layout=_lay(dp=128, local=2),
              global_batch=256, seq_len=8192, compile=False, float8=False, tokens_per_s=5605, memory_gib=67.0),
    Published(name="8B, 128 GPUs, FSDP + compile", recipe="llama3_8b", gpus=128, layout=_lay(dp=128, local=2),
              global_batch=256, seq_len=8192, compile=True, float8=False, tokens_per_s=6514, memory_gib=62.0),
    Published(name="8B, 128 GPUs, FSDP + compile + float8", recipe="llama3_8b", gpus=128,
              layout=_lay(dp=128, local=2), global_batch=256, seq_len=8192, compile=True, float8=True,
              tokens_per_s=8380, memory_gib=61.8),
    *[Published(name=f"8B, 8 GPUs, FSDP {8 // cp}" + (f" x CP {cp}" if cp > 1 else "") + f", seq {seq}",
                recipe="llama3_8b", gpus=8, layout=_lay(dp=8 // cp, cp=cp, ac="full", local=1), global_batch=8 // cp,
                seq_len=seq, compile=True, float8=True, tokens_per_s=tps, memory_gib=mem)
      for cp, seq, tps, mem in [(1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5)]],
    Published(name="70B, 256 GPUs, FSDP 32 x TP 8", recipe="llama3_70b", gpus=256,
              layout=_lay(dp=32, tp=8, ac="full", local=16), global_batch=512, seq_len=8192, compile=True,
              float8=True, tokens_per_s=829, memory_gib=71.9),
    Published(name="70B, 256 GPUs, FSDP 32 x TP 8, async TP", recipe="llama3_70b", gpus=256,
              layout=_lay(dp=32, tp=8, ac="full", local=16), global_batch=512, seq_len=8192, compile=True,
              float8=True, tokens_per_s=876, memory_gib=67.6, async_tp=True),
    Published(name="405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, 1F1B", recipe="llama3_405b", gpus=512,
              layout=_lay(pp=8, dp=8, tp=8, ac="full", local=32, micro=4), global_batch=256, seq_len=8192,
              compile=True, float8=True, tokens_per_s=100, memory_gib=82.5, async_tp=True,
              note="microbatch 4: torchtitan's default of pp microbatches"),
    Published(name="405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B", recipe="llama3_405b", gpus=512,
              layout=_lay(pp=8, dp=8, tp=8, ac="full", local=32, micro=2, schedule="Interleaved1F1B", stages=2),
              global_batch=256, seq_len=8192, compile=True, float8=True, tokens_per_s=128, memory_gib=72.7, async_tp=True,
              note="microbatch 2: torchtitan's default of pp x stages per rank microbatches"),
]
PUBLISHED += [
    Published(name=f"405B, 512 GPUs, FSDP {8 // cp}" + (f" x CP {cp}" if cp > 1 else "") + f" x TP 8 x PP 8, seq {seq}",
              recipe="llama3_405b", gpus=512, layout=_lay(pp=8, dp=8 // cp, cp=cp, tp=8, ac="full", local=8, micro=1),
              global_batch=8 * (8 // cp), seq_len=seq, compile=True, float8=True, tokens_per_s=tps, memory_gib=mem,
              async_tp=True, note="microbatch 1: torchtitan's default of pp microbatches")
    for cp, seq, tps, mem in [(1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                              (8, 262144, 16, 84.9)]]
PUBLISHED.append(
    Published(name="405B, 128 GPUs, FSDP 16 x TP 8 (2D, mid 2024)", recipe="llama3_405b", gpus=128,
              layout=_lay(dp=16, tp=8, ac="full", local=2), global_batch=32, seq_len=8192, compile=True,
              float8=True, tokens_per_s=185, memory_gib=None, async_tp=True,
              note="torchtitan's docs/performance.md before the 2024-12 benchmark: same H100s; memory not "
                   "published; compile on (its async TP needs it)"))
"""torchtitan's published Llama 3.1 runs on H100 (every row of the six tables of its December 2024
benchmark, and its earlier 2D 405B run)."""


BENCHMARK_H100 = {"memory_gib": 96.0, "memory_tbps": 2.4}
"""The benchmark's H100s: 96 GB of HBM2e at 2.4 TB/s (the H100 profile has 80 GB at 3.35 TB/s)."""


def torchtitan_selective_units(model) -> float:
    """Model-width units per token torchtitan's per-op selective AC keeps in a Llama block: the
    output of every compute op on its list except every second matmul, counted per block in
    the order a Llama block calls them (wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2 kept), plus
    the block input and the attention output. titan's own policy keeps every matmul's output
    (`titan.dist.dry_run.selective_op_units`): 12.5 units for 8B against torchtitan's 7.75."""
    (_, block), *_ = blocks_of(model)
    attention, ffn = block.attention, block.feed_forward
    kept = attention.wq.out_features + attention.wv.out_features + ffn.w1.out_features + ffn.w2.out_features
    return 2 + kept / ffn.w2.out_features


def torchtitan_policy_context():
    """Selective-checkpoint contexts of torchtitan's per-op policy for a Llama block: save the
    attention's output and every second matmul's (the first, third, ... of the block's
    forward), recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    attention = {torch.ops.aten._scaled_dot_product_flash_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default}
    matmuls = [0]

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            if not ctx.is_recompute:
                matmuls[0] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def torchtitan_compiled_selective_units(config) -> float:
    """What a compiled block keeps under torchtitan's per-op policy, measured as titan's own
    (AOTAutograd's min-cut partition under the policy's tags, fake tensors)."""
    build, _, _ = model_builder(config)
    return measure_compiled_block_units(build, dtype=DTYPES[config.training.mixed_precision_param],
                                        context_fn=torchtitan_policy_context)


def compare(row: Published) -> dict:
    """The planner's prediction of `row`'s own layout and that layout's rank among all."""
    config = parse_train_args(["--config", row.recipe, "--training.seq_len", str(row.seq_len),
                               *(["--compile.enable"] if row.compile else [])])
    _, hw = parse_gpus(f"{row.gpus}xH100", BENCHMARK_H100)
    facts, n_experts, probe = model_facts(config)
    # torchtitan's policy, not titan's, eager and compiled.
    facts = dataclasses.replace(facts, selective_units=torchtitan_selective_units(probe),
                                selective_units_compiled=torchtitan_compiled_selective_units(config) if row.compile
                                else None)
    # torchtitan's float8 rows ran the tensorwise recipe, whose TP gathers move float8.
    work = Workload(global_batch_size=row.global_batch, seq_len=row.seq_len, compile=row.compile, float8=row.float8,
                    float8_tensor_parallel=row.float8, async_tp=row.async_tp)
    own = predict(facts, row.layout, work, hw)
    ranked = rank_layouts(facts, enumerate_layouts(facts, row.gpus, work, n_experts=n_experts), work, hw,
                          valid=passes_engine_checks(probe, work.seq_len, work.global_batch_size))
    same = [i for i, p in enumerate(ranked, 1) if _same_layout(p.layout, row.layout)]
    best = ranked[0]
    return {"name": row.name, "published": row.tokens_per_s, "predicted": own.tokens_per_s_per_device,
            "error": own.tokens_per_s_per_device / row.tokens_per_s - 1,
            "memory_gib": own.memory["total"] / 1024**3, "published_memory_gib": row.memory_gib,
            "memory_error": own.memory["total"] / 1024**3 / row.memory_gib - 1 if row.memory_gib else None,
            "fits": own.fits, "rank": same[0] if same else None,
            "of": len(ranked), "best": best.layout.describe() + f", AC {best.layout.ac_label}"
            + (f", {best.layout.schedule}" if best.layout.pp > 1 else ""),
            "best_tokens_per_s": best.tokens_per_s_per_device, "dominant": own.dominant, "note": row.note}


def _same_layout(a: Layout, b: Layout) -> bool:
    keys = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "ac", "local_batch_size", "schedule",
            "reshard_after_forward")
    return all(getattr(a, k) == getattr(b, k) for k in (*keys, "microbatch_size"))


def _rank_cell(row: dict, tokens_per_s: float | None) -> str:
    """'4 of 3597 (-1.4%)': the rank, and below the first choice how far its prediction falls
    (within `titan plan`'s 5% tie band the order is not a finding)."""
    if not row["rank"]:
        return f"not enumerated ({row['of']} valid)"
    gap = "" if row["rank"] == 1 else f" ({100 * (tokens_per_s / row['best_tokens_per_s'] - 1):+.1f}%)"
    return f"{row['rank']} of {row['of']}{gap}"


def markdown(rows: list[dict]) -> str:
    """The comparison as a markdown table."""
    out = ["| published run | measured tokens/s/GPU | predicted | error | measured memory | predicted | error | "
           "rank of its layout | planner's first choice |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rank = _rank_cell(r, r["predicted"])
        measured, error = ((f"{r['published_memory_gib']:.1f} GiB", f"{100 * r['memory_error']:+.0f}%")
                           if r["published_memory_gib"] else ("not published", "-"))
        out.append(f"| {r['name']} | {r['published']:,.0f} | {r['predicted']:,.0f} | {100 * r['error']:+.0f}% | "
                   f"{measured} | {r['memory_gib']:.1f} GiB | {error} | "
                   f"{rank} | "
                   f"{r['best']} ({r['best_tokens_per_s']:,.0f}) |")
    return "\n".join(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronRun:
    """One row of Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", SC21, Table 1): a GPT with
    multi-head attention, vocabulary 51,200 and sequence 2,048, trained with full activation
    recomputation in mixed precision on DGX A100 80GB nodes (Selene: NVSwitch inside a node,
    8 x 200 Gb/s InfiniBand per node), data parallelism replicating the model (no sharding)."""

    params_b: float
    """Parameters (billions), as published."""
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    """Global batch (sequences)."""
    tflops: float
    """Achieved teraFLOP/s per GPU, counted with the paper's formula (recomputation included)."""
    aggregate_pflops: float
    """Achieved petaFLOP/s over all the GPUs, as published (a check of the transcription:
    `tflops` x `gpus` gives it to the table's rounding)."""

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        """The row's label in the table."""
        return f"{self.params_b:g}B, {self.gpus} GPUs, TP {self.tp} x PP {self.pp} x DP {self.dp}"


MEGATRON_SEQ, MEGATRON_VOCAB = 2048, 51200
MEGATRON = [MegatronRun(params_b=p, heads=a, hidden=h, layers=n, tp=t, pp=pp, gpus=g, batch=b, tflops=f,
                        aggregate_pflops=agg)
            for p, a, h, n, t, pp, g, b, f, agg in [
                (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 4.4), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
                (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 18.2), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
                (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 70.8), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
                (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
                (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
                (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
                (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0)]]
"""Every row of the table (A100 peak 312 teraFLOP/s: 44% of it for the smallest, 52% for the largest)."""

def megatron_flops_per_token(run: MegatronRun) -> float:
    """The paper's FLOP count per token: 96 l h^2 (1 + s / 6h + V / 16 l h), which counts each
    block's forward twice (full recomputation) and the output projection once."""
    h, n = run.hidden, run.layers
    return 96 * n * h * h * (1 + MEGATRON_SEQ / (6 * h) + MEGATRON_VOCAB / (16 * n * h))


def megatron_config(run: MegatronRun):
    """A Llama-family model with the run's GPT shape: width, depth and heads as published, every
    head its own K/V, SwiGLU at 8/3 of the width (the same FLOPs and parameters as GPT's 4x
    GELU MLP), the vocabulary and sequence of the table."""
    return parse_train_args(["--config", "llama3_debug", "--model.dim", str(run.hidden),
                             "--model.n_layers", str(run.layers), "--model.n_heads", str(run.heads),
                             "--model.n_kv_heads", str(run.heads), "--model.vocab_size", str(MEGATRON_VOCAB),
                             "--training.seq_len", str(MEGATRON_SEQ), "--training.mixed_precision_param", "bfloat16"])


def _megatron_own_layouts(run: MegatronRun) -> list[Layout]:
    """The run's published degrees (DP replicating, full AC) with every choice the table leaves
    open: the microbatch (and, without PP, gradient accumulation) and the pipeline schedule."""
    local = run.batch // run.dp
    if run.pp == 1:
        return [Layout(pp=1, dp_replicate=run.dp, dp_shard=1, cp=1, tp=run.tp, ep=1, ac="full",
                       local_batch_size=local, microbatch_size=micro, schedule="1F1B")
                for micro in (1, 2, 4, 8, 16, 32) if local % micro == 0]
    return [Layout(pp=run.pp, dp_replicate=run.dp, dp_shard=1, cp=1, tp=run.tp, ep=1, ac="full",
                   local_batch_size=local, microbatch_size=micro, schedule=schedule, stages_per_rank=stages)
            for micro in (1, 2, 4) if local % micro == 0
            for schedule, stages in (("1F1B", 1), ("Interleaved1F1B", 2))
            if run.layers >= run.pp * stages and not microbatch_count_problem(schedule, run.pp, local // micro)]


@functools.cache
def _megatron_model(run: MegatronRun):
    """(ModelFacts, the meta model, the Workload) of a run."""
    facts, _, probe = model_facts(megatron_config(run))
    # Megatron-LM in 2021: no sequence parallelism, the logits gathered whole for the loss, the
    # gradients all-reduced once per step, after the last accumulated microbatch's backward.
    work = Workload(global_batch_size=run.batch, seq_len=MEGATRON_SEQ, sequence_parallel=False, loss_parallel=False,
                    overlap_grad_allreduce=False)
    return facts, probe, work


def _selene(run: MegatronRun, efficiency: float):
    """The A100 profile (80 GB, NVSwitch, 25 GB/s of network per GPU: Selene's wiring) with the
    kernel efficiency fitted on the table's first row (`fit_megatron_efficiency`)."""
    return parse_gpus(f"{run.gpus}xA100", {"matmul_efficiency": efficiency})[1]


def _best_own(run: MegatronRun, facts, probe, hw, work) -> Prediction:
    """The fastest fitting prediction among the run's own layouts that titan accepts."""
    valid = passes_engine_checks(probe, MEGATRON_SEQ, run.batch)
    preds = [predict(facts, layout, work, hw) for layout in _megatron_own_layouts(run) if valid(layout)]
    return max(preds, key=lambda p: (p.fits, p.tokens_per_s_per_device))


def fit_megatron_efficiency(run: MegatronRun | None = None) -> float:
    """The kernel efficiency at which the planner reproduces `run` (the table's first row:
    one A100 node's worth of data parallelism, compute-bound), by bisection."""
    run = run or MEGATRON[0]
    measured = run.tflops * 1e12 / megatron_flops_per_token(run)
    low, high = 0.05, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        facts, probe, work = _megatron_model(run)
        predicted = _best_own(run, facts, probe, _selene(run, mid), work).tokens_per_s_per_device
        low, high = (mid, high) if predicted < measured else (low, mid)
    return (low + high) / 2


def compare_megatron(run: MegatronRun, efficiency: float) -> dict:
    """The planner against one Megatron-LM row: its own degrees' prediction, and where the
    planner ranks the best layout with the published TP and PP among every valid one."""
    facts, probe, work = _megatron_model(run)
    hw = _selene(run, efficiency)
    measured = run.tflops * 1e12 / megatron_flops_per_token(run)
    own = _best_own(run, facts, probe, hw, work)
    # No CP at 2,048 tokens; the schedules Megatron-LM ran in 2021 (no zero-bubble ones).
    layouts = enumerate_layouts(facts, run.gpus, work, max_cp=1, schedules=("1F1B", "Interleaved1F1B", "GPipe"))
    ranked = rank_layouts(facts, layouts, work, hw, valid=passes_engine_checks(probe, MEGATRON_SEQ, run.batch))
    same = [i for i, p in enumerate(ranked, 1) if (p.layout.tp, p.layout.pp) == (run.tp, run.pp)]
    best = ranked[0]
    lay = own.layout
    choice = (f"micro {lay.microbatch_size}, {lay.schedule}" if lay.pp > 1
              else f"micro {lay.microbatch_size} x {run.batch // run.dp // lay.microbatch_size} accumulated")
    return {"name": run.name, "params_b": run.params_b, "titan_params_b": facts.num_params / 1e9,
            "tflops": run.tflops, "published_mfu": run.tflops / hw.peak_bf16_tflops, "published": measured,
            "predicted": own.tokens_per_s_per_device, "error": own.tokens_per_s_per_device / measured - 1,
            "choice": choice, "fits": own.fits, "dominant": own.dominant, "rank": same[0] if same else None,
            "rank_tokens_per_s": ranked[same[0] - 1].tokens_per_s_per_device if same else None,
            "of": len(ranked), "best": best.layout.describe() + f", AC {best.layout.ac_label}"
            + (f", {best.layout.schedule}" if best.layout.pp > 1 else ""),
            "best_tokens_per_s": best.tokens_per_s_per_device}


def markdown_megatron(rows: list[dict], efficiency: float) -> str:
    """The Megatron-LM comparison as a markdown table."""
    out = [f"Kernel efficiency fitted on the first row: {efficiency:.3f} of the A100's peak.", "",
           "| Megatron-LM run (A100 80GB) | teraFLOP/s/GPU (of peak) | tokens/s/GPU | predicted | error | "
           "choices not published (the prediction's) | rank of its TP x PP | planner's first choice |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rank = _rank_cell(r, r["rank_tokens_per_s"])
        out.append(f"| {r['name']} | {r['tflops']:g} ({100 * r['published_mfu']:.0f}%) | {r['published']:,.0f} | "
                   f"{r['predicted']:,.0f} | {100 * r['error']:+.0f}% | {r['choice']} | {rank} | "
                   f"{r['best']} ({r['best_tokens_per_s']:,.0f}) |")
    return "\n".join(out)


def main() -> None:
    """Print the comparisons (markdown, or JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=("torchtitan", "megatron"), default=None, help="print one table")
    args = parser.parse_args()
    rows = [compare(row) for row in PUBLISHED] if args.only != "megatron" else []
    efficiency = fit_megatron_efficiency() if args.only != "torchtitan" else None
    megatron = [compare_megatron(run, efficiency) for run in MEGATRON] if efficiency else []
    if args.json:
        print(json.dumps({"torchtitan": rows, "megatron": megatron, "megatron_efficiency": efficiency}, indent=1))
        return
    if rows:
        print(markdown(rows))
    if megatron:
        print(("\n" if rows else "") + markdown_megatron(megatron, efficiency))


if __name__ == "__main__":
    main()
