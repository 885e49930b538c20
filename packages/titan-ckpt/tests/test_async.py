"""Async saves return once the state is staged, never overlap, and are drained on close."""

import time

import titan.ckpt.manager as manager_mod
import torch
import torch.nn as nn
from ckpt_testlib import Run, tensors_equal
from titan.ckpt import CheckpointConfig
from torch.distributed.checkpoint import FileSystemWriter

WRITE_DELAY_S = 1.0


class SlowWriter(FileSystemWriter):
    """A writer on slow storage: each write takes WRITE_DELAY_S more."""

    def write_data(self, plan, planner):
        time.sleep(WRITE_DELAY_S)
        return super().write_data(plan, planner)


class Wide(nn.Module):
    """~4M parameters (16 MB, 48 MB with AdamW state): a large-ish state to stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(1024, 1024) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _timed_save(tmp_path, async_mode: str) -> tuple[float, Run]:
    cfg = CheckpointConfig(enable=True, interval=1, async_mode=async_mode,
                           last_save_model_only=False)
    run = Run(cfg, str(tmp_path / async_mode), model=Wide())
    run.opt.zero_grad()
    run.model(torch.randn(2, 1024)).sum().backward()
    run.opt.step()  # materialize the optimizer state so that it is part of the save
    start = time.perf_counter()
    run.manager.maybe_save(1)
    return time.perf_counter() - start, run


def test_async_save_does_not_block_and_is_drained(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod, "_make_writer", SlowWriter)
    sync_s, sync_run = _timed_save(tmp_path, "disabled")
    async_s, async_run = _timed_save(tmp_path, "async")
    expected = {k: v.clone() for k, v in async_run.model.state_dict().items()}
    with torch.no_grad():  # training goes on while the write is in flight
        for p in async_run.model.parameters():
            p.add_(1.0)
    assert async_run.manager.steps() == []  # not published before the write finished
    async_run.manager.close()
    sync_run.manager.close()

    print(f"sync save {sync_s:.3f}s, async save call {async_s:.3f}s")
    assert sync_s >= WRITE_DELAY_S
    assert async_s * 3 < sync_s, (async_s, sync_s)
    assert async_run.manager.steps() == [1]
    # The step holds the weights as they were at the call, not the ones changed afterwards.
    fresh = Run(CheckpointConfig(enable=True), str(tmp_path / "async"), model=Wide())
    assert fresh.manager.load() == 1
    assert tensors_equal(fresh.model.state_dict(), expected)
    fresh.manager.close()


def test_async_saves_never_overlap(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod, "_make_writer", SlowWriter)
    cfg = CheckpointConfig(enable=True, interval=1, async_mode="async", keep_latest_k=0,
                           last_save_model_only=False)
    run = Run(cfg, str(tmp_path))
    run.train(1)
    start = time.perf_counter()
    run.train(1)  # must first wait for step 1's write to finish
    assert time.perf_counter() - start >= 0.5 * WRITE_DELAY_S
    assert run.manager.steps() == [1]
    run.manager.close()
    assert run.manager.steps() == [1, 2]


def test_pinned_mode_falls_back_on_cpu(tmp_path):
    cfg = CheckpointConfig(enable=True, interval=1, async_mode="async_with_pinned_mem",
                           last_save_model_only=False)
    run = Run(cfg, str(tmp_path))
    run.train(3)
    run.manager.close()
    fresh = Run(CheckpointConfig(enable=True), str(tmp_path), seed=5)
    assert fresh.manager.load() == 3
    assert tensors_equal(fresh.model.state_dict(), run.model.state_dict())
    fresh.manager.close()
