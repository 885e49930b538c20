"""End to end: `titan train` on the synthetic corpus learns, and logs every metric."""

import json
import math
import subprocess
import sys

import pytest
from titan.train.data import ByteTokenizer, DatasetConfig, synthetic_corpus
from titan.train.metrics import METRIC_KEYS

TINY = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "5",
    "--metrics.log_freq", "5",
]


def run_titan(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan.recipes.cli", "train", *args],
        capture_output=True, text=True, cwd=cwd, timeout=600,
    )


def read_metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_synthetic_run_learns_and_logs_every_key(tmp_path):
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.steps", "80", "--job.dump_folder", str(tmp_path), *TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] + list(range(5, 81, 5))
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert row["tokens_per_second"] > 0 and row["memory_peak_gib"] > 0
        assert row["mfu"] is None or 0 < row["mfu"] < 100
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > math.log(256) - 0.5  # starts near uniform over the byte vocabulary
    assert last < first - 2.0, f"loss fell only from {first:.3f} to {last:.3f}"
    # The corpus's entropy floor is the best any model can do: the loss heads for it and,
    # up to batch noise, never beats it.
    floor = synthetic_corpus(DatasetConfig(), ByteTokenizer()).entropy_floor_nats()
    tail = [r["loss"] for r in rows[-4:]]
    assert all(floor - 0.15 < loss < floor + 0.6 for loss in tail), (floor, tail)
    assert "loss" in result.stderr + result.stdout


def test_bad_batch_geometry_fails_before_training(tmp_path):
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.global_batch_size", "12",
        "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path),
    )
    assert result.returncode != 0
    assert "--training.global_batch_size 12" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
