"""How the end-to-end tests start processes: one interpreter for one rank, torchrun for
several (or, for test workers of titan's components, ranks forked with torchrun's worker
environment), each rank on one thread; and several `titan train` runs in one launch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from forked_cli import TORCHRUN, run_script, run_script_ranks, run_torchrun

TEST_TIMEOUT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
"""pytest-timeout's limit per test, as pyproject.toml sets it."""
LAUNCH_TIMEOUT = TEST_TIMEOUT - 30
"""The longest a launch may run: under the test's limit, so that a hung launch fails with
what its ranks printed (pytest-timeout would kill the test with only the launcher's stack)."""

RUNS_WORKER = Path(__file__).with_name("train_runs_worker.py")
RUN_MARKER = "train_runs_worker: run "  # what the worker prints before each run


def launcher(ranks: int) -> list[str]:
    """The command prefix that starts a Python script on ``ranks`` processes: this interpreter
    for one, torchrun (c10d rendezvous on a port the OS picks) for several."""
    if ranks == 1:
        return [sys.executable]
    return [*TORCHRUN, "--nproc_per_node", str(ranks), "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]


def launch(ranks: int, args: list[str], log: Path, *, timeout: float = 600,
           env: dict[str, str] | None = None, torchrun: bool = True) -> None:
    """Run ``args`` (a script and its arguments) on ``ranks`` processes with one thread each
    (and ``env`` added to their environment); the command and its output (stdout and stderr
    in the order written) go to ``log``; fail with the command and the end of the output
    unless it succeeded (a launch past ``timeout`` seconds, at most `LAUNCH_TIMEOUT`, is
    killed, every rank with it, and fails with what it printed). ``torchrun=False``: several ranks are forked from the
    preloaded server with torchrun's worker environment instead (for test workers that
    drive titan's components, not a `titan` command line)."""
    cmd = [*launcher(ranks), *args]
    timeout = min(timeout, LAUNCH_TIMEOUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # Forked from an interpreter with torch and titan imported (forked_cli.py): one rank, the
    # ranks of a component worker, or torchrun's agent (whose ranks start afresh).
    try:
        if ranks == 1:
            done = run_script(args[0], args[1:], env=env, timeout=timeout)
        elif torchrun:
            done = run_torchrun(cmd[len(TORCHRUN):], env=env, timeout=timeout, merge_output=True)
        else:
            done = run_script_ranks(args[0], args[1:], ranks, env=env, timeout=timeout)
        output, returncode = done.stdout, done.returncode
    except subprocess.TimeoutExpired as stopped:
        output, returncode = f"{stopped.output}\n[launch stopped after its limit of {timeout:.0f} s]", None
    log.write_text(f"{' '.join(cmd)}\n{output}")
    assert returncode == 0, f"{' '.join(cmd)}\n{output[-10000:]}"


def run_output(log: Path, name: str) -> str:
    """What run ``name`` of a ``launch_train_runs`` launch printed: every rank's lines from the
    worker's first announcement of that run to its first announcement of another one."""
    text = log.read_text()
    # Anywhere in a line: another rank's unfinished line (a progress bar's) may precede it.
    starts = [(m.start(), m.end(), m.group(1)) for m in re.finditer(f"{re.escape(RUN_MARKER)}(\\S+)\n", text)]
    mine = [i for i, (_, _, n) in enumerate(starts) if n == name]
    assert mine, f"no run {name!r} in {log}"
    after = next((start for start, _, n in starts[mine[0]:] if n != name), len(text))
    return text[starts[mine[0]][1]:after]


def launch_runs(ranks: int, worker: Path, runs: list[list], log: Path, *,
                env: dict[str, str] | None = None, torchrun: bool = True) -> None:
    """``worker`` run once on ``ranks`` processes with a JSON file of ``runs`` (the worker's own
    run descriptions, beside ``log``) as its argument: many runs, one launch (``torchrun``:
    as in :func:`launch`)."""
    runs_file = log.with_suffix(".json")
    runs_file.write_text(json.dumps(runs))
    launch(ranks, [str(worker), str(runs_file)], log, env=env, torchrun=torchrun)


def launch_train_runs(ranks: int, runs: list[tuple[str, list[str]]], log: Path, *, command: str = "train",
                      env: dict[str, str] | None = None) -> None:
    """Every `titan <command>` run (train, sft or rl) of ``runs`` ((name, flags); each names its
    own ``--job.dump_folder``) in one launch of ``ranks`` processes, one run after another."""
    launch_runs(ranks, RUNS_WORKER, [[name, flags, command] for name, flags in runs], log, env=env)
