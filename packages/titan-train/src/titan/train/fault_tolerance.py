"""Elastic data-parallel replicas with torchft (``--fault_tolerance.*``, ``titan-train[ft]``).

A job is ``--fault_tolerance.group_size`` replica groups, each an ordinary titan job (its own
launcher, process group, parallelism and checkpoints) that is one torchft participant. Every
step the groups agree on a quorum through torchft's lighthouse (``TORCHFT_LIGHTHOUSE``), average
their gradients over the live groups, and commit the optimizer step only if every live group
got through it. When a group dies the others keep stepping (the average is over the groups that
are left); a restarted group rejoins at the next quorum by fetching the live weights, optimizer
and schedule state from a healthy group, and steps in lockstep again.

Each group reads its own share of the data: the groups are data-parallel ranks of one larger
loader (a dead group's batches are skipped, not redistributed).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titan")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the lighthouse's address (``http://host:port``)."""


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Elastic replica groups with torchft (``--fault_tolerance.*``; torchtitan's names)."""

    enable: bool = False
    """Make this job one replica group of a fault-tolerant job: gradients are averaged over
    the live groups every step, a dead group does not stop the others, a restarted one rejoins
    with the live state. Needs torchft (pip install 'titan-train[ft]') and a running lighthouse
    (torchft_lighthouse) whose address is in TORCHFT_LIGHTHOUSE."""
    replica_id: int = 0
    """This group's index, 0 <= replica_id < group_size (its share of the data)."""
    group_size: int = 0
    """How many replica groups the job has (the data is split between them)."""
    min_replica_size: int = 1
    """Steps wait until at least this many groups are live."""

    def __post_init__(self) -> None:
        if not self.enable:
            return
        if importlib.util.find_spec("torchft") is None:
            raise ValueError("--fault_tolerance.enable needs torchft: pip install 'titan-train[ft]'")
        if self.group_size < 1:
            raise ValueError(f"--fault_tolerance.group_size must be >= 1 replica groups, got {self.group_size}")
        if not 0 <= self.replica_id < self.group_size:
            raise ValueError(
                f"--fault_tolerance.replica_id must be in [0, {self.group_size}) "
                f"(--fault_tolerance.group_size {self.group_size}), got {self.replica_id}"
            )
        if not 1 <= self.min_replica_size <= self.group_size:
            raise ValueError(
                f"--fault_tolerance.min_replica_size must be in [1, {self.group_size}], got {self.min_replica_size}"
            )

    def data_shard(self, dp_rank: int, dp_world_size: int) -> tuple[int, int]:
        """(rank, world size) of this data-parallel rank among every group's ranks."""
        if not self.enable:
            return dp_rank, dp_world_size
        return self.replica_id * dp_world_size + dp_rank, self.group_size * dp_world_size


class ReplicaGroups:
    """This group's torchft participant: the quorum at each step's start, the gradient average
    over live groups, the commit vote, and the state a rejoining group fetches.

    ``states`` maps names to ``Stateful`` objects (model, optimizer, schedule, step counter)
    that a rejoining group loads from a healthy one.
    """

    def __init__(self, config: FaultToleranceConfig, *, states: Mapping[str, Any], rank: int, world_size: int,
                 device: torch.device, timeout_s: float) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        if not os.environ.get(LIGHTHOUSE_ENV):
            raise ValueError(
                f"--fault_tolerance.enable needs the lighthouse's address in {LIGHTHOUSE_ENV} (http://host:port of "
                "a running torchft_lighthouse; tools/run_ft.sh starts one)"
            )
        self.config = config
        self.states = dict(states)
        # torchft reports every quorum and commit at INFO; titan reports membership changes.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._own_store = None
        store_addr, store_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if store_addr is None or store_port is None:  # one process without a launcher
            self._own_store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", str(self._own_store.port)
        timeout = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout),
            min_replica_size=config.min_replica_size,
            load_state_dict=self._load,
            state_dict=self._save,
            use_async_quorum=False,  # a rejoining group loads the live state before its forward
            replica_id=f"titan_replica_{config.replica_id}",
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=int(store_port),
            timeout=timeout,
            quorum_timeout=timeout,
        )
        self._participants = 0

    def _save(self) -> dict[str, Any]:
        return {name: state.state_dict() for name, state in self.states.items()}

    def _load(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            self.states[name].load_state_dict(value)
        step = self.manager.current_step()
        if step:
            logger.warning("replica group %d rejoined: loaded the live state of a healthy group (step %d)",
                           self.config.replica_id, step)
        else:
            logger.info("replica group %d starts from the same weights as the others", self.config.replica_id)

    def start_step(self) -> None:
        """Join this step's quorum (a rejoining group loads the live state here)."""
        self.manager.start_quorum()
        participants = self.manager.num_participants()
        if participants != self._participants:
            logger.warning("replica groups live: %d of %d (this is group %d)", participants, self.config.group_size,
                           self.config.replica_id)
            self._participants = participants

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average every gradient over the live groups (each group's shard with the same
        shard of the others: the groups share one layout)."""
        works = []
        for param in params:
            if param.grad is None:
                continue
            grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
            works.append(self.manager.allreduce(grad))
        for work in works:
            work.wait()

    def should_commit(self) -> bool:
        """Whether every live group finished this step's collectives (else the step is
        dropped: gradients zeroed, weights and step counter unchanged)."""
        return self.manager.should_commit()

    def close(self) -> None:
        """Leave the job."""
        self.manager.shutdown(wait=False)


__all__ = ["LIGHTHOUSE_ENV", "FaultToleranceConfig", "ReplicaGroups"]
