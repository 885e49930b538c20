"""Host-to-device copies of training batches that never make the host wait for the device.

A CUDA copy from pageable host memory makes the host wait until every kernel already queued
on the stream has finished, whatever ``non_blocking`` says: one such copy per step (the
batch, or a token count made on the host) undoes the loop's running ahead of the device.
:class:`BatchCopier` stages host tensors in pinned memory and copies them on a stream of
its own, so the next batch travels while the previous step's kernels still run, and the
compute stream waits for the copy only where it uses the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def needs_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` must go through pinned memory to reach ``device`` without a host
    wait: a pageable host tensor bound for a CUDA device."""
    return device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned()


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked host memory. torch's caching host allocator keeps the block
    until every copy recorded from it has finished, so it may be dropped right after the
    copy is queued."""
    return tensor.pin_memory()


class BatchCopier:
    """Moves a batch (a mapping of tensors) to the training device.

    On CUDA: host tensors are staged in pinned memory and copied with ``non_blocking`` on a
    side stream; the current (compute) stream waits for that stream before anything queued
    after the call, and each copy is recorded as used by the compute stream so the caching
    allocator does not hand its memory to the side stream while kernels still read it.
    Elsewhere (CPU, and tensors already on the device): ``Tensor.to``, which returns the
    tensor itself when it is already there.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with every tensor on the device (the same keys)."""
        if self._stream is None:
            return {k: v.to(self.device) for k, v in batch.items()}
        moved = dict(batch)
        away = {k: v for k, v in batch.items() if v.device != self.device}
        if not away:
            return moved
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            for k, v in away.items():
                source = pinned(v) if needs_staging(v, self.device) else v
                moved[k] = source.to(self.device, non_blocking=True)
                moved[k].record_stream(compute)
        compute.wait_stream(self._stream)
        return moved
