"""The MoE families through the whole stack: `titan train` of `qwen3_moe_debug` and
`deepseek_v3_debug` learns, the engine's after-step hook moves the load-balancing bias, which
the checkpoint carries, and expert-parallel layouts equal one process.

The reference and multi-rank runs of both families share launches (one per world size, see
tests/conftest.py): every test of a group passes the same runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from forked_cli import run_command
from launching import launch_train_runs
from titan.ckpt import load_dcp_model

STEPS = 30
DSV3_STEPS = 15  # DeepSeek-V3's debug model learns the byte stream faster (6.2 -> ~2.5 by step 10)


def titan_train(dump: Path, *flags: str) -> list[dict]:
    """One single-process `titan train` run; returns the metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "titan.recipes.cli", "train", "--job.dump_folder", str(dump), *flags]
    result = run_command(cmd, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_qwen3_moe_debug_trains_with_falling_loss_and_balances(tmp_path):
    rows = titan_train(
        tmp_path, "--config", "qwen3_moe_debug", "--training.steps", str(STEPS),
        "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "5",
        "--metrics.no_enable_progress_bar", "--checkpoint.enable",
        "--checkpoint.interval", str(STEPS),
    )
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 1.5, f"loss fell only from {first:.3f} to {last:.3f}"

    weights = load_dcp_model(str(tmp_path / "checkpoint"))
    biases = [v for k, v in weights.items() if k.endswith("feed_forward.expert_bias")]
    assert len(biases) == 4  # every debugmodel layer routes
    # Sign updates of 1e-3 after each of the 30 steps: the biases moved (an expert's may be
    # back at 0 after as many ups as downs), by at most 30 steps' worth.
    assert all(bias.shape == (8,) and bias.abs().max() <= STEPS * 1e-3 + 1e-6 for bias in biases)
    assert sum(int((bias != 0).sum()) for bias in biases) >= 16
    assert weights["layers.1.feed_forward.experts.w1"].shape == (8, 128, 256)


TINY_MOE = ["--config", "qwen3_moe_debug", "--model.flavor", "debugmodel_tiny", "--training.steps", "3",
            "--training.seq_len", "32", "--training.global_batch_size", "4", "--metrics.log_freq", "1",
            "--metrics.no_enable_progress_bar", "--optimizer.eps", "1e-5", "--debug.deterministic"]
# DeepSeek-V3's tiny flavor: MLA with low-rank queries, YaRN, sigmoid routing over 2 groups,
# a shared expert, the balancing bias moving after every step; 5 steps.
TINY_DSV3 = ["--config", "deepseek_v3_debug", "--model.flavor", "debugmodel_tiny", "--training.steps", "5",
             "--training.seq_len", "32", "--training.global_batch_size", "4", "--metrics.log_freq", "1",
             "--metrics.no_enable_progress_bar", "--optimizer.eps", "1e-5", "--debug.deterministic"]
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
       "--training.local_batch_size", "2"]
EP2_TP2_SP = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
              "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]
TP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
       "--training.local_batch_size", "4"]
PP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
       "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "4"]
EP2_FSDP2 = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2",
             "--training.local_batch_size", "1"]


# The last step's weights: float32 DCP (the one-process reference), or a Hugging Face folder
# (the sharded runs' export, gathered from their stages and expert shards).
SAVE_LAST_DCP = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.export_dtype", "float32"]
SAVE_LAST_HF = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_in_hf"]


def moe_runs(dsv3_seed: Path) -> dict[int, tuple[str, dict[str, list[str]]]]:
    """One launch per world size, shared by every test below (the same dicts for every
    caller): Qwen3-MoE from seeded init, DeepSeek-V3 from one seed checkpoint."""
    seed = ["--checkpoint.initial_load_path", str(dsv3_seed)]
    return {
        1: ("moe_one_process", {"qwen3_moe": [*TINY_MOE, "--training.local_batch_size", "4"],
                                "deepseek_v3": [*TINY_DSV3, *seed, "--training.local_batch_size", "4",
                                                *SAVE_LAST_DCP]}),
        2: ("moe_two_ranks", {"qwen3_moe_ep2": [*TINY_MOE, *EP2], "qwen3_moe_tp2": [*TINY_MOE, *TP2],
                              "deepseek_v3_ep2": [*TINY_DSV3, *seed, *EP2],
                              "deepseek_v3_pp2": [*TINY_DSV3, *seed, *PP2, *SAVE_LAST_HF]}),
        4: ("moe_four_ranks", {"qwen3_moe_ep2_tp2_sp": [*TINY_MOE, *EP2_TP2_SP],
                               "deepseek_v3_ep2_fsdp2": [*TINY_DSV3, *seed, *EP2_FSDP2, *SAVE_LAST_HF],
                               "deepseek_v3_ep2_tp2_sp": [*TINY_DSV3, *seed, *EP2_TP2_SP]}),
    }


@pytest.fixture(scope="module")
def dsv3_seed(build_once) -> Path:
    """DeepSeek-V3's seed checkpoint (step 0 of `debugmodel_tiny`), written once per session."""
    def build(folder: Path) -> None:
        flags = [*TINY_DSV3, "--training.local_batch_size", "4", "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(folder / "seed")]
        launch_train_runs(1, [("seed", flags)], folder / "launch.log")

    return build_once("deepseek_v3_seed", build) / "seed" / "checkpoint"


def moe_run(train_group, dsv3_seed: Path, ranks: int, name: str) -> list[dict]:
    """The metrics.jsonl rows of run `name` of the shared `ranks`-process MoE launch."""
    group, runs = moe_runs(dsv3_seed)[ranks]
    dump = train_group(group, ranks, runs) / name
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.xdist_group("moe_one_process")  # the shared reference on one worker (tests/conftest.py)
@pytest.mark.parametrize("family, ranks, run", [
    ("qwen3_moe", 2, "qwen3_moe_ep2"),
    ("qwen3_moe", 4, "qwen3_moe_ep2_tp2_sp"),
    ("qwen3_moe", 2, "qwen3_moe_tp2"),
    ("deepseek_v3", 2, "deepseek_v3_ep2"),
    ("deepseek_v3", 4, "deepseek_v3_ep2_fsdp2"),
    ("deepseek_v3", 4, "deepseek_v3_ep2_tp2_sp"),
    ("deepseek_v3", 2, "deepseek_v3_pp2"),
], ids=["qwen3_moe-ep2", "qwen3_moe-ep2_tp2_sp", "qwen3_moe-tp2", "deepseek_v3-ep2", "deepseek_v3-ep2_fsdp2",
        "deepseek_v3-ep2_tp2_sp", "deepseek_v3-pp2"])
def test_expert_parallel_equals_one_process(family, ranks, run, train_group, dsv3_seed):
    """`NGPU=N ./tools/run_train.sh --config <family>_debug --parallelism.expert_parallel_degree 2`
    at test size: losses, grad norms and expert loads equal one process (experts split over
    ranks, tokens exchanged both ways; with expert FSDP 2, or with TP 2 and SP on the
    attention). Qwen3-MoE's layouts start from scratch (titan's init depends only on the seed
    and each parameter's name, not on the layout); DeepSeek-V3's load one seed checkpoint.
    TP 2 alone leaves the routed experts plain tensors beside DTensors (the fused AdamW step
    refused the mix). Under PP 2 the expert bias must move by the schedule's microbatches only: torch's extra
    first-step forward (its shape inference) was counted, and the loss drifted from step 3; and
    every layer's load is logged, not only those of rank 0's stage."""
    one = moe_run(train_group, dsv3_seed, 1, family)
    many = moe_run(train_group, dsv3_seed, ranks, run)
    assert len(one) == len(many) >= 3
    # Every MoE layer's load, also under PP (each pipeline rank holds only its stages' layers;
    # rank 0 logged its own until the loads were gathered over the pipeline ranks).
    loads = sorted(k for k in one[0] if k.startswith("moe/"))
    assert "moe/imbalance_max" in loads and len(loads) >= 3, loads
    assert sorted(k for k in many[0] if k.startswith("moe/")) == loads
    for key in ("loss", "grad_norm", *loads):
        got, want = [r[key] for r in many], [r[key] for r in one]
        assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want, strict=True)), (key, got, want)


@pytest.mark.slow
@pytest.mark.xdist_group("moe_one_process")
@pytest.mark.parametrize("ranks, run", [(2, "deepseek_v3_pp2"), (4, "deepseek_v3_ep2_fsdp2")],
                         ids=["pp2", "ep2_fsdp2"])
def test_hf_export_of_a_sharded_moe_run_loads_in_transformers(train_group, dsv3_seed, ranks, run):
    """`--checkpoint.last_save_in_hf` from a pipeline-parallel run (each rank holds its stages'
    layers) and from an expert-parallel one (each rank 2 of the 4 experts, FSDP-sharded):
    the folder loads in `DeepseekV3ForCausalLM` whole, and its logits equal titan's model
    holding the one-process run's final weights (the layouts train alike: the test above)."""
    transformers = pytest.importorskip("transformers")
    import torch
    from titan.models.deepseek_v3 import build_deepseek_v3

    group, runs = moe_runs(dsv3_seed)[1]
    weights = load_dcp_model(str(train_group(group, 1, runs) / "deepseek_v3" / "checkpoint"))
    group, runs = moe_runs(dsv3_seed)[ranks]
    export = train_group(group, ranks, runs) / run / "checkpoint" / "step-5"
    assert (export / "config.json").exists(), sorted(p.name for p in export.parent.iterdir())
    vocab = weights["tok_embeddings.weight"].shape[0]
    model = build_deepseek_v3("debugmodel_tiny", vocab_size=vocab, max_seq_len=32)
    model.load_state_dict(weights, strict=True)
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), loaded(tokens).logits
    # Measured 1.8e-7 (the runs' weights differ by summation order only); a missing or
    # misplaced expert or stage moves the logits by orders of magnitude more.
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5


@pytest.mark.slow
def test_deepseek_v3_debug_trains_with_falling_loss_and_exports_to_transformers(tmp_path):
    """`titan train --config deepseek_v3_debug` learns; its checkpoint carries the moved
    selection bias, and the Hugging Face export of it loads in `DeepseekV3ForCausalLM` with the
    same logits as titan's model from the same checkpoint."""
    transformers = pytest.importorskip("transformers")
    import torch
    from titan.ckpt import hf
    from titan.models.deepseek_v3 import DeepseekV3StateDictAdapter, build_deepseek_v3

    rows = titan_train(
        tmp_path, "--config", "deepseek_v3_debug", "--training.steps", str(DSV3_STEPS),
        "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "5",
        "--metrics.no_enable_progress_bar", "--checkpoint.enable",
        "--checkpoint.interval", str(DSV3_STEPS),
    )
    assert [r["step"] for r in rows] == [1, 5, 10, 15]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 1.5, f"loss fell only from {first:.3f} to {last:.3f}"

    weights = load_dcp_model(str(tmp_path / "checkpoint"))
    biases = [v for k, v in weights.items() if k.endswith("feed_forward.expert_bias")]
    assert len(biases) == 3  # blocks 1-3 route; block 0 is dense
    assert sum(int((bias != 0).sum()) for bias in biases) >= 12
    vocab = weights["tok_embeddings.weight"].shape[0]
    model = build_deepseek_v3("debugmodel", vocab_size=vocab, max_seq_len=64)
    model.load_state_dict(weights, strict=True)
    adapter = DeepseekV3StateDictAdapter(model.args)
    hf.save_hf(weights, str(tmp_path / "hf"), adapter, dtype=torch.float32)
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), loaded(tokens).logits
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5
