"""Faults survived or reported for real (issue 23): a rank that withholds a collective."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from forked_cli import run_command  # torchrun's agent forked, its ranks fresh
from titan.ckpt import load_dcp_model

# `titan train` whose rank 1 stops taking part at its third step (it sleeps instead of
# joining the step's collectives), as a hung or deadlocked rank does.
WITHHOLDING_ENTRY = """
import os, sys, time
from titan.recipes.cli import main
from titan.train.loop import TrainingLoop

real_step = TrainingLoop._train_step

def withheld_step(self, microbatches, *, sync):
    if os.environ.get("RANK") == "1" and self.step == 2:
        # Withhold until rank 0 has reported its timeout (its trace is written), then join
        # the collective it left and fail too, instead of holding until the launcher's kill.
        trace = os.path.join(os.environ["TITAN_TEST_DUMP"], "comm_traces", "rank_0.json")
        while not os.path.exists(trace):
            time.sleep(0.05)
    return real_step(self, microbatches, sync=sync)

TrainingLoop._train_step = withheld_step
sys.exit(main())
"""


def _two_rank_train(tmp_path: Path, name: str, entry: str, *flags: str, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    """`titan train` of the tiny synthetic-data model (10 steps) on 2 ranks under torchrun,
    started through ``entry`` (a script written to ``tmp_path/name`` that patches titan, then
    runs its CLI) with ``flags`` added; 240 s at most (what a hang would hit)."""
    script = tmp_path / name
    script.write_text(entry)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(script), "train", "--config", "llama3_debug_synthetic",
           "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--training.steps", "10", "--metrics.no_enable_progress_bar", *flags]
    return run_command(cmd, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_a_rank_that_withholds_a_collective_fails_the_run_within_the_timeout(tmp_path):
    """gloo's default is 30 minutes; with --comm.train_timeout_seconds 5 the run stops with the
    collective named (flight recorder), its trace written, and the hung rank's stack printed
    (the watchdog fires at 90% of the timeout, while every rank is alive). The subprocess
    limit is what a hang would hit."""
    dump = tmp_path / "run"
    done = _two_rank_train(tmp_path, "withholding.py", WITHHOLDING_ENTRY, "--comm.train_timeout_seconds", "5",
                           "--job.dump_folder", str(dump), env={"TITAN_TEST_DUMP": str(dump)})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    line = next((line for line in output.splitlines() if "rank 0 timed out waiting on" in line), None)
    assert line is not None, output[-6000:]
    # e.g. "rank 0 timed out waiting on allreduce #9 of process group ... over ranks [0, 1]
    # (--comm.train_timeout_seconds 5; ...Timed out waiting 5000ms...); its last 9 collectives are in ..."
    assert "--comm.train_timeout_seconds 5" in line and "of process group" in line, line
    assert (dump / "comm_traces" / "rank_0.json").is_file()
    assert "in withheld_step" in output, output[-6000:]  # rank 1's stack, where it hangs


# `titan train` whose rank 1 fails on its own at its fourth step (a data source that breaks on
# one host), while rank 0 goes on into the step's collectives.
RAISING_ENTRY = """
import os, sys
from titan.recipes.cli import main
from titan.train.trainer import Trainer

real_next = Trainer.next_microbatches

def failing_next(self, data_iter):
    if os.environ.get("RANK") == "1" and self.step == 3:
        raise RuntimeError("rank 1's data source failed at step 4")
    return real_next(self, data_iter)

Trainer.next_microbatches = failing_next
sys.exit(main())
"""


@pytest.mark.slow
def test_a_rank_s_own_error_ends_the_run_without_waiting_for_a_timeout(tmp_path):
    """The failing rank leaves without its teardown's barrier, which rank 0, waiting in the
    step's all-reduce, would never join: the run ends with rank 1's error and rank 0 losing
    its peer, not after the 30-minute collective timeout given here (until 2026-12-07 the run
    waited --comm.train_timeout_seconds, then reported rank 0's timeout as its failure). The
    subprocess limit, far below that timeout, is what a hang would hit."""
    done = _two_rank_train(tmp_path, "raising.py", RAISING_ENTRY, "--comm.train_timeout_seconds", "1800",
                           "--job.dump_folder", str(tmp_path / "run"))
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "RuntimeError: rank 1's data source failed at step 4" in output, output[-6000:]
    assert "timed out" not in output, output[-6000:]


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
    done = _two_rank_train(tmp_path, "slow_loader.py", SLOW_LOADER_ENTRY, "--metrics.log_freq", "1",
                           "--job.dump_folder", str(tmp_path / "run"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    warnings = [line for line in output.splitlines() if "straggler: step 8 took" in line]
    assert len(warnings) == 1, output[-4000:]
    assert "rank 1 spent 2." in warnings[0] and "loading its batch alone" in warnings[0], warnings[0]


# ---------------------------------------------------------------------------- torchft replicas

# `titan train` as one replica group, with two test hooks read from the environment:
# TITAN_TEST_DIE_AT: SIGKILL this process at the start of that step (a crashed host);
# TITAN_TEST_HOLDS ("step=file,..."): wait at the start of each such step until its file exists.
REPLICA_ENTRY = """
import os, signal, sys, time
from pathlib import Path
from titan.recipes.cli import main
from titan.train.engine import TrainingEngine

real_start = TrainingEngine.start_step
holds = dict(item.split("=", 1) for item in os.environ.get("TITAN_TEST_HOLDS", "").split(",") if item)

def start_step(self):
    step = self.step + 1
    if step == int(os.environ.get("TITAN_TEST_DIE_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    if str(step) in holds:
        while not Path(holds[str(step)]).exists():
            time.sleep(0.02)
    real_start(self)

TrainingEngine.start_step = start_step
sys.exit(main())
"""
FT_STEPS, DIE_AT, HOLD_AT = 24, 6, 14


def _start_lighthouse(folder):
    """torchft's lighthouse on a free port; returns (process, its http address)."""
    log = folder / "lighthouse.log"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
                             "--join_timeout_ms", "3000", "--heartbeat_timeout_ms", "1000", "--bind", "[::]:0"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    address = _wait_for(lambda: re.search(r"listening on: http://[^:]+:(\d+)", log.read_text()), proc, 60)
    return proc, f"http://localhost:{address.group(1)}"


def _wait_for(found, proc, seconds):
    """Poll ``found()`` until it is truthy; a guard against a hang, not part of a verdict."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"not seen within {seconds} s")


def _logged(dump):
    path = dump / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft: pip install 'titan-train[ft]'")
def test_torchft_replicas_survive_a_dead_group_and_rejoin_with_equal_weights(tmp_path):
    """Lighthouse + two replica groups of one rank each. Group 1 is SIGKILLed at step 6; group 0
    keeps stepping alone (its loss keeps falling) and waits at step 14 until group 1, restarted
    from nothing, is up; group 1 then rejoins by fetching group 0's live state, and after the
    last step both groups' weights are equal."""
    script = tmp_path / "replica.py"
    script.write_text(REPLICA_ENTRY)
    lighthouse, address = _start_lighthouse(tmp_path)
    go = tmp_path / "go"
    procs = []
    try:
        def replica(i, **env):
            dump = tmp_path / f"replica{i}"
            log = (tmp_path / f"replica{i}.{len(procs)}.log").open("w")
            cmd = [sys.executable, str(script), "train", "--config", "llama3_debug_synthetic", "--model.flavor",
                   "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
                   "--training.steps", str(FT_STEPS), "--optimizer.lr", "1e-2", "--metrics.log_freq", "1",
                   "--metrics.no_enable_progress_bar", "--checkpoint.enable", "--checkpoint.interval", "1000",
                   "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                   "--fault_tolerance.replica_id", str(i), "--job.dump_folder", str(dump)]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": address, **env})
            procs.append(proc)
            return proc, dump, Path(log.name)

        # Both groups start their first step together (one quorum of two).
        start = tmp_path / "start"
        first, dump0, log0 = replica(0, TITAN_TEST_HOLDS=f"1={start},{HOLD_AT}={go}")
        doomed, dump1, doomed_log = replica(1, TITAN_TEST_HOLDS=f"1={start}", TITAN_TEST_DIE_AT=str(DIE_AT))
        for proc, log in ((first, log0), (doomed, doomed_log)):
            _wait_for(lambda log=log: "debugmodel_tiny:" in log.read_text(), proc, 240)
        start.touch()
        assert doomed.wait(timeout=240) == -signal.SIGKILL
        _wait_for(lambda: HOLD_AT - 1 in _logged(dump0), first, 240)  # group 0 stepped on alone
        alone = _logged(dump0)
        assert alone[HOLD_AT - 1] < alone[DIE_AT - 1], alone  # and kept learning

        restarted, _, log1 = replica(1)
        # Its engine (and torchft participant) is built once the run's summary line is out.
        _wait_for(lambda: "debugmodel_tiny:" in log1.read_text(), restarted, 240)
        go.touch()
        assert first.wait(timeout=240) == 0, log0.read_text()[-4000:]
        assert restarted.wait(timeout=240) == 0, log1.read_text()[-4000:]
    finally:
        for proc in [*procs, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "replica groups live: 1 of 2" in log0.read_text()
    assert "replica group 1 rejoined" in log1.read_text(), log1.read_text()[-4000:]
    final0 = load_dcp_model(str(dump0 / "checkpoint"))
    final1 = load_dcp_model(str(dump1 / "checkpoint"))
    assert final0.keys() == final1.keys()
    assert all(torch.equal(final0[k], final1[k]) for k in final0)
