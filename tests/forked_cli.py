"""One-process `titan` runs forked from an interpreter that has already imported titan.

A fresh `titan` process spends ~3 s of CPU importing torch, its distributed packages and
titan before its first step: more than most test runs of the tiny models train. ``run_titan``
runs the command line exactly as the console script does (``titan.recipes.cli.main``), in a
process of its own (its own globals, signal handlers, exit status, stdout and stderr), forked
from a server process that imported those modules once per pytest process (multiprocessing's
forkserver, with titan preloaded). Only the imports are shared, none of a run's state: the
server never runs anything but imports.

Multi-rank `titan` runs start under torchrun, their ranks fresh interpreters as users start
them; only torchrun's agent is forked from the server (``run_torchrun``: it would import
torch again just to start them). The test workers that drive titan's components on several
ranks (no `titan` command line) fork their ranks from the same server with torchrun's worker
environment (``run_script_ranks``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ["titan.recipes.cli", "titan.train.trainer", "titan.train.sft", "titan.rl.controller", "torch._dynamo"]
"""What the server imports: the command line, its three loops, and what every optimizer's
construction imports (``torch.optim`` imports dynamo on first use)."""

_context = None


def forkserver():
    """The forkserver context, its preload set once per pytest process (the server itself
    starts on the first run). Also the start method of the titan-dist tests' spawned ranks
    (titan_dist_testlib.run_ranks): a process has one forkserver, so every user preloads the
    same modules."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(target, fd)
    os.close(target)


def _run_in_child(args: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str,
                  script: str | None = None, module: bool = False) -> None:
    """The forked process: the environment and folder a fresh process would have, its output
    into the two files (one file may take both), then the command line (or ``script`` with
    ``args``, as ``python SCRIPT ARGS`` runs it; with ``module``, ``python -m SCRIPT ARGS``);
    its exit status is the run's."""
    if module:  # a launcher: a session of its own, so that what it starts can be stopped with it
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    # What a fresh interpreter would take from the environment and its command line at start-up.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if script is not None:
        sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, stdout)
    if stderr == stdout:
        os.dup2(1, 2)
    else:
        _redirect(2, stderr)
    if module:
        sys.argv = [script, *args]  # runpy puts the module's file name first, as `python -m` does
        runpy.run_module(script, run_name="__main__", alter_sys=True)
        return
    if script is not None:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        return
    sys.argv = ["titan", *args]
    from titan.recipes.cli import main

    sys.exit(main(args))


def _run_forked(args: list[str], script: str | None, env: Mapping[str, str] | None, cwd: str | Path | None,
                timeout: float, merge_output: bool, module: bool = False) -> subprocess.CompletedProcess:
    command = ([sys.executable, *(["-m"] if module else []), script, *args] if script is not None
               else ["titan", *args])
    with tempfile.TemporaryDirectory(prefix="titan-run-") as folder:
        out = os.path.join(folder, "stdout")
        err = out if merge_output else os.path.join(folder, "stderr")
        process = forkserver().Process(
            target=_run_in_child, args=(args, dict(os.environ if env is None else env),
                                        None if cwd is None else str(cwd), out, err, script, module))
        process.start()
        process.join(timeout)
        timed_out = process.is_alive()
        if timed_out:
            process.terminate()
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
            if module:  # whatever the launcher left in its session
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        stdout, stderr = (Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in (out, err))
    if merge_output:
        stderr = ""
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)


def run_titan(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """``titan ARGS`` in one process, as ``subprocess.run([...], capture_output=True,
    text=True)`` would run it (``env`` defaults to this process's environment): the returned
    object has ``returncode`` (negative: killed by that signal), ``stdout`` and ``stderr``. A
    run past ``timeout`` seconds is stopped (SIGTERM, then SIGKILL) and raises
    ``subprocess.TimeoutExpired`` with what it printed."""
    return _run_forked([str(a) for a in args], None, env, cwd, timeout, merge_output=False)


def run_script(script: str | Path, args: Sequence[str], *, env: Mapping[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` in one forked process (the script's folder first on its path, as
    Python puts it): like :func:`run_titan`, with stdout and stderr in ``stdout``, in the order
    written."""
    return _run_forked([str(a) for a in args], str(script), env, None, timeout, merge_output=True)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
"""How the tests start torchrun in a fresh interpreter (``run_command`` forks its agent instead)."""


def run_torchrun(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 timeout: float = 600, merge_output: bool = False) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` (``python -m torch.distributed.run``) with its agent forked from the
    server, torch already imported (measured: ~1.5 s of CPU and ~1.3 s less per 2-rank
    launch); the agent starts its ranks as fresh interpreters, as it does for users. Returns
    like :func:`run_titan` (``merge_output``: stdout and stderr together in ``stdout``, in the
    order written, as :func:`run_script`). A launch past ``timeout`` gets SIGTERM, on which the
    agent stops its ranks as on a user's Ctrl-C, then SIGKILL with its session."""
    return _run_forked([str(a) for a in args], "torch.distributed.run", env, cwd, timeout, merge_output=merge_output,
                       module=True)


def _torchrun_worker_env(env: Mapping[str, str], rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun's agent puts in a worker's environment on one node (``LOCAL_RANK``,
    ``RANK``, ``WORLD_SIZE``, their group and role forms, the rendezvous address), with every
    rank a client of the store the launching process hosts (``TORCHELASTIC_USE_AGENT_STORE``,
    as torchrun's own workers are clients of their agent's store)."""
    return {**env, "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(ranks), "WORLD_SIZE": str(ranks),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def _stop(processes: list, grace: float = 30) -> None:
    """SIGTERM every live process, then SIGKILL what is still alive after ``grace`` seconds."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_script_ranks(script: str | Path, args: Sequence[str], ranks: int, *, env: Mapping[str, str] | None = None,
                     timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node RANKS SCRIPT ARGS`` with the ranks forked from the server:
    each rank gets the environment torchrun gives its workers, and rendezvouses in a store
    this process hosts on a port the OS picks (never released while the ranks run, so no
    other test can take it). As torchrun does, the first rank that fails stops the others.
    Returns like :func:`run_script`: ``returncode`` is the first failed rank's (0 when all
    succeeded) and ``stdout`` each rank's output in turn, under a ``[rank R]`` line."""
    import torch.distributed as dist

    args = [str(a) for a in args]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), str(script), *args]
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="titan-ranks-") as folder:
        outputs = [os.path.join(folder, f"rank{rank}") for rank in range(ranks)]
        processes = [forkserver().Process(target=_run_in_child, args=(
            args, _torchrun_worker_env(base, rank, ranks, store.port), None, out, out, str(script)))
            for rank, out in enumerate(outputs)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        failed = None
        while failed is None and any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()],
                                            timeout=max(0.0, deadline - time.monotonic()))
            failed = next((p.exitcode for p in processes if p.exitcode not in (None, 0)), None)
        timed_out = failed is None and any(p.is_alive() for p in processes)
        _stop(processes)
        failed = failed if failed is not None else next((p.exitcode for p in processes if p.exitcode), 0)
        stdout = "".join(f"[rank {rank}]\n" + (Path(out).read_text(errors="replace") if os.path.exists(out) else "")
                         for rank, out in enumerate(outputs))
    del store
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr="")
    return subprocess.CompletedProcess(command, failed, stdout, "")


CLI = [sys.executable, "-m", "titan.recipes.cli"]
"""How the tests start `titan` in a fresh interpreter (``run_command`` forks this one instead)."""


def run_command(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``, except that a one-process
    `titan` command line (``CLI + args``) runs through :func:`run_titan` and a torchrun launch
    (``TORCHRUN + args``) through :func:`run_torchrun`; anything else starts as written."""
    cmd = [str(c) for c in cmd]
    if cmd[: len(CLI)] == CLI:
        return run_titan(cmd[len(CLI):], env=env, cwd=cwd, timeout=timeout)
    if cmd[: len(TORCHRUN)] == TORCHRUN:
        return run_torchrun(cmd[len(TORCHRUN):], env=env, cwd=cwd, timeout=timeout)
    return subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else dict(env), cwd=cwd,
                          timeout=timeout)
