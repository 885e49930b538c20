"""A save that dies half way never hides the previous step and is never loaded."""

import os
import signal
import subprocess
import sys
import time

import pytest
import titan.ckpt.manager as manager_mod
import torch
from ckpt_testlib import Run, tensors_equal
from titan.ckpt import CheckpointConfig, CheckpointError
from torch.distributed.checkpoint import FileSystemWriter

WORKER = os.path.join(os.path.dirname(__file__), "workers", "kill_mid_save.py")


class ExplodingWriter(FileSystemWriter):
    """Writes the data files, then fails before the checkpoint's metadata is written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        raise OSError("disk full (injected)")


def _cfg(**kw):
    return CheckpointConfig(enable=True, interval=1, last_save_model_only=False, **kw)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_failing_writer_keeps_previous_step(tmp_path, monkeypatch, async_mode):
    run = Run(_cfg(async_mode=async_mode), str(tmp_path))
    run.train(1)
    run.manager.wait()
    weights_at_1 = {k: v.clone() for k, v in run.model.state_dict().items()}

    monkeypatch.setattr(manager_mod, "_make_writer", lambda path: ExplodingWriter(path))
    with pytest.raises(Exception, match="disk full"):
        run.train(1)
        run.manager.wait()  # async: the failure surfaces here, in the training thread
    monkeypatch.undo()
    run.manager.close()

    folder = tmp_path / "checkpoint"
    assert (folder / "step-2.tmp").is_dir()  # the partial write is there...
    assert run.manager.steps() == [1]  # ...but not listed
    fresh = Run(_cfg(), str(tmp_path), seed=7)
    assert fresh.manager.load() == 1
    assert tensors_equal(fresh.model.state_dict(), weights_at_1)
    with pytest.raises(CheckpointError, match="step 2 .* half-written"):
        fresh.manager.load(step=2)

    # The next successful save of a later step publishes it and clears the leftover.
    fresh.train(2)
    fresh.manager.close()
    assert fresh.manager.steps() == [1, 2, 3]
    assert not (folder / "step-2.tmp").exists()


def test_sigkill_during_save_leaves_previous_step_loadable(tmp_path):
    sentinel = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path), str(sentinel)])
    try:
        deadline = time.monotonic() + 120
        while not sentinel.exists():
            assert proc.poll() is None, "worker exited before reaching the second save"
            assert time.monotonic() < deadline, "worker never started its second save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-save: data files written, nothing published
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = tmp_path / "checkpoint"
    assert (folder / "step-2.tmp").is_dir()
    assert any(name.endswith(".distcp") for name in os.listdir(folder / "step-2.tmp"))

    fresh = Run(_cfg(), str(tmp_path), seed=3)
    assert fresh.manager.steps() == [1]
    assert fresh.manager.load() == 1
    expected = torch.load(tmp_path / "weights_at_1.pt", weights_only=True)
    assert tensors_equal(fresh.model.state_dict(), expected)
    fresh.manager.close()
