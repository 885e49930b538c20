"""The launch helper the end-to-end tests share: a launch past its limit fails with its output
and leaves no rank behind (so a hung collective costs one launch's limit, not the suite's)."""

import json
import os
import subprocess

import pytest
from launching import launch

# Each rank leaves its pid beside the script (a one-process launch is forked, so its command
# line does not name the script), says it started, and sleeps past any limit.
SLEEPER = ("import os, time\nrank = os.environ.get('RANK', '0')\n"
           "open(f'{__file__}.{rank}.pid', 'w').write(str(os.getpid()))\n"
           "print('rank', rank, 'started', flush=True)\ntime.sleep(120)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_running(script: str) -> list[str]:
    lines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line for line in lines if script in line]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_launch_past_its_limit_fails_with_its_output_and_stops_every_rank(tmp_path, ranks):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    # Whether the ranks got to print before the limit depends on the machine's load; what is
    # checked does not: the failure names the limit, the log is written, and no rank survives.
    with pytest.raises(AssertionError, match=r"stopped after its limit of 3 s"):
        launch(ranks, [str(script)], tmp_path / "launch.log", timeout=3)
    assert "stopped after its limit" in (tmp_path / "launch.log").read_text()
    assert not _processes_running(str(script))
    assert not [pid for pid in (int(p.read_text()) for p in tmp_path.glob("sleeper.py.*.pid")) if _alive(pid)]


def test_a_launch_that_succeeds_logs_its_command_and_output(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello from', __import__('os').environ['OMP_NUM_THREADS'], 'thread')\n")
    launch(1, [str(script)], tmp_path / "launch.log")
    log = (tmp_path / "launch.log").read_text()
    assert str(script) in log.splitlines()[0] and "hello from 1 thread" in log


def test_a_forked_titan_run_behaves_like_a_fresh_process(tmp_path):
    """`forked_cli.run_titan` (one-process runs without the start-up imports): the folder, the
    environment and the exit status are the run's own, and its output is captured."""
    from forked_cli import CLI, run_command, run_titan

    flags = ["train", "--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--training.steps",
             "2", "--training.seq_len", "16", "--training.local_batch_size", "2", "--metrics.no_enable_progress_bar"]
    env = {**os.environ, "TITAN_CPU_PEAK_FLOPS": "1e15"}  # the suite's is 1e13 (conftest.py)
    done = run_titan([*flags, "--job.dump_folder", "relative", "--metrics.log_freq", "1"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads((tmp_path / "relative" / "metrics.jsonl").read_text().splitlines()[0])  # relative to cwd
    assert first["mfu"] == pytest.approx(100 * first["tflops"] * 1e12 / 1e15, rel=1e-6)  # the run's environment
    assert "training done" in done.stderr
    refused = run_command([*CLI, "train", "--config", "no_such_recipe"], env=env)
    assert refused.returncode != 0 and "no_such_recipe" in refused.stdout + refused.stderr


def test_a_forked_titan_run_past_its_limit_is_stopped(tmp_path):
    from forked_cli import run_titan

    with pytest.raises(subprocess.TimeoutExpired):
        run_titan(["train", "--config", "llama3_debug_synthetic", "--training.steps", "1000000",
                   "--job.dump_folder", str(tmp_path)], timeout=2)
