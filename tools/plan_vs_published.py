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
import json

import torch
from titan.dist.dry_run import measure_compiled_block_units
from titan.dist.fsdp import DTYPES
from titan.dist.plan import blocks_of
from titan.dist.planner import (
    Layout,
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
    work = Workload(global_batch_size=row.global_batch, seq_len=row.seq_len, compile=row.compile, float8=row.float8,
                    async_tp=row.async_tp)
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
            "of": len(ranked), "best": best.layout.describe() + f", AC {best.layout.ac}",
            "best_tokens_per_s": best.tokens_per_s_per_device, "dominant": own.dominant, "note": row.note}


def _same_layout(a: Layout, b: Layout) -> bool:
    keys = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "ac", "local_batch_size", "schedule")
    same = all(getattr(a, k) == getattr(b, k) for k in keys)
    return same and (a.pp == 1 or a.microbatch_size == b.microbatch_size)


def markdown(rows: list[dict]) -> str:
    """The comparison as a markdown table."""
    out = ["| published run | measured tokens/s/GPU | predicted | error | measured memory | predicted | error | "
           "rank of its layout | planner's first choice |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rank = f"{r['rank']} of {r['of']}" if r["rank"] else f"not enumerated ({r['of']} valid)"
        measured, error = ((f"{r['published_memory_gib']:.1f} GiB", f"{100 * r['memory_error']:+.0f}%")
                           if r["published_memory_gib"] else ("not published", "-"))
        out.append(f"| {r['name']} | {r['published']:,.0f} | {r['predicted']:,.0f} | {100 * r['error']:+.0f}% | "
                   f"{measured} | {r['memory_gib']:.1f} GiB | {error} | "
                   f"{rank} | "
                   f"{r['best']} ({r['best_tokens_per_s']:,.0f}) |")
    return "\n".join(out)


def main() -> None:
    """Print the comparison (markdown, or JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [compare(row) for row in PUBLISHED]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
