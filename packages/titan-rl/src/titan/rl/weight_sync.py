"""Moving the trainer's weights into a generator, with a policy version and a check.

Two modes:

* **Colocated** (`sync_colocated`): trainer and generator live in the same process. The
  trainer's `TrainingEngine.full_state_dict()` (collective over the trainer ranks: every rank
  must call this) yields full tensors one at a time; each goes straight into the generator's
  model by titan name, so the model is never held twice.
* **Disaggregated** (`WeightBroadcaster`): generator ranks and trainer ranks in one torchrun
  job. The first trainer rank broadcasts the full tensors over a dedicated process group (the
  first trainer rank + every generator rank; gloo on CPU, NCCL on GPU: the bridge of a job
  split by `titan.dist.split.split_job`, or a group made for it) in buckets of `bucket_mb`;
  the other trainer ranks take part in gathering the full tensors only.

After each sync the generator's whole `state_dict` is checked against the trainer's: a
checksum per tensor (`tensor_checksum`), computed on the tensors sent and on the tensors
loaded, and every state tensor of the generator (persistent buffers included) must have been
sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from titan.dist import Bridge

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(kw_only=True)
class SyncStats:
    """What one weight sync moved and how long it took."""

    version: int
    """Policy version now loaded in the generator."""
    seconds: float
    """Wall time of the sync, gathering and checking included."""
    tensors: int
    """Number of tensors moved."""
    bytes: int
    """Bytes moved (in the dtype sent)."""


class WeightMismatchError(RuntimeError):
    """The generator's weights differ from the trainer's after a sync."""


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW = 1024


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int, int]:
    """An exact, cheap fingerprint of a tensor's bits: the element bit patterns (as integers)
    summed, summed with column weights and summed with row weights over a [-1, 1024] grid.

    Integer sums are exact and independent of reduction order and thread count, so equal
    tensors give equal fingerprints in any process, and a changed or moved value changes
    them. Compare fingerprints of tensors of the same dtype.
    """
    flat = tensor.detach().reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])  # no copy; sums accumulate in int64
    n = bits.numel()
    whole = n - n % _ROW
    grid, tail = bits[:whole].view(-1, _ROW), bits[whole:].to(torch.int64)
    col_ramp = torch.arange(1, _ROW + 1, dtype=torch.int64, device=bits.device)
    row_ramp = torch.arange(1, grid.shape[0] + 1, dtype=torch.int64, device=bits.device)
    cols, rows = grid.sum(0, dtype=torch.int64), grid.sum(1, dtype=torch.int64)
    total = int(cols.sum() + tail.sum())
    by_col = int((cols * col_ramp).sum() + (tail * col_ramp[: tail.numel()]).sum())
    by_row = int((rows * row_ramp).sum()) + int(tail.sum()) * (grid.shape[0] + 1)
    return total, by_col, by_row


def _source_tensors(source: Any, dtype: torch.dtype | None) -> NamedTensors:
    """Named full tensors from a `TrainingEngine` (its `full_state_dict`) or an iterable."""
    if hasattr(source, "full_state_dict"):
        return source.full_state_dict(dtype=dtype)
    if dtype is None:
        return source
    return ((name, t.to(dtype)) for name, t in source)


def generator_checksums(generator: Any, names: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    """Checksums of the generator's weights `names` (in the dtype the generator holds them)."""
    weights = dict(generator.named_weights())
    return {name: tensor_checksum(weights[name]) for name in names if name in weights}


def _held_dtypes(generator: Any) -> dict[str, torch.dtype]:
    """The dtype the generator keeps each of its state tensors in (a bf16 generator still
    keeps float32 buffers such as an MoE router's balancing bias)."""
    return {name: t.dtype for name, t in generator.named_weights()}


def _check_loaded(generator: Any, expected: dict[str, tuple[int, int, int]]) -> None:
    """Raise WeightMismatchError naming the generator tensors whose checksums differ from
    `expected` (what was sent, in the generator's dtypes), and the generator's state tensors
    that were not sent at all — unless one shares its storage with a sent one (a tied alias
    such as `output.weight`)."""
    weights = dict(generator.named_weights())
    bad = [name for name, value in expected.items() if name not in weights or tensor_checksum(weights[name]) != value]
    if bad:
        raise WeightMismatchError(
            f"after weight sync {len(bad)} generator tensors differ from the trainer's: {bad[:5]}"
        )
    sent_storage = {weights[name].untyped_storage().data_ptr() for name in expected}
    unsent = [name for name, t in weights.items()
              if name not in expected and t.untyped_storage().data_ptr() not in sent_storage]
    if unsent:
        raise WeightMismatchError(
            f"weight sync did not cover {len(unsent)} of the generator's state tensors: {unsent[:5]}"
        )


def sync_colocated(
    source: Any, generator: Any, *, version: int, dtype: torch.dtype | None = None, verify: bool = True
) -> SyncStats:
    """Load the trainer's weights into an in-process generator and set its policy `version`.

    `source` is a `TrainingEngine` (every trainer rank must call this: gathering the full
    tensors is collective) or an iterable of (titan name, full tensor). `dtype` casts the
    tensors sent (None keeps the trainer's). With `verify`, checksums of the tensors sent are
    compared with those of the generator's weights afterwards (the generator must have
    `named_weights()`; tensors are compared in the generator's dtype). A rank without a
    generator passes None: it only takes part in the gathers.
    """
    start = time.perf_counter()
    if generator is None:
        count = sum(1 for _ in _source_tensors(source, dtype))
        return SyncStats(version=version, seconds=time.perf_counter() - start, tensors=count, bytes=0)
    sent: dict[str, tuple[int, int, int]] = {}
    count = nbytes = 0
    as_held = _held_dtypes(generator)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count, nbytes
        for name, tensor in _source_tensors(source, dtype):
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            if verify:
                sent[name] = tensor_checksum(tensor.to(as_held.get(name, tensor.dtype)))
            yield name, tensor

    generator.load_weights(stream(), version=version)
    if verify:
        _check_loaded(generator, sent)
    return SyncStats(version=version, seconds=time.perf_counter() - start, tensors=count, bytes=nbytes)


class WeightBroadcaster:
    """Disaggregated weight sync: trainer ranks send, generator ranks receive.

    Two ways to build it. In one job whose default group spans every rank, construct it on
    EVERY rank with the trainer and generator ranks (creating the dedicated group is
    collective). In a job split by `titan.dist.split.split_job` (trainer ranks in part 0,
    generator ranks in part 1), build it with :meth:`over_bridge` on every rank. Trainer ranks
    then call `send` (all of them, since gathering full tensors is collective over the
    trainer), generator ranks call `receive`. Per sync the source (the first trainer rank)
    broadcasts a header (version, then per bucket the names, shapes and dtype), the buckets as
    flat tensors, and finally the checksums of everything sent, which each generator rank
    compares with what it loaded; the outcome is reduced over the group so the trainer learns
    of a mismatch too.
    """

    def __init__(
        self,
        *,
        trainer_ranks: list[int],
        generator_ranks: list[int],
        bucket_mb: float = 64.0,
        backend: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if set(trainer_ranks) & set(generator_ranks):
            raise ValueError("trainer_ranks and generator_ranks must not overlap")
        if not trainer_ranks or not generator_ranks:
            raise ValueError("WeightBroadcaster needs at least one trainer rank and one generator rank")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        rank = dist.get_rank()
        members = [trainer_ranks[0], *generator_ranks]
        group = dist.new_group(members, backend=backend, timeout=timedelta(seconds=timeout_s))
        bridge = Bridge(group, rank=members.index(rank), size=len(members), device=device) if rank in members else None
        self._setup(bridge, is_trainer=rank in trainer_ranks, bucket_mb=bucket_mb)

    @classmethod
    def over_bridge(cls, bridge: Bridge | None, *, is_trainer: bool, bucket_mb: float = 64.0) -> WeightBroadcaster:
        """The broadcaster of a split job: ``bridge`` is `split_job`'s (None on the trainer
        ranks after the first), ``is_trainer`` whether this rank is in the training part."""
        self = cls.__new__(cls)
        self._setup(bridge, is_trainer=is_trainer, bucket_mb=bucket_mb)
        return self

    def _setup(self, bridge: Bridge | None, *, is_trainer: bool, bucket_mb: float) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not is_trainer and bridge is None:
            raise ValueError("a generator rank needs the bridge to the trainer")
        self.bridge, self._is_trainer = bridge, is_trainer
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = bridge.device if bridge is not None else torch.device("cpu")
        self.is_source = is_trainer and bridge is not None

    @property
    def is_trainer(self) -> bool:
        """Whether this rank is one of the trainer ranks."""
        return self._is_trainer

    def _broadcast_object(self, obj: Any = None) -> Any:
        return self.bridge.broadcast_object(obj, src=0)

    def _all_ok(self, ok: bool) -> bool:
        return self.bridge.all_true(ok)

    def send(self, source: Any, *, version: int, dtype: torch.dtype | None = None) -> SyncStats:
        """Trainer side: gather the full tensors of `source` (a `TrainingEngine` or an iterable
        of named full tensors, collective over the trainer ranks) and, on the first trainer
        rank, broadcast them in buckets. Raises WeightMismatchError when a generator rank
        loaded different weights."""
        start = time.perf_counter()
        if not self.is_source:
            count = sum(1 for _ in _source_tensors(source, dtype))  # take part in the gathers only
            return SyncStats(version=version, seconds=time.perf_counter() - start, tensors=count, bytes=0)
        self._broadcast_object({"version": version})
        sums: dict[str, tuple[int, int, int]] = {}
        count = nbytes = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in _source_tensors(source, dtype):
            if bucket and (size + tensor.numel() * tensor.element_size() > self.bucket_bytes
                           or tensor.dtype != bucket[0][1].dtype):
                self._send_bucket(bucket)
                bucket, size = [], 0
            tensor = tensor.detach().to(self.device)
            sums[name] = tensor_checksum(tensor)
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
        if bucket:
            self._send_bucket(bucket)
        self._broadcast_object({"done": True, "checksums": sums})
        if not self._all_ok(True):
            raise WeightMismatchError(f"a generator rank's weights differ from the trainer's after sync {version}")
        return SyncStats(version=version, seconds=time.perf_counter() - start, tensors=count, bytes=nbytes)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        meta = [(name, tuple(t.shape)) for name, t in bucket]
        self._broadcast_object({"bucket": meta, "dtype": bucket[0][1].dtype})
        flat = torch.cat([t.reshape(-1) for _, t in bucket])
        self.bridge.broadcast(flat, src=0)

    def receive(self, generator: Any) -> SyncStats:
        """Generator side: receive one sync into `generator` (`load_weights` with the sent
        version) and check it end to end: the received tensors against the trainer's
        checksums (transport), and the generator's weights against the received tensors cast
        to the generator's dtype (load). Raises WeightMismatchError on every rank of the
        group when any generator rank fails."""
        start = time.perf_counter()
        version = self._broadcast_object()["version"]
        final: dict[str, Any] = {}
        received: dict[str, tuple[int, int, int]] = {}
        as_loaded: dict[str, tuple[int, int, int]] = {}
        held = _held_dtypes(generator)
        stats = {"tensors": 0, "bytes": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            while True:
                header = self._broadcast_object()
                if header.get("done"):
                    final.update(header)
                    return
                numels = [torch.Size(shape).numel() for _, shape in header["bucket"]]
                flat = torch.empty(sum(numels), dtype=header["dtype"], device=self.device)
                self.bridge.broadcast(flat, src=0)
                stats["bytes"] += flat.numel() * flat.element_size()
                for (name, shape), piece in zip(header["bucket"], flat.split(numels), strict=True):
                    stats["tensors"] += 1
                    received[name] = tensor_checksum(piece)
                    as_loaded[name] = tensor_checksum(piece.to(held.get(name, piece.dtype)))
                    yield name, piece.view(shape)

        generator.load_weights(stream(), version=version)
        ok = all(received.get(name) == value for name, value in final["checksums"].items())  # transport
        try:
            _check_loaded(generator, as_loaded)  # load
        except WeightMismatchError:
            ok = False
        if not self._all_ok(ok):
            raise WeightMismatchError(f"generator weights differ from the trainer's after sync {version}")
        return SyncStats(version=version, seconds=time.perf_counter() - start, **stats)


__all__ = [
    "SyncStats",
    "WeightBroadcaster",
    "WeightMismatchError",
    "generator_checksums",
    "sync_colocated",
    "tensor_checksum",
]
