"""Collectives that never return: timeouts, the flight recorder, and stacks of hung ranks.

- `enable_flight_recorder` (before the process group starts): torch's flight recorder keeps the
  last collectives of every group (gloo and NCCL); on NCCL its watchdog dumps them on a timeout.
- `set_collective_timeout`: the timeout of every group of a mesh (torchtitan's split: a long
  one for the set-up and first step, a short one after).
- `CollectiveTimeoutError.from_error`: a backend's timeout ("Timed out waiting 5000ms for recv
  operation", "Watchdog caught collective operation timeout") turned into one line naming the
  collective (from the flight recorder: op, process group, its ranks, sequence number), with the
  trace written to a file.
- `HangWatchdog`: if a step nears the timeout, every thread's Python stack of this rank goes to
  stderr (`faulthandler`), so a rank that hangs outside a collective is seen too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

TRACE_FOLDER = "comm_traces"
"""Where, under the run's dump folder, each rank writes its flight-recorder trace."""

# The backends' own words for a collective that ran out of time (gloo: "Timed out waiting
# 5000ms for recv operation to complete"; NCCL's watchdog: "Watchdog caught collective
# operation timeout"); any other error that mentions a timeout (a data source, a store) is not
# one, and must not make the run skip its checkpoint drain.
_TIMEOUT = re.compile(r"timed out waiting \d+ ?ms for (recv|send)|collective operation timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"connection (reset|closed)|broken pipe|ncclRemoteError|ncclSystemError", re.IGNORECASE)


def is_peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because a peer rank went away (its
    connection reset or closed): the group can no longer run a barrier or a save."""
    return isinstance(err, RuntimeError) and bool(_PEER_LOST.search(str(err)))


def enable_flight_recorder(buffer_size: int, folder: str | Path | None) -> None:
    """Turn on torch's flight recorder for the process groups started after this call (an
    environment variable set by the user wins); on NCCL its watchdog dumps the trace of a
    timed-out collective to ``folder/rank_<R>``."""
    if buffer_size <= 0:
        return
    # Only the flight recorder's own name: torch >= 2.11 reads it, and setting the older
    # TORCH_NCCL_TRACE_BUFFER_SIZE too makes every rank warn that it is deprecated.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer_size))
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(folder) / "rank_"))
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(folder) / "rank_"))


def set_collective_timeout(seconds: float, groups: Iterable[Any]) -> None:
    """Give the default group and every group of ``groups`` a timeout of ``seconds``."""
    if not dist.is_initialized():
        return
    unique = {id(g): g for g in [dist.group.WORLD, *groups] if g is not None}
    for group in unique.values():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def flight_recorder_dump() -> dict[str, Any]:
    """The flight recorder's record of this process: ``entries`` (its last collectives, oldest
    first) and ``pg_config`` (each group's ranks); empty when it is off."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return json.loads(_dump_fr_trace_json(True, True))
    except (ImportError, RuntimeError, ValueError):
        return {}


def _describe(entry: dict[str, Any], configs: dict[str, Any]) -> str:
    """E.g. "all_reduce #12 of process group mesh_dp_shard over ranks [0, 1]"."""
    op = str(entry.get("profiling_name", "a collective")).split(":")[-1]
    name, desc = (list(entry.get("process_group") or []) + ["?", "?"])[:2]
    # The default group's configuration is recorded under an empty name.
    config = configs.get(name) or {}
    if config.get("ranks") not in (None, "", "[]"):
        members = f" over ranks {config['ranks']}"
    elif desc == "default_pg" and dist.is_initialized():
        members = f" over all {dist.get_world_size()} ranks"
    else:
        members = ""
    return f"{op} #{entry.get('collective_seq_id', '?')} of process group {desc}{members}"


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within its timeout."""

    @classmethod
    def from_error(cls, err: BaseException, *, rank: int, timeout_flag: str,
                   trace_folder: str | Path | None) -> CollectiveTimeoutError | None:
        """The one-line error for a backend's timeout ``err`` (None when ``err`` is not one):
        the collective this rank waited on, from the flight recorder, whose trace is written
        to ``trace_folder/rank_<R>.json``."""
        if not isinstance(err, RuntimeError) or not _TIMEOUT.search(str(err)):
            return None
        record = flight_recorder_dump()
        entries = record.get("entries", [])
        waited = _waited_on(record)
        where = ""
        if entries and trace_folder is not None:
            path = Path(trace_folder) / f"rank_{rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(entries, indent=1))
            where = f"; its last {len(entries)} collectives are in {path}"
        return cls(f"rank {rank} timed out {waited} ({timeout_flag}; {_first_line(err)}){where}; another rank stopped "
                   "taking part (its stack is printed above: every rank prints its own when a step nears the timeout)")


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank left the run: that rank's own error (printed
    by it) is the run's cause, this one only its consequence."""

    @classmethod
    def from_error(cls, err: BaseException, *, rank: int) -> PeerLostError | None:
        """The one-line error for a backend's lost-peer ``err`` (None when ``err`` is not one),
        naming the collective this rank waited on (flight recorder)."""
        if not is_peer_lost(err):
            return None
        return cls(f"rank {rank} lost a peer {_waited_on(flight_recorder_dump())} ({_first_line(err)}): another "
                   "rank left the run; its own error, printed above, is the cause")


def _waited_on(record: dict[str, Any]) -> str:
    """What this rank was waiting on, from a flight-recorder dump."""
    entries = record.get("entries", [])
    return f"waiting on {_describe(entries[-1], record.get('pg_config', {}))}" if entries else "in a collective"


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when empty)."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _stderr_with_fileno() -> Any:
    """``sys.stderr``, or the process's original stderr when it was replaced by an object
    without a file descriptor (a notebook, a test's capture); None when neither has one:
    faulthandler writes to a descriptor from its own thread."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            continue
    return None


class HangWatchdog:
    """Dumps every thread's Python stack to stderr when one step has run 90% of ``seconds``
    (the collective timeout): early enough that every rank is still alive to print, before the
    timeout fails the run and the launcher stops the ranks. Re-armed by each `step_started`;
    `faulthandler`'s own thread, so it fires while the main thread is blocked in C++."""

    FRACTION = 0.9

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_started(self) -> None:
        """Restart the countdown for the step that begins now (a no-op when the process has
        no stderr file descriptor to write to)."""
        stream = _stderr_with_fileno()
        if stream is not None:
            faulthandler.dump_traceback_later(self.FRACTION * self.seconds, repeat=False, file=stream, exit=False)

    def stop(self) -> None:
        """Cancel the countdown (the run is over)."""
        faulthandler.cancel_dump_traceback_later()


__all__ = ["TRACE_FOLDER", "CollectiveTimeoutError", "HangWatchdog", "enable_flight_recorder",
           "PeerLostError", "flight_recorder_dump", "is_peer_lost", "set_collective_timeout"]
