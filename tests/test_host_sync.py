"""Steps that neither log nor save never make the host wait for the device, train exactly as
steps that do, and a NaN among them is still caught within one logging interval.

A host read of a device value (``float(t)``, ``t.item()``, ``int(t)``, ``bool(t)``) always
dispatches ``aten._local_scalar_dense``; counting those calls from titan's own code measures
the syncs on any device, CPU included. (torch's AdamW reads its step counter this way, but
that counter lives on the host, also on GPUs, so it is not a device sync.)
"""

import collections
import time
import traceback

import pytest
import torch
from titan.train.loss import NonFiniteLossError
from titan.train.trainer import Trainer
from torch.utils._python_dispatch import TorchDispatchMode

from titan.recipes.cli import parse_train_args
from titan.recipes.families import model_spec

TINY = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2"]


def _trainer(tmp_path, *flags: str) -> Trainer:
    config = parse_train_args([*TINY, "--job.dump_folder", str(tmp_path), *flags])
    return Trainer(config, model_spec=model_spec("llama3"))


class _HostReads(TorchDispatchMode):
    """Counts host reads of tensor values made by titan code, by call site."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()
            if not any("torch/optim" in frame.filename for frame in stack):
                titan = [f for f in stack if "/titan/" in f.filename and "/torch/" not in f.filename]
                self.sites[f"{titan[-1].name}:{titan[-1].lineno}" if titan else "?"] += 1
        return func(*args, **(kwargs or {}))


def _count_reads_per_step(trainer: Trainer) -> list[collections.Counter]:
    per_step = []
    train_step = trainer.train_step

    def counted(microbatches, **kwargs):
        with _HostReads() as reads:
            result = train_step(microbatches, **kwargs)
        per_step.append(reads.sites)
        return result

    trainer.train_step = counted
    trainer.train()
    return per_step


def test_steps_that_do_not_log_never_read_the_device(tmp_path):
    per_step = _count_reads_per_step(_trainer(tmp_path, "--training.steps", "6", "--metrics.log_freq", "5"))
    assert len(per_step) == 6
    # Steps 1, 5 and 6 log (the first, every 5th, the last): they read the loss and the norm.
    for step in (1, 5, 6):
        assert sum(per_step[step - 1].values()) >= 2, (step, per_step[step - 1])
    for step in (2, 3, 4):
        assert per_step[step - 1] == {}, (step, per_step[step - 1])


def _final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}


def test_unsynced_steps_train_exactly_like_synced_ones(tmp_path):
    every = _trainer(tmp_path / "every", "--training.steps", "10", "--metrics.log_freq", "1")
    records_every = {r["step"]: r for r in every.train()}
    sparse = _trainer(tmp_path / "sparse", "--training.steps", "10", "--metrics.log_freq", "5")
    records_sparse = sparse.train()
    assert [r["step"] for r in records_sparse] == [1, 5, 10]
    for record in records_sparse:  # the same computation, bit for bit
        for key in ("loss", "grad_norm", "tokens_seen"):
            assert record[key] == records_every[record["step"]][key], (record["step"], key)
    assert every.train_state.tokens_seen == sparse.train_state.tokens_seen > 0
    for name, value in _final_state(every).items():
        assert torch.equal(value, _final_state(sparse)[name]), name


def _poison_step(trainer: Trainer, step: int) -> None:
    """Make the forward of optimizer step ``step`` produce NaN logits."""
    model = trainer.model_parts[0]

    def hook(_module, _args, output):
        return output * float("nan") if trainer.step == step - 1 else output

    model.output.register_forward_hook(hook)


def test_a_nan_on_an_unsynced_step_is_caught_at_the_next_logging_step(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "10", "--metrics.log_freq", "5")
    _poison_step(trainer, 3)
    with pytest.raises(NonFiniteLossError, match=r"step 3: non-finite grad norm \(read after step 4"):
        trainer.train()


def test_no_checkpoint_is_written_after_an_unsynced_nan(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "10", "--metrics.log_freq", "5",
                       "--checkpoint.enable", "--checkpoint.interval", "4")
    _poison_step(trainer, 3)
    with pytest.raises(NonFiniteLossError, match=r"step 3: non-finite grad norm \(read after step 3"):
        trainer.train()
    assert trainer.engine.checkpointer.steps() == []


def test_a_nan_on_a_logging_step_stops_before_the_optimizer_step(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "10", "--metrics.log_freq", "5")
    _poison_step(trainer, 5)
    with pytest.raises(NonFiniteLossError, match="step 5: loss nan"):
        trainer.train()
    assert trainer.step == 4  # the weights were never updated with it


def test_the_trainer_measures_its_data_wait(tmp_path):
    """A loader that sleeps shows in every record's data wait (a real measurement)."""
    trainer = _trainer(tmp_path, "--training.steps", "2", "--metrics.log_freq", "1")
    batches = iter(trainer.dataloader)

    class SlowLoader:
        def __iter__(self):
            return self

        def __next__(self):
            time.sleep(0.2)
            return next(batches)

    trainer.dataloader = SlowLoader()
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["data_wait_s"] >= 0.2 and 0 < r["data_wait_pct"] <= 100 for r in records), records


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unsynced_steps_make_no_synchronizing_cuda_call(tmp_path):
    """On a GPU the steps that do not log issue no call torch knows to block the host (a
    blocking host-to-device copy such as a host token count moved over, ``.item()``,
    a stream synchronize); the batch itself travels from pinned memory."""
    trainer = _trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "4")
    train_step = trainer.train_step

    def strict(microbatches, *, sync):
        if sync:
            return train_step(microbatches, sync=sync)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train_step(microbatches, sync=sync)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    trainer.train_step = strict
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 4]
