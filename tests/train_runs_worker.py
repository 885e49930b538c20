"""Several `titan train` (or `titan sft`, `titan rl`) runs in one launch: one process group (or one process), many runs.

Starting the interpreter, importing torch and rendezvousing cost more than training the tiny
test models for a few steps, so the end-to-end tests start one launch per group of runs of the
same world size (``launching.launch_train_runs``) and run each `titan train` in it, one after
another, exactly as the command line would (`titan.recipes.cli.run`: parse, preflight, build, train, close).

The process group stays up between runs: `close` would destroy it, so the engine's teardown
only synchronizes the ranks here, and the group is destroyed once, after the last run.

Usage: ``python train_runs_worker.py RUNS.json`` (under torchrun for several ranks), where the file
holds ``[[name, [flag, ...], command], ...]`` (command: train, sft or rl);
each run's flags name its own ``--job.dump_folder``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator

import titan.train.engine as engine_module
import torch.distributed as dist
from launching import RUN_MARKER
from titan.dist import destroy_distributed

from titan.recipes.cli import run


def _keep_process_group(*, barrier: bool = True) -> None:
    """What a run's teardown does to the process group here: wait for every rank (not after a
    failed collective, as ``destroy_distributed(barrier=False)``: a peer is gone, and the run's
    own error is the one to report)."""
    if barrier and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """Runs inside share the process group the first one starts; it is destroyed at the end."""
    engine_module.destroy_distributed = _keep_process_group
    try:
        yield
    finally:
        destroy_distributed()


def main(runs_file: str) -> int:
    """Run every run of `runs_file` in order; stop at the first failure."""
    with open(runs_file) as f:
        runs = json.load(f)
    with one_process_group():
        for name, flags, command in runs:
            # One write (atomic on a pipe), so the ranks' announcements never interleave.
            sys.stderr.write(f"{RUN_MARKER}{name}\n")
            sys.stderr.flush()
            started = time.perf_counter()
            if run(flags, command=command) != 0:
                raise SystemExit(f"train_runs_worker: {name} failed")
            # Where a launch's time goes (the suite's slowest fixtures are such launches).
            sys.stderr.write(f"train_runs_worker: {name} took {time.perf_counter() - started:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
