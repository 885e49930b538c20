"""Layout-independent initialization: a parameter's value never depends on how it is sharded.

The multi-rank test spawns 4 real gloo processes and fills DTensors of every placement that
FSDP2 and tensor parallel produce (uneven shards, strided FSDP-over-TP shards included) with
generator blocks much smaller than a shard, so shards straddle block edges.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from titan.models.common import init as init_module
from titan.models.common.init import SeededInit, block_seed, fill_seeded_
from torch import nn

SMALL_BLOCK = 6  # elements: a (7, 5) tensor spans 7 blocks of one row each


def _normal(t: torch.Tensor, g: torch.Generator) -> None:
    nn.init.normal_(t, 0.0, 1.0, generator=g)


def _reference(shape: tuple[int, ...], name: str) -> torch.Tensor:
    full = torch.empty(shape)
    fill_seeded_(full, _normal, seed=5, name=name)
    return full


def test_block_seed_is_stable_and_distinct():
    assert block_seed(0, "w", 0) == block_seed(0, "w", 0)
    assert len({block_seed(0, "w", 0), block_seed(0, "w", 1), block_seed(1, "w", 0), block_seed(0, "v", 0)}) == 4


def test_blocks_are_independent_draws(monkeypatch):
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", SMALL_BLOCK)
    value = _reference((8, 3), "w")  # two rows per block
    assert not torch.equal(value[0:2], value[2:4])
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 1 << 22)
    big = _reference((8, 3), "w")
    # The block size is part of the definition of the values (documented on BLOCK_ELEMENTS).
    assert not torch.equal(value, big)


def test_seeded_init_reaches_requested_distribution():
    linear = nn.Linear(256, 512, bias=False)
    SeededInit(linear, seed=3).trunc_normal_(linear.weight, std=0.02)
    w = linear.weight.detach()
    assert w.abs().max() <= 3 * 0.02 + 1e-7
    assert 0.017 < float(w.std()) < 0.02  # truncation at 3 std shrinks the std by ~1.4%


def test_seeded_init_follows_global_seed_when_none():
    def draw(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        linear = nn.Linear(4, 4, bias=False)
        SeededInit(linear).normal_(linear.weight, std=1.0)
        return linear.weight.detach().clone()

    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))


def test_foreign_tensor_is_refused():
    with pytest.raises(ValueError, match="not a parameter"):
        SeededInit(nn.Linear(2, 2)).normal_(torch.empty(2), std=1.0)


def _worker(rank: int, world: int, store_path: str, errors) -> None:
    try:
        _check_every_placement(rank, world, store_path)
    except BaseException as err:  # report to the parent instead of a silent non-zero exit
        import traceback

        errors.put(f"rank {rank}: {err}\n{traceback.format_exc()}")
        raise


def _check_every_placement(rank: int, world: int, store_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    init_module.BLOCK_ELEMENTS = SMALL_BLOCK
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        cases = {
            "row": [Shard(0), Replicate()],
            "col": [Replicate(), Shard(1)],
            "row_row": [Shard(0), Shard(0)],
            "row_col": [Shard(0), Shard(1)],
            "replicated": [Replicate(), Replicate()],
        }
        for name, placements in cases.items():
            dt = distribute_tensor(torch.zeros(7, 5), mesh, placements)
            fill_seeded_(dt, _normal, seed=5, name=name)
            torch.testing.assert_close(dt.full_tensor(), _reference((7, 5), name), rtol=0, atol=0, msg=name)

        # The real thing: FSDP2 over tensor-parallel linears (strided shards on dim 0).
        model = nn.Sequential(nn.Linear(6, 10, bias=False), nn.Linear(10, 6, bias=False))
        with torch.device("meta"):
            meta = nn.Sequential(nn.Linear(6, 10, bias=False), nn.Linear(10, 6, bias=False))
        parallelize_module(meta, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(meta, mesh=mesh["dp"])
        meta.to_empty(device="cpu")
        for module in (model, meta):
            init = SeededInit(module, seed=9)
            for param in module.parameters():
                init.normal_(param, std=1.0)
        for (key, param), ref in zip(meta.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(param.full_tensor(), ref.detach(), rtol=0, atol=0, msg=key)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_placement_equals_the_plain_tensor(tmp_path):
    world = 4
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "store"), errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
