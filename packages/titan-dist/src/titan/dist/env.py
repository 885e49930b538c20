"""Process-group set-up from torchrun's environment."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its global and node-local rank, the world size, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that logs and writes shared files)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


def _pick_device(local_rank: int) -> torch.device:
    """One accelerator per process, chosen by LOCAL_RANK; CPU when there is none."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def rendezvous_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store this attempt's process groups meet in (``env://``: MASTER_ADDR/PORT).

    Under ``torchrun --max-restarts`` every attempt's workers connect to the same store, the
    agent's, which keeps the keys of the attempts before: a restarted rank would read its dead
    peer's gloo address and wait on it until the timeout. Keys are kept apart per attempt
    (``TORCHELASTIC_RESTART_COUNT``)."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else dist.PrefixStore(f"titan/attempt_{attempt}", store)


_started_default_group = False
"""Whether `init_distributed` started the default process group of this process."""


def init_distributed(timeout_s: float = 300) -> DistEnv:
    """Read torchrun's RANK / LOCAL_RANK / WORLD_SIZE and start the default process group.

    In a job split by `titan.dist.split.split_job` it describes this rank's part instead
    (rank and size within the part, whose group the split started). World size 1 starts no
    process group at all (a plain single-device run). Otherwise the
    backend is nccl on CUDA and gloo on CPU; `timeout_s` bounds every collective so a
    mismatched collective fails instead of hanging.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    device = _pick_device(local_rank)
    if _part is not None:  # `split_job` already started this part's group (or none: one rank)
        part_rank, part_size, has_group = _part
        if part_size > 1 and not has_group:
            raise RuntimeError(
                f"this part of a split job was started without a process group; its {part_size} ranks "
                "cannot run a multi-rank engine"
            )
        return DistEnv(rank=part_rank, local_rank=local_rank, world_size=part_size, device=device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=rendezvous_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        mark_default_group_started()
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


_part: tuple[int, int, bool] | None = None
"""(rank, size, has a default group) of this process's part of a job split by
`titan.dist.split.split_job`; None in an unsplit job."""


def enter_part(rank: int, size: int, *, has_group: bool) -> None:
    """Record this process's part of a split job: `init_distributed` then describes the part
    (and, when it has one, the part's default group, which the split started)."""
    global _part
    _part = (rank, size, has_group)
    if has_group:
        mark_default_group_started()


def mark_default_group_started() -> None:
    """Record that titan started this process's default group (`destroy_distributed` ends it)."""
    global _started_default_group
    _started_default_group = True


_leaving_after_failure = False
"""Set by `leaving_after_failure`: `destroy_distributed` then skips its barrier."""


@contextlib.contextmanager
def leaving_after_failure() -> Iterator[None]:
    """Within: this rank is closing after an error of its own, so `destroy_distributed` leaves
    without its barrier. A peer may be waiting in a collective this rank will never join; the
    barrier would hold this rank, and its error, until that collective's timeout (and the
    peer would then report the timeout as the run's failure). Leaving at once ends the peers'
    collectives with a closed connection, and the launcher stops the others when this rank
    exits."""
    global _leaving_after_failure
    previous, _leaving_after_failure = _leaving_after_failure, True
    try:
        yield
    finally:
        _leaving_after_failure = previous


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear down the default process group `init_distributed` started (no-op otherwise: a
    group another library started in this process, such as an in-process vLLM engine's, is
    its owner's to destroy).

    The barrier first makes sure no rank leaves while another still waits on a collective;
    ``barrier=False`` leaves at once (after a collective timed out: a peer is gone or hung,
    and a barrier would only time out again), as does a rank closing after its own error
    (`leaving_after_failure`).
    """
    global _started_default_group
    if _started_default_group and dist.is_initialized():
        _started_default_group = False
        if barrier and not _leaving_after_failure:
            dist.barrier()
        dist.destroy_process_group()
