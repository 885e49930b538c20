"""Batches reach the device without making the host wait for queued work."""

import pytest
import torch
from titan.train.device_copy import BatchCopier, needs_staging


def test_only_pageable_host_tensors_bound_for_cuda_are_staged():
    host = torch.zeros(4, dtype=torch.long)
    assert needs_staging(host, torch.device("cuda", 0))
    assert not needs_staging(host, torch.device("cpu"))
    assert not needs_staging(torch.empty(4, device="meta"), torch.device("cuda", 0))


def test_on_the_cpu_the_batch_passes_through_uncopied():
    batch = {"input_ids": torch.arange(6).view(2, 3), "labels": torch.arange(6).view(2, 3) + 1}
    moved = BatchCopier(torch.device("cpu"))(batch)
    assert list(moved) == list(batch)
    assert all(moved[k] is batch[k] for k in batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_pageable_tensors_go_through_pinned_memory_on_a_side_stream(monkeypatch):
    import titan.train.device_copy as device_copy

    staged = []
    real_pinned = device_copy.pinned
    monkeypatch.setattr(device_copy, "pinned", lambda t: staged.append(t) or real_pinned(t))
    device = torch.device("cuda", torch.cuda.current_device())
    batch = {"input_ids": torch.randint(0, 100, (4, 64)), "labels": torch.randint(0, 100, (4, 64)).pin_memory()}
    torch.cuda._sleep(10**8)  # queued work a blocking copy would wait for
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = BatchCopier(device)(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t is batch["input_ids"] for t in staged] == [True]  # the pinned one is copied as it is
    for k in batch:
        assert moved[k].device == device and torch.equal(moved[k].cpu(), batch[k])
