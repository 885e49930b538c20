"""One live run per dump folder.

Two runs writing the same ``--job.dump_folder`` (the same command started twice, a scheduler
retry while the first attempt still runs) would interleave their metrics, overwrite each
other's ``config.json`` and replace or purge each other's checkpoint steps. Rank 0 of a run
holds an advisory lock on ``<dump_folder>/.titan-run.lock`` from the loop's construction to
its ``close()``; a second run stops before it writes anything, naming the first (pid, host,
start time). The operating system drops the lock with the process, so a killed run leaves no
stale lock: its relaunch (``torchrun --max-restarts``, a resubmitted job) starts as usual.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".titan-run.lock"


class RunFolderBusy(ValueError):
    """Another live run holds the dump folder (a one-line error on the command line)."""


class RunFolderLock:
    """The lock of one dump folder, held by this process until :meth:`release`."""

    def __init__(self, dump_folder: str | os.PathLike[str]) -> None:
        self.path = Path(dump_folder) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> RunFolderLock:
        """Take the lock or raise :class:`RunFolderBusy` naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(handle)
            handle.close()
            raise RunFolderBusy(
                f"--job.dump_folder {self.path.parent} is in use by another titan run ({holder}); "
                "two runs in one folder would mix their metrics and replace each other's "
                "checkpoints. Wait for it to finish, stop it, or give this run another "
                "--job.dump_folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, harmless to the next run."""
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._file is not None


def _read_holder(handle: IO[str]) -> str:
    """"pid P on host H, started T" from the lock file, or what is known."""
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
    except ValueError:
        info = {}
    if not info:
        return "its details are not written yet"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"


def lock_run_folder(dump_folder: str | os.PathLike[str], *, rank: int) -> RunFolderLock:
    """Rank 0 takes the folder's lock (other ranks hold an unheld one: rank 0 speaks for the
    run; torchrun stops the other ranks when rank 0 fails to start)."""
    lock = RunFolderLock(dump_folder)
    return lock.acquire() if rank == 0 else lock


__all__ = ["LOCK_NAME", "RunFolderBusy", "RunFolderLock", "lock_run_folder"]
