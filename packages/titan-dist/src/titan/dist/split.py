"""One launched job split into two parts, each with a default process group of its own, and a
bridge between them.

A disaggregated RL job is one ``torchrun`` launch whose first ranks train and whose last
ranks generate. Giving each part its own default group (rather than one group over the whole
job) keeps everything that assumes "the default group is my mesh" exact inside a part: the
engine's mesh, checkpoint groups, the preemption vote, the final barrier. The parts talk only
through a :class:`Bridge`: a process group over the first part's first rank and every rank of
the second part, built beside both default groups.

Every process of the job calls :func:`split_job` once, before :func:`init_distributed`, which
then describes this rank's part (its rank and size within the part) and starts nothing more.
"""

from __future__ import annotations

import atexit
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titan.dist import env as _env

STORE_PREFIX = "titan/split"
"""Namespace of the split job's keys in the launcher's store (one sub-namespace per group)."""


class Bridge:
    """Collectives between the first rank of part 0 (bridge rank 0) and every rank of part 1
    (bridge ranks 1, 2, ...), over a process group outside both parts' default groups.

    ``src``/``dst`` are bridge ranks. Tensors must live on :attr:`device` (the CPU with gloo,
    this rank's GPU with NCCL); objects are pickled into byte tensors, so they can be anything
    the two sides both import.
    """

    def __init__(self, group: Any, *, rank: int, size: int, device: torch.device) -> None:
        self.group, self.rank, self.size, self.device = group, rank, size, torch.device(device)

    def close(self) -> None:
        """Release the bridge's process group now (idempotent; no collective, so a rank may
        close while its peers are gone). :func:`split_job` registers this to run at exit:
        a gloo group still alive when the interpreter shuts down aborted its process
        ("terminate called without an active exception", 2 of 8 two-rank launches here),
        while released here its threads are joined in order."""
        self.group = None

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast ``tensor`` in place from bridge rank ``src`` to every bridge rank."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of bridge rank ``src`` on every bridge rank (others pass nothing)."""
        payload = self._pack(obj) if self.rank == src else None
        size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        return self._unpack(self.broadcast(payload, src))

    def send_object(self, obj: Any, dst: int, *, tag: int = 0) -> None:
        """Send ``obj`` to bridge rank ``dst`` alone (it calls :meth:`recv_object`)."""
        payload = self._pack(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self.group.send([size], dst, tag).wait()
        self.group.send([payload], dst, tag).wait()

    def recv_object(self, src: int, *, tag: int = 0) -> Any:
        """The object bridge rank ``src`` sent with :meth:`send_object`."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.recv([size], src, tag).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.group.recv([payload], src, tag).wait()
        return self._unpack(payload)

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every bridge rank (a MIN all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([flag], opts).wait()
        return bool(flag.item())

    def _pack(self, obj: Any) -> torch.Tensor:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    @staticmethod
    def _unpack(payload: torch.Tensor) -> Any:
        return pickle.loads(payload.cpu().numpy().tobytes())  # noqa: S301 - our own job's ranks


@dataclass(frozen=True)
class JobSplit:
    """Where this process sits in a split job."""

    part: int
    """0 (the job's first ranks) or 1 (its last ranks)."""
    rank: int
    """This process's rank within its part (its rank in the part's default group)."""
    size: int
    """Ranks in this part."""
    global_rank: int
    """This process's rank in the whole launch (torchrun's RANK)."""
    part_sizes: tuple[int, int]
    """Ranks in part 0 and in part 1."""
    bridge: Bridge | None
    """The bridge, on its members (part 0's first rank and every rank of part 1); None elsewhere."""
    device: torch.device
    """This process's device: the GPU its LOCAL_RANK names, or the CPU."""
    has_group: bool
    """Whether this part has a default process group (a part of one rank, or a part started
    without one, has none)."""


_split: JobSplit | None = None
"""The split of this process's job, once :func:`split_job` ran."""


def current_split() -> JobSplit | None:
    """The split :func:`split_job` made in this process (None in an unsplit job)."""
    return _split


def _backend_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device):
    """A process group object outside torch's registry (it spans two default groups)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
        group.eager_connect_single_device(device)
        return group
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def split_job(first_part_size: int, *, timeout_s: float = 1800.0,
              part_groups: tuple[bool, bool] = (True, True)) -> JobSplit:
    """Split this launch (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, rendezvous over
    MASTER_ADDR / MASTER_PORT) into its first ``first_part_size`` ranks and the rest, start
    each part's default process group (none for a part of one rank, nor for a part whose
    ``part_groups`` entry is False: its ranks then stay free to start groups of their own,
    as an in-process vLLM engine does) and the bridge. Every process of the launch must call
    it, once, with the same arguments. ``timeout_s`` bounds every bridge collective: a
    generator waits on the bridge while the trainer trains, checkpoints and evaluates."""
    global _split
    if _split is not None:
        raise RuntimeError("split_job was already called in this process")
    world = _env._env_int("WORLD_SIZE", 1)
    rank = _env._env_int("RANK", 0)
    if not 0 < first_part_size < world:
        raise ValueError(
            f"cannot split a job of {world} ranks into {first_part_size} and {world - first_part_size}: "
            "both parts need at least one rank"
        )
    if dist.is_initialized():
        raise RuntimeError("split_job must run before any process group is started in this process")
    device = _env._pick_device(_env._env_int("LOCAL_RANK", rank))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = _env.rendezvous_store(rank, world, timeout)
    sizes = (first_part_size, world - first_part_size)
    part = 0 if rank < first_part_size else 1
    part_rank = rank - (0 if part == 0 else first_part_size)
    has_group = sizes[part] > 1 and part_groups[part]
    if has_group:
        dist.init_process_group(
            backend=backend, store=dist.PrefixStore(f"{STORE_PREFIX}/part{part}", store), rank=part_rank,
            world_size=sizes[part], timeout=timeout, device_id=device if device.type == "cuda" else None,
        )
    _env.enter_part(part_rank, sizes[part], has_group=has_group)
    bridge = None
    if rank == 0 or part == 1:
        bridge_rank = 0 if rank == 0 else part_rank + 1
        group = _backend_group(backend, dist.PrefixStore(f"{STORE_PREFIX}/bridge", store), bridge_rank,
                               sizes[1] + 1, timeout, device)
        bridge = Bridge(group, rank=bridge_rank, size=sizes[1] + 1, device=device)
        atexit.register(bridge.close)
    _split = JobSplit(part=part, rank=part_rank, size=sizes[part], global_rank=rank, part_sizes=sizes, bridge=bridge,
                      device=device, has_group=has_group)
    return _split


__all__ = ["Bridge", "JobSplit", "current_split", "split_job"]
