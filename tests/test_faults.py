"""Faults survived or reported for real (issue 23): a rank that withholds a collective."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# `titan train` whose rank 1 stops taking part at its third step (it sleeps instead of
# joining the step's collectives), as a hung or deadlocked rank does.
WITHHOLDING_ENTRY = """
import os, sys, time
from titan.recipes.cli import main
from titan.train.loop import TrainingLoop

real_step = TrainingLoop._train_step

def withheld_step(self, microbatches, *, sync):
    if os.environ.get("RANK") == "1" and self.step == 2:
        time.sleep(600)
    return real_step(self, microbatches, sync=sync)

TrainingLoop._train_step = withheld_step
sys.exit(main())
"""


@pytest.mark.slow
def test_a_rank_that_withholds_a_collective_fails_the_run_within_the_timeout(tmp_path):
    """gloo's default is 30 minutes; with --comm.train_timeout_seconds 5 the run stops with the
    collective named (flight recorder), its trace written, and the hung rank's stack printed
    (the watchdog fires at 90% of the timeout, while every rank is alive). The subprocess
    limit is what a hang would hit."""
    script = tmp_path / "withholding.py"
    script.write_text(WITHHOLDING_ENTRY)
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(script), "train", "--config", "llama3_debug_synthetic",
           "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--training.steps", "10", "--metrics.no_enable_progress_bar", "--comm.train_timeout_seconds", "5",
           "--job.dump_folder", str(dump)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    line = next((line for line in output.splitlines() if "rank 0 timed out waiting on" in line), None)
    assert line is not None, output[-6000:]
    # e.g. "rank 0 timed out waiting on allreduce #9 of process group ... over ranks [0, 1]
    # (--comm.train_timeout_seconds 5; ...Timed out waiting 5000ms...); its last 9 collectives are in ..."
    assert "--comm.train_timeout_seconds 5" in line and "of process group" in line, line
    assert (dump / "comm_traces" / "rank_0.json").is_file()
    assert "in withheld_step" in output, output[-6000:]  # rank 1's stack, where it hangs


def test_comm_flags_are_checked():
    from titan.dist import CommConfig

    with pytest.raises(ValueError, match="--comm.train_timeout_seconds must be > 0"):
        CommConfig(train_timeout_seconds=0)
    with pytest.raises(ValueError, match="--comm.trace_buf_size must be >= 0"):
        CommConfig(trace_buf_size=-1)


# `titan train` whose rank 1 takes 2 s to load the batch of its step 8 (a slow disk or data
# worker on one host).
SLOW_LOADER_ENTRY = """
import os, sys, time
from titan.recipes.cli import main
from titan.train.trainer import Trainer

real_next = Trainer.next_microbatches

def slow_next(self, data_iter):
    if os.environ.get("RANK") == "1" and self.step == 7:
        time.sleep(2.0)
    return real_next(self, data_iter)

Trainer.next_microbatches = slow_next
sys.exit(main())
"""


@pytest.mark.slow
def test_a_straggling_rank_is_named(tmp_path):
    """Both ranks' step 8 takes 2 s more than the others (rank 0 waits for rank 1 in the
    step's collectives); the warning on rank 0 names rank 1, whose own data loading explains
    it. A 2 s sleep against steps of milliseconds is far beyond the factor 5 on a loaded machine."""
    script = tmp_path / "slow_loader.py"
    script.write_text(SLOW_LOADER_ENTRY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(script), "train", "--config", "llama3_debug_synthetic",
           "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--training.steps", "10", "--metrics.log_freq", "1", "--metrics.no_enable_progress_bar",
           "--job.dump_folder", str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    warnings = [line for line in output.splitlines() if "straggler: step 8 took" in line]
    assert len(warnings) == 1, output[-4000:]
    assert "rank 1 spent 2." in warnings[0] and "loading its batch alone" in warnings[0], warnings[0]
