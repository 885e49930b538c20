"""The launch helper the end-to-end tests share: a launch past its limit fails with its output
and leaves no rank behind (so a hung collective costs one launch's limit, not the suite's)."""

import subprocess

import pytest
from launching import launch

SLEEPER = "import os, time\nprint('rank', os.environ.get('RANK', '0'), 'started', flush=True)\ntime.sleep(120)\n"


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


def test_a_launch_that_succeeds_logs_its_command_and_output(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello from', __import__('os').environ['OMP_NUM_THREADS'], 'thread')\n")
    launch(1, [str(script)], tmp_path / "launch.log")
    log = (tmp_path / "launch.log").read_text()
    assert str(script) in log.splitlines()[0] and "hello from 1 thread" in log
