"""How the end-to-end tests start processes: one interpreter for one rank, torchrun for
several, each rank on one thread; and several `titan train` runs in one launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUNS_WORKER = Path(__file__).with_name("train_runs_worker.py")


def launcher(ranks: int) -> list[str]:
    """The command prefix that starts a Python script on ``ranks`` processes: this interpreter
    for one, torchrun (c10d rendezvous on a port the OS picks) for several."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]


def launch(ranks: int, args: list[str], log: Path, *, timeout: float = 600) -> None:
    """Run ``args`` (a script and its arguments) on ``ranks`` processes with one thread each;
    the command and the ends of its output go to ``log``; fail with them unless it succeeded."""
    cmd = [*launcher(ranks), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    log.write_text(f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}")
    assert result.returncode == 0, log.read_text()


def launch_train_runs(ranks: int, runs: list[tuple[str, list[str]]], log: Path) -> None:
    """Every `titan train` run of ``runs`` ((name, flags); each names its own
    ``--job.dump_folder``) in one launch of ``ranks`` processes, one run after another."""
    runs_file = log.with_suffix(".json")
    runs_file.write_text(json.dumps([[name, flags] for name, flags in runs]))
    launch(ranks, [str(RUNS_WORKER), str(runs_file)], log)
