"""Layout-independent weight initialization.

A parameter's initial value is a function of (seed, parameter name, element index) only, never
of how the parameter is sharded: the full value is cut into fixed blocks of rows along dim 0,
each block drawn from its own generator seeded by ``hash(seed, name, block)``. A rank fills
its shard by drawing only the blocks that overlap it and copying the overlap, so

- one process, FSDP, HSDP, TP, PP, CP and their products all start from the same weights
  for the same seed (no seed checkpoint needed), and
- memory stays O(one block), never O(parameter) or O(model).

Why not ``nn.init`` on DTensors: on CPU (and any device without DTensor's offset-based RNG
tracker) every rank draws its local shard from the same generator state, so every shard is a
copy of the first one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

BLOCK_ELEMENTS = 1 << 22
"""Elements per generator block (16 MiB of fp32): bounds the memory init needs beside the
parameter shard. Part of the definition of the initial values: changing it changes them."""

Sampler = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a float32 tensor in place from a generator (an ``nn.init`` call with ``generator=``)."""


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block of one parameter: stable across processes and runs
    (a cryptographic hash, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, local shape, global offset) of a plain tensor or a DTensor.

    Every placement torch's FSDP2 and TP produce (Shard, strided shards of FSDP over TP,
    Replicate) leaves each rank a box of the global tensor; distributed checkpointing relies on
    the same fact and the same function.
    """
    if not isinstance(tensor, DTensor):
        return tensor, tuple(tensor.shape), (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(shape), tuple(offset)


@torch.no_grad()
def fill_seeded_(tensor: torch.Tensor, sample: Sampler, *, seed: int, name: str) -> None:
    """Fill ``tensor`` (plain or DTensor) with the layout-independent value of parameter
    ``name`` under ``seed``, drawing only the row blocks that overlap this rank's shard."""
    local, shape, offset = local_box(tensor)
    if local.numel() == 0:
        return
    full_shape = tuple(tensor.shape) or (1,)
    local_view = local.view(shape or (1,))
    shape, offset = shape or (1,), offset or (0,)
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, math.prod(full_shape[1:])))
    first_row, end_row = offset[0], offset[0] + shape[0]
    columns = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    generator = torch.Generator(device=local.device)
    for block in range(first_row // rows_per_block, -(-end_row // rows_per_block)):
        block_start = block * rows_per_block
        block_end = min(block_start + rows_per_block, full_shape[0])
        generator.manual_seed(block_seed(seed, name, block))
        values = torch.empty((block_end - block_start, *full_shape[1:]), dtype=torch.float32, device=local.device)
        sample(values, generator)
        lo, hi = max(block_start, first_row), min(block_end, end_row)
        local_view[lo - first_row : hi - first_row].copy_(values[(slice(lo - block_start, hi - block_start), *columns)])


class SeededInit:
    """Initializes a model's parameters by name, independently of how they are sharded.

    Built on the root module so every parameter is known by its fully-qualified name (names are
    the same under FSDP, TP, PP, activation checkpointing and compile, which all work in place).
    ``seed=None`` draws the seed from torch's global generator, so ``torch.manual_seed(s)``
    followed by ``model.init_weights()`` stays reproducible.
    """

    def __init__(self, root: nn.Module, seed: int | None = None) -> None:
        self.seed = int(torch.randint(0, 2**62, (), device="cpu")) if seed is None else seed
        # Holding the parameters too keeps their ids from being reused by other tensors.
        self._names = {id(p): (name, p) for name, p in root.named_parameters()}

    def name_of(self, param: torch.Tensor) -> str:
        """The parameter's name under the root module (raises for a foreign tensor)."""
        name, known = self._names.get(id(param), (None, None))
        if known is not param:
            raise ValueError("SeededInit got a tensor that is not a parameter of its root module")
        return name

    def normal_(self, param: torch.Tensor, std: float, mean: float = 0.0) -> None:
        """Normal(mean, std), in place."""
        fill_seeded_(param, lambda t, g: nn.init.normal_(t, mean, std, generator=g), seed=self.seed, name=self.name_of(param))

    def trunc_normal_(self, param: torch.Tensor, std: float) -> None:
        """Normal(0, std) truncated at 3 std, in place: avoids rare huge weights at init."""
        fill_seeded_(
            param,
            lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g),
            seed=self.seed,
            name=self.name_of(param),
        )

    @staticmethod
    @torch.no_grad()
    def ones_(param: torch.Tensor) -> None:
        """All ones (constants need no generator and are layout-independent already)."""
        param.fill_(1.0)
