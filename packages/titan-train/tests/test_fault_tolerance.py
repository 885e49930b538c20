"""--fault_tolerance.* flags: checked when parsed; the data split between replica groups."""

from __future__ import annotations

import pytest
import torch
from titan.train.fault_tolerance import FaultToleranceConfig, ReplicaGroups


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--fault_tolerance.group_size must be >= 1"):
        FaultToleranceConfig(enable=True)
    with pytest.raises(ValueError, match=r"--fault_tolerance.replica_id must be in \[0, 2\)"):
        FaultToleranceConfig(enable=True, group_size=2, replica_id=2)
    with pytest.raises(ValueError, match=r"--fault_tolerance.min_replica_size must be in \[1, 2\]"):
        FaultToleranceConfig(enable=True, group_size=2, min_replica_size=3)
    FaultToleranceConfig(replica_id=7)  # off: nothing is checked or used


def test_each_group_reads_its_own_share_of_the_data():
    shards = [FaultToleranceConfig(enable=True, group_size=3, replica_id=r).data_shard(dp, 2)
              for r in range(3) for dp in range(2)]
    assert shards == [(i, 6) for i in range(6)]  # every (group, dp rank) a distinct rank of 6
    assert FaultToleranceConfig().data_shard(1, 2) == (1, 2)


def test_a_lighthouse_address_is_required(monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    config = FaultToleranceConfig(enable=True, group_size=2)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        ReplicaGroups(config, states={}, rank=0, world_size=1, device=torch.device("cpu"), timeout_s=5)
