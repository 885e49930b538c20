"""Qwen3-MoE through the whole stack: `titan train` of `qwen3_moe_debug` learns, and the
engine's after-step hook moves the load-balancing bias, which the checkpoint carries."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from forked_cli import run_command
from titan.ckpt import load_dcp_model

STEPS = 30


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


def titan_train_ranks(dump: Path, ranks: int, *flags: str) -> list[dict]:
    """`titan train` under torchrun with `ranks` processes; the metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli", "train", "--job.dump_folder", str(dump), *flags]
    result = run_command(cmd, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


TINY_MOE = ["--config", "qwen3_moe_debug", "--model.flavor", "debugmodel_tiny", "--training.steps", "3",
            "--training.seq_len", "32", "--training.global_batch_size", "4", "--metrics.log_freq", "1",
            "--metrics.no_enable_progress_bar", "--optimizer.eps", "1e-5", "--debug.deterministic"]


@pytest.mark.slow
@pytest.mark.xdist_group("moe_one_process")  # the shared reference on one worker (tests/conftest.py)
@pytest.mark.parametrize("ranks, layout", [
    (2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
         "--training.local_batch_size", "2"]),
    (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]),
], ids=["ep2", "ep2_tp2_sp"])
def test_expert_parallel_from_scratch_equals_one_process(ranks, layout, tmp_path, train_group):
    """`NGPU=N ./tools/run_train.sh --config qwen3_moe_debug --parallelism.expert_parallel_degree 2`
    at test size: losses, grad norms and expert loads equal one process (experts split over
    ranks, tokens exchanged both ways; with TP 2 and SP on the dense part)."""
    # The one-process reference of both layouts, run once per session.
    one_dump = train_group("moe_one_process", 1, {"one": [*TINY_MOE, "--training.local_batch_size", "4"]}) / "one"
    one = [json.loads(line) for line in (one_dump / "metrics.jsonl").read_text().splitlines()]
    many = titan_train_ranks(tmp_path / "many", ranks, *TINY_MOE, *layout)
    for key in ("loss", "grad_norm", "moe/imbalance_max"):
        got, want = [r[key] for r in many], [r[key] for r in one]
        assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want, strict=True)), (key, got, want)
