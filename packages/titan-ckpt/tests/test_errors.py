"""Mistakes a user can make get a message naming the problem and the fix."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_testlib import Run, TinyLM
from titan.ckpt import CheckpointConfig, CheckpointError, CheckpointManager


def _cfg(**kw):
    kw.setdefault("enable", True)
    return CheckpointConfig(interval=1, last_save_model_only=False, **kw)


@pytest.fixture
def saved(tmp_path):
    """A folder with complete steps 1 and 2 of TinyLM(dim=32, 2 layers)."""
    run = Run(_cfg(), str(tmp_path))
    run.train(2)
    run.manager.close()
    return tmp_path


def test_step_not_found_lists_available(saved):
    run = Run(_cfg(), str(saved))
    with pytest.raises(CheckpointError, match=r"load_step 7: no such step .* \[1, 2\]"):
        run.manager.load(step=7)
    run.manager.close()


def test_missing_key_names_key_and_hints_model_size(saved):
    run = Run(_cfg(), str(saved), model=TinyLM(n_layers=3))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\..*another model family or size"):
        run.manager.load()
    run.manager.close()


def test_shape_mismatch_names_key_and_both_shapes(saved):
    run = Run(_cfg(), str(saved), model=TinyLM(dim=48))
    with pytest.raises(CheckpointError) as info:
        run.manager.load()
    message = str(info.value)
    assert "'model.layers.0.down.bias' has shape [32]" in message
    assert "but [48] in this run" in message and "model family or size" in message
    run.manager.close()


def test_initial_load_path_that_is_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    run = Run(_cfg(initial_load_path=str(junk)), str(tmp_path))
    with pytest.raises(CheckpointError, match="not a DCP checkpoint .*initial_load_in_hf"):
        run.manager.load()
    run.manager.close()

    run = Run(_cfg(initial_load_path=str(junk), initial_load_in_hf=True), str(tmp_path),
              hf_adapter=object())
    with pytest.raises(CheckpointError, match="not a Hugging Face checkpoint"):
        run.manager.load()
    run.manager.close()

    run = Run(_cfg(initial_load_path=str(tmp_path / "nope")), str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        run.manager.load()
    run.manager.close()


def test_a_hugging_face_folder_of_pytorch_pickles_is_refused_with_the_conversion(tmp_path):
    folder = tmp_path / "old_hub_model"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    run = Run(_cfg(initial_load_path=str(folder), initial_load_in_hf=True), str(tmp_path), hf_adapter=object())
    with pytest.raises(CheckpointError, match=r"PyTorch pickles \(pytorch_model.bin\).*save_pretrained"):
        run.manager.load()
    run.manager.close()


def test_checkpoint_folder_that_is_a_file(tmp_path):
    (tmp_path / "checkpoint").write_text("")
    run = Run(_cfg(), str(tmp_path))
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        run.manager.load()
    run.manager.close()


def test_half_written_step_asked_for_explicitly(saved):
    os.rename(saved / "checkpoint" / "step-2", saved / "checkpoint" / "step-2.tmp")
    run = Run(_cfg(), str(saved))
    with pytest.raises(CheckpointError, match=r"step 2 .* half-written.*Complete steps: \[1\]"):
        run.manager.load(step=2)
    assert run.manager.load() == 1  # latest complete step, the partial one ignored
    run.manager.close()


def test_unknown_state_in_exclude_from_loading(saved):
    run = Run(_cfg(exclude_from_loading=["data_loader"]), str(saved))
    with pytest.raises(CheckpointError, match=r"unknown states \['data_loader'\]"):
        run.manager.load()
    run.manager.close()


class Plain:
    """A state of plain data whose layout a test chooses."""

    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


@pytest.mark.parametrize(
    ("saved_state", "wanted_state", "keys"),
    [
        # A format change: an older release kept one entry per data-parallel rank.
        (
            {"dp_rank_0": {"epoch": 1}},
            {"cursor": 0, "epoch": 0},
            "saved keys ['dp_rank_0'], expected ['cursor', 'epoch']",
        ),
        # Only a nested part changed: the keys are shown at the depth where they differ.
        (
            {"cursor": 1, "epoch": {"n": 1}},
            {"cursor": 0, "epoch": {"m": 0, "n": 0}},
            "saved keys ['cursor', 'epoch.n'], expected ['cursor', 'epoch.m', 'epoch.n']",
        ),
    ],
)
def test_state_with_other_entries_names_both_key_sets_and_the_fix(
    tmp_path, saved_state, wanted_state, keys
):
    def manager(state, **kw):
        return CheckpointManager(_cfg(**kw), dump_folder=str(tmp_path),
                                 states={"loader": Plain(state)}, model_parts=[TinyLM()])

    saver = manager(saved_state)
    saver.maybe_save(1)
    saver.close()
    mgr = manager(wanted_state)
    with pytest.raises(CheckpointError) as info:
        mgr.load()
    message = str(info.value)
    assert "saved entries of state 'loader' do not match what this run's 'loader' expects" in message
    assert keys in message
    assert "a different parallel layout, or in an older format of 'loader'" in message
    assert "--checkpoint.exclude_from_loading loader" in message
    mgr.close()
    # The fix the message names works: the rest of the step loads, the state starts fresh.
    mgr = manager(wanted_state, exclude_from_loading=["loader"])
    assert mgr.load() == 1
    assert mgr.states["loader"].state == wanted_state
    mgr.close()


class Evil:
    """Pickles to a call of os.system: must never run on load."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


class Holder:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self):
        return {"obj": self.value}

    def load_state_dict(self, state):
        self.value = state["obj"]


def test_pickled_objects_are_refused_on_load(tmp_path):
    cfg = _cfg()
    mgr = CheckpointManager(cfg, dump_folder=str(tmp_path), states={"holder": Holder(Evil())},
                            model_parts=[TinyLM()])
    mgr.maybe_save(1)
    mgr.close()
    mgr = CheckpointManager(cfg, dump_folder=str(tmp_path), states={"holder": Holder(0)},
                            model_parts=[TinyLM()])
    with pytest.raises(CheckpointError, match="holder.obj' is not plain data"):
        mgr.load()
    mgr.close()


def test_seed_checkpoint_refuses_a_used_folder(saved):
    run = Run(_cfg(), str(saved))
    with pytest.raises(CheckpointError, match="already holds steps"):
        run.manager.save_seed_checkpoint()
    run.manager.close()


def test_reserved_state_names(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        CheckpointManager(_cfg(), dump_folder=str(tmp_path), states={"model": torch.nn.Linear(1, 1)},
                          model_parts=[TinyLM()])


def _torchtitan_style_step(folder, step):
    """A step folder as torchtitan publishes it: DCP files, its model's weights at the top
    level, and no titan manifest."""
    path = folder / f"step-{step}"
    model = TinyLM()
    dcp.save(
        {**model.state_dict(), "train_state": {"step": step}}, checkpoint_id=str(path), no_dist=True
    )
    return path


def test_a_checkpoint_folder_holding_another_trainers_steps_is_refused_and_left_intact(tmp_path):
    folder = tmp_path / "checkpoint"
    foreign = _torchtitan_style_step(folder, 10)
    before = sorted(os.listdir(foreign))
    run = Run(_cfg(), str(tmp_path))
    with pytest.raises(CheckpointError) as info:
        run.manager.load()
    message = str(info.value)
    assert "step-10" in message and "torchtitan" in message
    assert f"--checkpoint.initial_load_path {foreign}" in message
    run.manager.close()
    assert sorted(os.listdir(foreign)) == before  # nothing deleted or replaced


def test_a_save_never_replaces_a_step_folder_titan_did_not_write(tmp_path):
    run = Run(_cfg(), str(tmp_path))
    run.manager.load()  # an empty folder: nothing to refuse yet
    foreign = _torchtitan_style_step(tmp_path / "checkpoint", 1)  # appears during the run
    before = sorted(os.listdir(foreign))
    with pytest.raises(CheckpointError, match="titan did not write it"):
        run.train(1)
    assert sorted(os.listdir(foreign)) == before
    run.manager.close()


def test_a_state_the_writing_run_kept_empty_is_named_as_unused_not_as_another_layout(tmp_path):
    """An RL run without a KL reference saves an empty 'rl_reference'; resumed with the penalty
    on, the error said "probably written under a different parallel layout, or in an older
    format". It now says the writing run did not use the state, and names both ways on."""

    def manager(state, **kw):
        return CheckpointManager(_cfg(**kw), dump_folder=str(tmp_path),
                                 states={"reference": Plain(state)}, model_parts=[TinyLM()])

    saver = manager({})
    saver.maybe_save(1)
    saver.close()
    mgr = manager({"taken": 0, "weights": {"w": 1}})
    with pytest.raises(CheckpointError) as info:
        mgr.load()
    mgr.close()
    message = str(info.value)
    assert "holds nothing of state 'reference': the run that wrote it did not use it" in message
    assert "Resume with the flags that wrote it, or pass --checkpoint.exclude_from_loading reference" in message
    assert "parallel layout" not in message
