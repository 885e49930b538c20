"""Resharding: a 2-rank FSDP checkpoint loads in one process and vice versa, optimizer included."""

import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_testlib import CountingLoader, TinyLM, lm_loss, make_optimizer, tensors_equal
from titan.ckpt import CheckpointConfig, CheckpointManager, OptimizerWrapper, TrainState, load_hf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

WORKER = os.path.join(os.path.dirname(__file__), "workers", "fsdp_worker.py")
STEPS, MORE = 3, 2
pytestmark = pytest.mark.slow


def _two_ranks(mode: str, dump, out, async_mode: str = "disabled") -> list[float]:
    """The worker on two gloo ranks, forked with torchrun's worker environment from the
    suite's preloaded server (tests/forked_cli.py)."""
    from launching import launch  # the repository's tests/ (root conftest.py)

    args = ["--mode", mode, "--dump", dump, "--out", out, "--steps", STEPS, "--more", MORE, "--async-mode", async_mode]
    launch(2, [WORKER, *map(str, args)], Path(out) / f"launch_{mode}.log", timeout=240, torchrun=False)
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


class OneProcess:
    """The same model, optimizer and data as the 2-rank run, in one process: the global batch
    is the two dp ranks' batches side by side."""

    def __init__(self, dump, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyLM(dropout=0.0)
        self.opt, self.sched = make_optimizer(self.model)
        self.loaders = [CountingLoader(seed=0, dp_rank=r) for r in range(2)]
        self.train_state = TrainState()
        self.manager = CheckpointManager(
            CheckpointConfig(enable=True, interval=STEPS, last_save_model_only=False),
            dump_folder=str(dump), model_parts=[self.model],
            optimizers=OptimizerWrapper(self.model, self.opt),
            states={"lr_scheduler": self.sched, "dataloader": self.loaders[0],
                    "train_state": self.train_state},
        )

    def step(self) -> float:
        loss = lm_loss(self.model, torch.cat([ld.next() for ld in self.loaders]))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.train_state.step += 1
        return loss.item()

    def full_state(self) -> dict:
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        state = {"model": get_model_state_dict(self.model),
                 "optim": get_optimizer_state_dict(self.model, self.opt, options=opts)}
        # Copies: the entries alias the live parameters and optimizer state.
        return {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
                for part, sd in state.items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert tensors_equal(a["model"], b["model"])
    assert a["optim"].keys() == b["optim"].keys()
    for key, value in a["optim"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["optim"][key]), key
        else:
            assert value == b["optim"][key], key


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_fsdp2_save_loads_in_one_process(tmp_path, async_mode):
    losses_2rank = _two_ranks("save", tmp_path, tmp_path, async_mode)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)

    one = OneProcess(tmp_path, seed=123)
    assert one.manager.load(step=STEPS) == STEPS
    _assert_same_state(ref, one.full_state())
    assert one.train_state.step == STEPS and one.loaders[0].pos == STEPS
    one.loaders[1].pos = STEPS  # dp rank 1's position lives under rank_1; restore by hand
    losses_1 = [one.step() for _ in range(MORE)]
    torch.testing.assert_close(losses_1, losses_2rank, rtol=1e-5, atol=1e-6)
    one.manager.close()

    # The last step was exported as Hugging Face safetensors, gathered from both ranks.
    exported = load_hf(str(tmp_path / "checkpoint" / f"step-{STEPS + MORE}"))
    assert tensors_equal(exported, ref["final_model"])


def test_one_process_save_loads_in_fsdp2(tmp_path):
    one = OneProcess(tmp_path, seed=0)
    for step in range(1, STEPS + 1):
        one.step()
        one.manager.maybe_save(step)
    ref = one.full_state()
    one.loaders[1].pos = STEPS
    losses_1 = [one.step() for _ in range(MORE)]
    one.manager.close()

    losses_2rank = _two_ranks("load", tmp_path, tmp_path)
    loaded = torch.load(tmp_path / "ref.pt", weights_only=True)
    _assert_same_state(ref, loaded)
    torch.testing.assert_close(losses_2rank, losses_1, rtol=1e-5, atol=1e-6)
