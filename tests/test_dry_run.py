"""The fake-backend dry run from the command line: a 512-rank Llama 3 405B layout on one CPU."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan.recipes.cli import main, parse_train_args
from titan.recipes.dry_run import run_dry_run, split_world_size_flag, world_size_from_env

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"ranks\s+\d+-\d+ \(pp (\d+)\): ([\d,]+) params \| params .* total ([\d.]+) (GiB|MiB|KiB)")


def _script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "NNODES", "NPROC")}
    env.update(PYTHON=sys.executable, **extra)
    return env


@pytest.mark.slow
def test_405b_on_512_ranks_through_run_train_sh():
    start = time.perf_counter()
    proc = subprocess.run(
        ["./tools/run_train.sh", "--config", "llama3_405b", "--parallelism.data_parallel_shard_degree", "8"],
        cwd=ROOT, env=_script_env(NGPU="512", COMM_MODE="fake_backend"),
        capture_output=True, text=True, timeout=180,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.distributed.run" not in proc.stderr  # no torchrun in this mode
    rows = [LINE.search(line) for line in proc.stdout.splitlines()]
    rows = [r for r in rows if r]
    assert [int(r.group(1)) for r in rows] == list(range(8)), proc.stdout
    params = [int(r.group(2).replace(",", "")) for r in rows]
    # 405B / (tp 8 x pp 8) / FSDP 8 ~ 0.79B per rank; the ends also hold embedding / output.
    for p in params:
        assert 0.7e9 < p < 0.9e9, params
    # Every rank of a pp rank holds the same shard size: the sum over ranks is the model.
    assert 400e9 < sum(params) * 64 < 410e9
    assert all(r.group(4) == "GiB" and 10 < float(r.group(3)) < 40 for r in rows), proc.stdout
    assert elapsed < 60, f"dry run took {elapsed:.0f} s"


def test_dry_run_resolves_flags_like_titan_train(capsys):
    # The debug model, 8 ranks: dp_shard 2 x tp 2 x pp 2; same tyro parsing as `titan train`.
    rc = main(["dry-run", "--world_size", "8", "--config", "llama3_debug", "--training.seq_len", "32",
               "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "on 8 ranks: pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in out
    assert len(LINE.findall(out)) == 2


def test_fake_backend_env_turns_train_into_a_dry_run(monkeypatch, capsys):
    monkeypatch.setenv("COMM_MODE", "fake_backend")
    monkeypatch.setenv("NGPU", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    assert main(["train", "--config", "llama3_debug", "--training.seq_len", "32"]) == 0
    assert "on 4 ranks" in capsys.readouterr().out


def test_bad_tp_names_the_kv_heads_and_the_fix():
    cfg = parse_train_args(["--config", "llama3_405b", "--parallelism.tensor_parallel_degree", "16"])
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=16 must divide the model's n_kv_heads=8"):
        run_dry_run(cfg, world_size=512, print_fn=lambda s: None)


def test_degrees_not_multiplying_to_the_world_size_fail_with_the_fix(capsys):
    rc = main(["dry-run", "--world_size", "512", "--config", "llama3_405b",
               "--parallelism.data_parallel_shard_degree", "4"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "= 256, but the world size is 512" in err
    assert "data_parallel_shard_degree -1" in err


def test_world_size_sources():
    assert world_size_from_env({"WORLD_SIZE": "16", "NGPU": "8"}) == 16
    assert world_size_from_env({"NGPU": "8", "NNODES": "4"}) == 32
    assert world_size_from_env({}) == 1
    assert split_world_size_flag(["--world_size=64", "--x", "1"]) == (64, ["--x", "1"])
    with pytest.raises(SystemExit, match="positive integer"):
        split_world_size_flag(["--world_size", "zero"])
