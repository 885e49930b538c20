"""Async saves return once the state is staged, never overlap, and are drained on close.

Every verdict here is decided by events, not by the clock: a writer whose ``write_data``
waits on a gate that only the test opens shows that a save call returned while its write
could not have finished, and a log of write starts and ends shows whether two saves
overlapped. How slow a loaded CI machine is decides nothing.
"""

import threading

import titan.ckpt.manager as manager_mod
import torch
import torch.nn as nn
from ckpt_testlib import Run, tensors_equal
from titan.ckpt import CheckpointConfig
from torch.distributed.checkpoint import FileSystemWriter

# A gate still shut after this long means the code under test waited for a write the test had
# not released (a save that blocks instead of writing in the background): recorded, and failed.
GATE_TIMEOUT_S = 120.0


class GatedWriters:
    """A `_make_writer` replacement. The n-th writer made (1-based) holds its write until
    `release(n)` when n is in `gated`; every writer logs ("start", n) and ("end", n)."""

    def __init__(self, gated: tuple[int, ...] = ()) -> None:
        self.gates = {n: threading.Event() for n in gated}
        self.log: list[tuple[str, int]] = []
        self.timed_out: list[int] = []
        self._made = 0

    def release(self, number: int) -> None:
        self.gates[number].set()

    def __call__(self, path: str) -> FileSystemWriter:
        self._made += 1
        number, owner = self._made, self

        class Writer(FileSystemWriter):
            def write_data(self, plan, planner):
                owner.log.append(("start", number))
                gate = owner.gates.get(number)
                if gate is not None and not gate.wait(GATE_TIMEOUT_S):
                    owner.timed_out.append(number)
                result = super().write_data(plan, planner)
                owner.log.append(("end", number))
                return result

        return Writer(path, single_file_per_rank=True, sync_files=True)


class Wide(nn.Module):
    """~4M parameters (16 MB, 48 MB with AdamW state): a large-ish state to stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(1024, 1024) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _trained_run(tmp_path, async_mode: str) -> Run:
    cfg = CheckpointConfig(enable=True, interval=1, async_mode=async_mode,
                           last_save_model_only=False)
    run = Run(cfg, str(tmp_path / async_mode), model=Wide())
    run.opt.zero_grad()
    run.model(torch.randn(2, 1024)).sum().backward()
    run.opt.step()  # materialize the optimizer state so that it is part of the save
    return run


def test_sync_save_returns_after_its_write_is_published(tmp_path, monkeypatch):
    writers = GatedWriters()
    monkeypatch.setattr(manager_mod, "_make_writer", writers)
    run = _trained_run(tmp_path, "disabled")
    run.manager.maybe_save(1)
    assert writers.log == [("start", 1), ("end", 1)]
    assert run.manager.steps() == [1]
    run.manager.close()


def test_async_save_does_not_block_and_is_drained(tmp_path, monkeypatch):
    writers = GatedWriters(gated=(1,))
    monkeypatch.setattr(manager_mod, "_make_writer", writers)
    run = _trained_run(tmp_path, "async")
    expected = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.manager.maybe_save(1)  # returns with the write held at the gate
    assert ("end", 1) not in writers.log
    assert run.manager.steps() == []  # not published before the write finished
    with torch.no_grad():  # training goes on while the write is in flight
        for p in run.model.parameters():
            p.add_(1.0)
    writers.release(1)
    run.manager.close()  # drains the write
    assert writers.timed_out == [], "maybe_save waited for the background write"
    assert writers.log == [("start", 1), ("end", 1)]
    assert run.manager.steps() == [1]
    # The step holds the weights as they were at the call, not the ones changed afterwards.
    fresh = Run(CheckpointConfig(enable=True), str(tmp_path / "async"), model=Wide())
    assert fresh.manager.load() == 1
    assert tensors_equal(fresh.model.state_dict(), expected)
    fresh.manager.close()


def test_async_saves_never_overlap(tmp_path, monkeypatch):
    writers = GatedWriters(gated=(1, 2))
    monkeypatch.setattr(manager_mod, "_make_writer", writers)
    cfg = CheckpointConfig(enable=True, interval=1, async_mode="async", keep_latest_k=0,
                           last_save_model_only=False)
    run = Run(cfg, str(tmp_path))
    run.train(1)  # step 1's write is held at its gate
    drain = run.manager.wait

    def wait_releasing_step_1():
        # Whoever waits for the save in flight lets its write finish, so a correct manager
        # proceeds; one that starts step 2's write without waiting logs it before step 1 ends.
        writers.release(1)
        drain()

    run.manager.wait = wait_releasing_step_1
    run.train(1)
    # Step 1 was written and published before step 2's write began (which it may not have
    # yet: the writer thread runs on its own) and step 2 is held at its gate.
    assert writers.log[:2] == [("start", 1), ("end", 1)] and ("end", 2) not in writers.log, writers.log
    assert run.manager.steps() == [1]
    writers.release(1)  # (already open unless step 2 skipped the wait: never hang)
    writers.release(2)
    run.manager.close()
    assert writers.log == [("start", 1), ("end", 1), ("start", 2), ("end", 2)], writers.log
    assert writers.timed_out == []
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
