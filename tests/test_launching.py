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


@pytest.mark.parametrize(("ranks", "torchrun"), [(1, True), (2, True), (2, False)],
                         ids=["one_rank", "torchrun", "forked_ranks"])
def test_a_launch_past_its_limit_fails_with_its_output_and_stops_every_rank(tmp_path, ranks, torchrun):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    # Whether the ranks got to print before the limit depends on the machine's load; what is
    # checked does not: the failure names the limit, the log is written, and no rank survives.
    with pytest.raises(AssertionError, match=r"stopped after its limit of 3 s"):
        launch(ranks, [str(script)], tmp_path / "launch.log", timeout=3, torchrun=torchrun)
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


# Rank 1 exits with status 3 once every rank has left its pid; the others would sleep past the
# launch's limit.
FAILER = ("import glob, os, sys, time\nrank = int(os.environ['RANK'])\n"
          "open(f'{__file__}.{rank}.tmp', 'w').write(str(os.getpid()))\n"
          "os.rename(f'{__file__}.{rank}.tmp', f'{__file__}.{rank}.pid')\n"
          "print('rank', rank, 'of', os.environ['WORLD_SIZE'], 'local', os.environ['LOCAL_RANK'], flush=True)\n"
          "while rank == 1 and len(glob.glob(f'{__file__}.*.pid')) < 3:\n    time.sleep(0.05)\n"
          "sys.exit(3) if rank == 1 else time.sleep(600)\n")


def test_forked_ranks_get_torchruns_environment_and_the_first_failure_stops_them_all(tmp_path):
    """`forked_cli.run_script_ranks` (test workers on several ranks without torchrun's start-up):
    every rank sees torchrun's variables, and as under torchrun the first rank that fails
    ends the launch with its exit status; no rank is left running."""
    from forked_cli import run_script_ranks

    script = tmp_path / "failer.py"
    script.write_text(FAILER)
    pids = lambda: [int(p.read_text()) for p in tmp_path.glob("failer.py.*.pid")]  # noqa: E731
    done = run_script_ranks(script, [], 3, timeout=300)  # the sleepers would outlast this limit
    assert done.returncode == 3
    assert len(pids()) == 3 and not [pid for pid in pids() if _alive(pid)]
    assert "rank 1 of 3 local 1" in done.stdout.split("[rank 1]")[1]


def test_forked_ranks_form_one_process_group(tmp_path):
    """The ranks rendezvous in the store the launching process hosts, as torchrun's workers
    do in their agent's: titan's `init_distributed` starts one gloo group across them."""
    from forked_cli import run_script_ranks

    script = tmp_path / "group.py"
    script.write_text("import torch, torch.distributed as dist\nfrom titan.dist import init_distributed\n"
                      "env = init_distributed(timeout_s=60)\nt = torch.tensor([float(env.rank + 1)])\n"
                      "dist.all_reduce(t)\nprint('sum', int(t.item()), 'on rank', env.rank)\n"
                      "dist.barrier()\ndist.destroy_process_group()\n")
    # Well under the test's limit: a hung rank then fails with what every rank printed (it hung
    # once in a full suite run, past pytest-timeout's 300 s, with nothing to show).
    done = run_script_ranks(script, [], 3, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert done.returncode == 0, done.stdout
    assert [f"sum 6 on rank {r}" in done.stdout for r in range(3)] == [True] * 3
