"""tools/run_train.sh and tools/slurm/titan.sbatch: the flags torchrun gets, and a real 2-rank run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_TRAIN = ROOT / "tools" / "run_train.sh"
SBATCH = ROOT / "tools" / "slurm" / "titan.sbatch"
LAUNCH_VARS = ("NGPU", "NPROC", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "LOG_RANK",
               "COMM_MODE", "WORLD_SIZE", "PYTHON", "CONFIG_FILE")


def _fake_bin(tmp_path: Path) -> Path:
    """A bin folder whose `python` prints its arguments one per line instead of running them,
    plus Slurm's `srun` (runs its command) and `scontrol` (two node names)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "python": 'printf "%s\\n" "$@"\n',
        "srun": 'while [[ "$1" == -* ]]; do shift; done\nexec "$@"\n',
        "scontrol": 'printf "node-a\\nnode-b\\n"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _env(bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    if bin_dir is not None:
        env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "python"))
    env.update(extra)
    return env


def _launch_args(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> list[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_scripts_parse():
    for script in (RUN_TRAIN, SBATCH):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_single_node_defaults(tmp_path):
    args = _launch_args([str(RUN_TRAIN), "--config", "llama3_debug"], _env(_fake_bin(tmp_path)))
    assert args[:2] == ["-m", "torch.distributed.run"]
    for flag in ("--nproc_per_node=1", "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"):
        assert flag in args
    assert args[-5:] == ["-m", "titan.recipes.cli", "train", "--config", "llama3_debug"]


def test_multi_node_flags(tmp_path):
    env = _env(_fake_bin(tmp_path), NNODES="4", NGPU="8", RDZV_ENDPOINT="node-a:29500", RDZV_ID="job7",
               NODE_RANK="2")
    args = _launch_args([str(RUN_TRAIN), "--training.steps", "5"], env)
    for flag in ("--nproc_per_node=8", "--nnodes=4", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29500",
                 "--rdzv_id=job7"):
        assert flag in args
    # c10d assigns node ranks; torchrun ignores --node_rank outside static rendezvous.
    assert not any(a.startswith("--node_rank") for a in args)
    assert args[-2:] == ["--training.steps", "5"]


def test_config_file_passes_a_torchtitan_job_file_before_the_flags(tmp_path):
    """CONFIG_FILE=... ./run_train.sh, as torchtitan users launch: the file first, so the
    command line's flags override it."""
    env = _env(_fake_bin(tmp_path), CONFIG_FILE="train_configs/llama3_8b.toml")
    args = _launch_args([str(RUN_TRAIN), "--training.steps", "5"], env)
    assert args[-7:] == ["-m", "titan.recipes.cli", "train", "--job.config_file", "train_configs/llama3_8b.toml",
                         "--training.steps", "5"]


def test_multi_node_without_endpoint_is_refused(tmp_path):
    proc = subprocess.run([str(RUN_TRAIN)], env=_env(_fake_bin(tmp_path), NNODES="2"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "RDZV_ENDPOINT" in proc.stderr


def test_fake_backend_skips_torchrun(tmp_path):
    env = _env(_fake_bin(tmp_path), COMM_MODE="fake_backend", NGPU="64", NNODES="2")
    args = _launch_args([str(RUN_TRAIN), "--config", "llama3_405b"], env)
    assert "torch.distributed.run" not in args
    assert args == ["-m", "titan.recipes.cli", "train", "--config", "llama3_405b"]


def test_sbatch_launches_run_train_with_the_rendezvous_on_the_first_node(tmp_path):
    text = SBATCH.read_text()
    assert "srun" in text and "./tools/run_train.sh" in text and "RDZV_ENDPOINT" in text
    env = _env(_fake_bin(tmp_path), SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES="2",
               SLURM_GPUS_ON_NODE="4", SLURM_JOB_ID="99", SLURM_SUBMIT_DIR=str(ROOT))
    args = _launch_args(["bash", str(SBATCH), "--config", "llama3_8b", "--training.steps", "3"], env,
                        cwd=tmp_path)
    for flag in ("--nproc_per_node=4", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29500",
                 "--rdzv_id=titan-99"):
        assert flag in args, args
    assert args[-4:] == ["--config", "llama3_8b", "--training.steps", "3"]


@pytest.mark.slow
def test_two_process_run_through_the_script(tmp_path):
    env = _env(NGPU="2", PYTHON=sys.executable, LOG_RANK="0")
    proc = subprocess.run(
        [str(RUN_TRAIN), "--config", "llama3_debug_synthetic", "--training.steps", "2",
         "--training.seq_len", "32", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
