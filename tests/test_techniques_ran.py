"""Each parallelism technique really ran, not only "the numbers match".

The parity matrix (test_parallel_parity.py) proves a layout trains like one process; it stays
green if a technique is silently off (no SP, no bf16, no compile: all still match). Here the
real trainer is built from `titan train` flags by ``techniques_worker.py``, one watched step
runs, and each test asserts on what the technique must leave behind: DTensor placements of
activations, activation dtypes, the FSDP2 state of parameters after forward, the pipeline
schedule object, the mesh, and the compiled blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from launching import launch_runs

WORKER = Path(__file__).with_name("techniques_worker.py")
# Tiny and short: one step of debugmodel_tiny (4 layers, dim 64) on 2 x 32 tokens per rank.
COMMON = [
    "--config", "llama3_debug_synthetic",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", "1",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
]
NO_DP = ["--parallelism.data_parallel_shard_degree", "1"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = [*NO_DP, "--parallelism.tensor_parallel_degree", "2"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
LINEARS = ("attention.wq", "feed_forward.w2")
# float8 with torch's reference GEMM emulated (the casts and collectives are the real ones).
FLOAT8 = ["--quantize.linear.float8.emulate", "--quantize.linear.float8.recipe"]
NORMS = ("attention_norm", "ffn_norm")


PP_STAGES = {
    # 4 one-layer stages on 2 ranks: looped (stage s on rank s % 2) or V-shaped (r, 3 - r).
    "Interleaved1F1B": {0: [0, 2], 1: [1, 3]},
    "ZBVZeroBubble": {0: [0, 3], 1: [1, 2]},
}
# Every observed run: name -> (ranks, flags). The runs of one world size share one launch.
RUNS: dict[str, tuple[int, list[str]]] = {
    # The parity matrix's compile geometry (8 x 32 tokens, deterministic): one inductor
    # compile of the block graph serves both (the test run's cache, conftest.py).
    "compile": (1, ["--compile.enable", "--training.local_batch_size", "8", "--debug.deterministic", "--debug.seed", "0"]),
    "bf16_autocast": (1, BF16),
    "fsdp_bf16_reshard_always": (2, [*FSDP2, *BF16, "--parallelism.fsdp_reshard_after_forward", "always"]),
    "fsdp_reshard_never": (2, [*FSDP2, "--parallelism.fsdp_reshard_after_forward", "never"]),
    "tp_sp": (2, TP2),
    "tp_sp_float8": (2, [*TP2, *FLOAT8, "tensorwise"]),
    "tp_sp_float8_rowwise": (2, [*TP2, *FLOAT8, "rowwise"]),
    "tp_no_sp": (2, [*TP2, "--parallelism.no_enable_sequence_parallel", "--parallelism.no_enable_loss_parallel"]),
    **{f"pp_{schedule}": (2, [*NO_DP, "--parallelism.pipeline_parallel_degree", "2",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--parallelism.pipeline_parallel_layers_per_stage", "1"])
       for schedule in PP_STAGES},
    "hsdp": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"]),
}


def reads(name: str) -> pytest.MarkDecorator:
    """Tests that read one launch go to the pytest-xdist worker that launches it (conftest.py)."""
    ranks = RUNS[name][0]
    # One worker runs every one-process compile, so the first fills the inductor cache.
    return pytest.mark.xdist_group("inductor_one_process" if ranks == 1 else f"techniques_ranks{ranks}")


@pytest.fixture(scope="module")
def observed(build_once) -> Callable[[str], list[dict[str, Any]]]:
    """name -> each rank's observations of that run (by rank), launching the runs of its
    world size together on first use, once per session."""

    def launch_group(ranks: int, folder: Path) -> None:
        runs = [[str(folder / name), [*COMMON, "--job.dump_folder", str(folder / name / "dump"), *flags]]
                for name, (n, flags) in RUNS.items() if n == ranks]
        launch_runs(ranks, WORKER, runs, folder / "launch.log", torchrun=False)

    def observations(name: str) -> list[dict[str, Any]]:
        ranks = RUNS[name][0]
        folder = build_once(f"techniques_ranks{ranks}", lambda f: launch_group(ranks, f))
        return [json.loads((folder / name / f"rank{r}.json").read_text()) for r in range(ranks)]

    return observations


def outputs(rank: dict[str, Any], suffixes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """First-forward output descriptions of the watched modules whose name ends in a suffix."""
    found = {name: entry["output"] for name, entry in rank["forward"].items() if name.endswith(suffixes)}
    assert found, f"no forward seen for modules ending in {suffixes}: {sorted(rank['forward'])}"
    return found


def blocks(rank: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The watched transformer blocks (`<part>:layers.<i>`) of one rank."""
    return {name: e for name, e in rank["forward"].items() if re.fullmatch(r"\d+:layers\.\d+", name)}


@pytest.mark.slow
@reads("compile")
def test_compile_compiles_every_block(observed):
    """The matrix's compile layout: every block carries a compiled call, dynamo captured a
    graph and inductor generated code for it."""
    (rank,) = observed("compile")
    compiled = rank["compile"]
    assert compiled["blocks_compiled"] and all(compiled["blocks_compiled"].values()), (
        f"blocks without a compiled call: {compiled['blocks_compiled']}")
    assert compiled["dynamo_stats"].get("unique_graphs", 0) >= 1, f"dynamo captured no graph: {compiled}"
    inductor = compiled["inductor"]
    assert inductor.get("fxgraph_cache_miss", 0) + inductor.get("fxgraph_cache_hit", 0) >= 1, (
        f"inductor compiled no graph: {compiled}")


@pytest.mark.slow
@reads("bf16_autocast")
def test_bf16_autocast_on_one_process(observed):
    """One process: autocast runs the linears in bf16 while the weights stay fp32."""
    (rank,) = observed("bf16_autocast")
    for name, out in outputs(rank, (*LINEARS, "output")).items():
        assert out["dtype"] == "bfloat16", f"{name} computed in {out['dtype']}, not bf16 (autocast off?)"
    for name, entry in rank["forward"].items():
        if name.endswith(LINEARS):
            assert entry["weight_dtype_in_forward"] == "float32", f"{name}: autocast must keep fp32 weights"
    # Control for the compile test: without --compile.enable no block carries a compiled call.
    assert rank["compile"]["blocks_compiled"] and not any(rank["compile"]["blocks_compiled"].values())


@pytest.mark.slow
@reads("fsdp_bf16_reshard_always")
def test_fsdp_bf16_policy_and_reshard_always(observed):
    """FSDP 2 with `--training.mixed_precision_param bfloat16` and reshard "always": blocks
    compute with bf16 gathered weights over fp32 master shards, and every block's parameters
    are back to their sharded DTensors as soon as its forward returns."""
    ranks = observed("fsdp_bf16_reshard_always")
    for rank in ranks:
        for name, out in outputs(rank, (*LINEARS, *NORMS, "output", "tok_embeddings")).items():
            assert out["dtype"] == "bfloat16", f"rank {rank['rank']} {name}: {out['dtype']} activations"
            assert rank["forward"][name]["weight_dtype_in_forward"] == "bfloat16", name
        for name, p in rank["params"]["0"].items():
            assert (p["type"], p["dtype"], p["placements"], p["mesh_dims"]) == (
                "DTensor", "float32", ["Shard(0)"], ["dp_shard_cp"]), f"master param {name}: {p}"
        states = {name: b["params_after_forward"] for name, b in blocks(rank).items()}
        assert len(states) == 4 and set(states.values()) == {"sharded"}, f"reshard always: {states}"


@pytest.mark.slow
@reads("fsdp_reshard_never")
def test_fsdp_reshard_never_keeps_params_gathered(observed):
    """Reshard "never": blocks keep their gathered (plain) parameters after forward. Also the
    fp32 control for the bf16 checks: without the flag nothing computes in bf16."""
    ranks = observed("fsdp_reshard_never")
    for rank in ranks:
        states = {name: b["params_after_forward"] for name, b in blocks(rank).items()}
        assert len(states) == 4 and set(states.values()) == {"unsharded"}, f"reshard never: {states}"
        assert {e["output"]["dtype"] for e in rank["forward"].values()} == {"float32"}


@pytest.mark.slow
@reads("tp_sp")
def test_tp_sequence_and_loss_parallel(observed):
    """TP 2 with SP and loss parallel (the defaults): every norm works on sequence shards
    (`Shard(1)` DTensor outputs on "tp") and the logits stay vocab-sharded (`Shard(-1)`)."""
    for rank in observed("tp_sp"):
        for name, out in outputs(rank, (*NORMS, ":norm")).items():
            layout = (out["type"], out["placements"], out["mesh_dims"])
            assert layout == ("DTensor", ["Shard(1)"], ["tp"]), (
                f"rank {rank['rank']} {name}: {out} (sequence parallel off?)")
        (logits,) = outputs(rank, (":output",)).values()
        last = len(logits["shape"]) - 1
        assert (logits["type"], logits["placements"]) == ("DTensor", [f"Shard({last})"]), (
            f"rank {rank['rank']} logits: {logits} (loss parallel off?)")


@pytest.mark.slow
@reads("tp_no_sp")
def test_tp_without_sequence_parallel(observed):
    """`--parallelism.no_enable_sequence_parallel` (and no loss parallel): norms see whole
    sequences as plain tensors and the logits are gathered plain tensors."""
    ranks = observed("tp_no_sp")
    for rank in ranks:
        for name, out in outputs(rank, (*NORMS, ":norm", ":output")).items():
            assert out["type"] != "DTensor" and out["placements"] is None, (
                f"rank {rank['rank']} {name}: {out}")


@pytest.mark.slow
@reads("tp_sp_float8")
def test_tp_gathers_float8_inputs_and_gradients_in_float8(observed):
    """float8 tensorwise under TP 2 + SP: each block's two sequence-parallel input gathers
    (attention, feed-forward) move float8 bytes (uint8 on gloo), and so do the backward's
    gathers of the row-parallel outputs' gradients; the output projection (high precision)
    and the row-wise recipe (control: per-row scales, gathered in high precision) do not."""
    blocks_per_rank = 4  # debugmodel_tiny
    float8, rowwise, plain = (observed(name) for name in ("tp_sp_float8", "tp_sp_float8_rowwise", "tp_sp"))
    for rank, rowwise_rank, plain_rank in zip(float8, rowwise, plain, strict=True):
        counts = rank["collectives"]
        # Forward: the attention and feed-forward inputs of every block (e4m3); backward: the
        # gradients of wo's and w2's outputs (e5m2).
        assert counts.get("all_gather_into_tensor:float8_e4m3fn") == 2 * blocks_per_rank, counts
        assert counts.get("all_gather_into_tensor:float8_e5m2") == 2 * blocks_per_rank, counts
        # Those are the high-precision run's gathers, moved to float8; the rest (the output
        # projection's input, forward and backward) stay.
        plain_gathers = plain_rank["collectives"]["all_gather_into_tensor:float32"]
        assert counts["all_gather_into_tensor:float32"] == plain_gathers - 4 * blocks_per_rank == 2, (
            counts, plain_rank["collectives"])
        # Reduce-scatters (partial sums) stay in high precision.
        assert counts["reduce_scatter_tensor:float32"] == plain_rank["collectives"]["reduce_scatter_tensor:float32"]
        assert rowwise_rank["collectives"] == plain_rank["collectives"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [pytest.param(s, marks=reads(f"pp_{s}")) for s in PP_STAGES])
def test_pp_schedule_class_and_stages(observed, schedule):
    """The schedule object is the named torch class, with the expected stages per rank."""
    ranks, stages = observed(f"pp_{schedule}"), PP_STAGES[schedule]
    for rank in ranks:
        pp = rank["pipeline"]
        assert pp["schedule_class"] == f"Schedule{schedule}", pp
        assert (pp["stage_indices"], pp["num_stages"]) == (stages[rank["rank"]], 4), pp
        # One layer per stage: the parts hold exactly their stages' blocks.
        assert rank["part_layers"] == [[str(s)] for s in stages[rank["rank"]]], rank["part_layers"]


@pytest.mark.slow
@reads("hsdp")
def test_hsdp_replicates_and_shards(observed):
    """HSDP 2 x 2: the mesh has the replicate degree, and every parameter is replicated over
    dp_replicate and sharded over dp_shard."""
    for rank in observed("hsdp"):
        assert rank["degrees"]["dp_replicate"] == 2 and rank["degrees"]["dp_shard"] == 2
        root = rank["mesh"]["root"]
        assert (root["dp_replicate"], root["dp_shard"]) == (2, 2), rank["mesh"]
        assert rank["mesh"]["fsdp"] == {"dp_replicate": 2, "dp_shard_cp": 2}, rank["mesh"]
        for name, p in rank["params"]["0"].items():
            expected = (["Replicate()", "Shard(0)"], ["dp_replicate", "dp_shard_cp"])
            assert (p["placements"], p["mesh_dims"]) == expected, f"rank {rank['rank']} {name}: {p}"
