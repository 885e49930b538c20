"""Single-process save/load: every state comes back, and a resumed run continues bitwise."""

import os
import random

import numpy as np
import pytest
import torch
from ckpt_testlib import Run, TinyLM, tensors_equal
from titan.ckpt import CheckpointConfig, CheckpointError, CheckpointManager


def _cfg(**kw) -> CheckpointConfig:
    kw.setdefault("enable", True)
    kw.setdefault("interval", 2)
    kw.setdefault("last_save_model_only", False)
    return CheckpointConfig(**kw)


class Custom:
    """A user state with nested values of several kinds."""

    def __init__(self) -> None:
        self.value = {"count": 0, "name": "x", "hist": [0.0], "t": torch.zeros(3)}

    def state_dict(self) -> dict:
        return self.value

    def load_state_dict(self, state: dict) -> None:
        self.value = state


def test_round_trip_restores_every_state(tmp_path):
    cfg = _cfg()
    a = Run(cfg, str(tmp_path))
    a.train(4)
    custom = Custom()
    custom.value = {"count": 7, "name": "seven", "hist": [1.5, 2.5], "t": torch.arange(3.0)}
    mgr = CheckpointManager(cfg, dump_folder=str(tmp_path), states={"custom": custom},
                            model_parts=[a.model])
    random.seed(123)
    np.random.seed(456)
    torch.manual_seed(789)
    mgr.maybe_save(6)
    expected_rng = (random.random(), np.random.rand(), torch.rand(1))
    mgr.close()

    b = Run(cfg, str(tmp_path), seed=1)
    assert b.manager.load(step=4) == 4
    assert tensors_equal(a.model.state_dict(), b.model.state_dict())
    assert str(a.opt.state_dict()) == str(b.opt.state_dict())
    assert a.sched.state_dict() == b.sched.state_dict()
    assert (b.loader.pos, b.train_state.step, b.train_state.tokens_seen) == (4, 4, a.train_state.tokens_seen)

    restored = Custom()
    mgr2 = CheckpointManager(cfg, dump_folder=str(tmp_path), states={"custom": restored},
                             model_parts=[TinyLM()])
    random.seed(0)
    assert mgr2.load() == 6
    assert restored.value["count"] == 7 and restored.value["name"] == "seven"
    assert restored.value["hist"] == [1.5, 2.5] and torch.equal(restored.value["t"], torch.arange(3.0))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_rng
    a.manager.close(), b.manager.close(), mgr2.close()


def test_resume_is_bitwise_equal(tmp_path):
    cfg = _cfg(interval=3)
    uninterrupted = Run(cfg, str(tmp_path / "a"))
    losses = uninterrupted.train(7)
    uninterrupted.manager.close()

    # A "crashed" run: it saved step 3 and 6; the resumed one starts from 6 with a fresh
    # process state (other seeds everywhere) and must reproduce step 7 exactly.
    resumed = Run(cfg, str(tmp_path / "a"), seed=99)
    torch.manual_seed(1234)
    assert resumed.manager.load() == 6
    assert resumed.train(1, save=False) == losses[6:]

    resumed3 = Run(cfg, str(tmp_path / "a"), seed=5)
    assert resumed3.manager.load(step=3) == 3
    assert resumed3.train(4, save=False) == losses[3:]
    resumed.manager.close(), resumed3.manager.close()


def test_retention_keeps_exactly_k(tmp_path):
    run = Run(_cfg(interval=1, keep_latest_k=3), str(tmp_path))
    run.train(7)
    run.manager.close()
    assert run.manager.steps() == [5, 6, 7]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-5", "step-6", "step-7"]


def test_retention_keeps_the_newest_step_a_run_can_continue_from(tmp_path):
    """keep_latest_k 1 with a weights-only last save (the default): the full step before it
    stays, so the run extended past its last step resumes from it instead of being refused."""
    cfg = _cfg(interval=2, keep_latest_k=1, last_save_model_only=True)
    run = Run(cfg, str(tmp_path))
    run.train(5, last=5)
    run.manager.close()
    assert run.manager.steps() == [4, 5]
    extended = Run(cfg, str(tmp_path), seed=3)
    assert extended.manager.load() == 4  # step 5 holds the weights only
    extended.train(2)  # steps 5 (again; off the interval) and 6: a full step, so the older ones go
    extended.manager.close()
    assert extended.manager.steps() == [6]


def test_a_finished_runs_weights_only_last_save_is_recognised_and_loaded(tmp_path):
    """The folder holds the run's target step as its weights-only last save: the same run
    launched again is finished, with those weights loaded. A full last step, another target,
    or a pinned load step: not (nothing is loaded)."""
    cfg = _cfg(interval=2, last_save_model_only=True)
    run = Run(cfg, str(tmp_path))
    run.train(5, last=5)
    run.manager.close()
    again = Run(cfg, str(tmp_path), seed=3)
    assert again.manager.load_finished_run(7) is None and again.manager.load_finished_run(4) is None
    assert not tensors_equal(run.model.state_dict(), again.model.state_dict())
    assert again.manager.load_finished_run(5) == 5
    assert tensors_equal(run.model.state_dict(), again.model.state_dict())
    again.manager.close()
    assert Run(_cfg(interval=2, load_step=4), str(tmp_path)).manager.load_finished_run(5) is None
    full = Run(_cfg(interval=2), str(tmp_path / "full"))
    full.train(4, last=4)
    full.manager.close()
    assert full.manager.load_finished_run(4) is None  # resumes (and trains nothing) as before


def test_resaving_an_existing_step_replaces_it(tmp_path):
    first = Run(_cfg(interval=2), str(tmp_path))
    first.train(4)
    first.manager.close()
    # Its step counter left out of loading, the next run counts from 0 again and saves steps
    # 2 and 4 over the first run's.
    again = Run(_cfg(interval=2, exclude_from_loading=["train_state"]), str(tmp_path), seed=8)
    assert again.manager.load() == 4
    assert again.train_state.step == 0
    again.train(4)
    again.manager.close()
    assert again.manager.steps() == [2, 4]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]
    check = Run(_cfg(), str(tmp_path), seed=9)
    assert check.manager.load() == 4
    assert tensors_equal(check.model.state_dict(), again.model.state_dict())
    check.manager.close()


def test_retention_zero_keeps_all_and_async_drains(tmp_path):
    run = Run(_cfg(interval=1, keep_latest_k=0, async_mode="async"), str(tmp_path))
    run.train(4)
    run.manager.close()
    assert run.manager.steps() == [1, 2, 3, 4]


def test_last_save_model_only_casts_and_loads(tmp_path):
    cfg = _cfg(last_save_model_only=True, export_dtype="bfloat16")
    run = Run(cfg, str(tmp_path))
    run.train(3, last=3)
    run.manager.close()
    # Its weights start a new run (another folder): counters fresh.
    fresh = Run(_cfg(initial_load_path=str(tmp_path / "checkpoint" / "step-3")), str(tmp_path / "next"), seed=3)
    assert fresh.manager.load() == 0
    for key, value in run.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[key], value.to(torch.bfloat16).float()), key
    assert fresh.train_state.step == 0  # model only: counters start fresh
    fresh.manager.close()


def test_a_run_extended_past_its_weights_only_last_save_continues_from_the_newest_full_step(tmp_path):
    """A finished run's last save holds the weights only: run longer, it continues from the
    step before (redoing the steps between), not from step 1 over its own checkpoints."""
    cfg = _cfg(interval=2, last_save_model_only=True)
    run = Run(cfg, str(tmp_path))
    run.train(5, last=5)  # full steps 2 and 4, weights-only step 5
    run.manager.close()
    extended = Run(cfg, str(tmp_path), seed=3)
    assert extended.manager.load() == 4
    assert extended.train_state.step == 4
    extended.manager.close()
    with pytest.raises(CheckpointError, match=r"step 5 .* holds only model weights.*initial_load_path"):
        Run(_cfg(load_step=5), str(tmp_path), seed=3).manager.load()


def test_a_folder_whose_only_step_holds_weights_only_is_not_resumed_from_step_1(tmp_path):
    cfg = _cfg(interval=10, last_save_model_only=True)
    run = Run(cfg, str(tmp_path))
    run.train(3, last=3)
    run.manager.close()
    again = Run(cfg, str(tmp_path), seed=3)
    with pytest.raises(CheckpointError, match=r"step 3 .* holds only model weights.*--checkpoint.initial_load_path \S+step-3"):
        again.manager.load()
    again.manager.close()


def test_exclude_from_loading_keeps_fresh_state(tmp_path):
    run = Run(_cfg(), str(tmp_path))
    run.train(2)
    run.manager.close()
    fresh = Run(_cfg(exclude_from_loading=["dataloader", "train_state"]), str(tmp_path), seed=4)
    assert fresh.manager.load() == 2
    assert fresh.loader.pos == 0 and fresh.train_state.step == 0
    assert tensors_equal(run.model.state_dict(), fresh.model.state_dict())
    fresh.manager.close()


def test_seed_checkpoint_then_initial_load(tmp_path, caplog):
    seed = Run(_cfg(create_seed_checkpoint=True), str(tmp_path / "seed"), seed=11)
    path = seed.manager.save_seed_checkpoint()
    seed.manager.close()
    assert os.path.basename(path) == "step-0"

    # A new run whose own folder is empty warm-starts from the seed folder.
    cfg = _cfg(initial_load_path=str(tmp_path / "seed" / "checkpoint"))
    run = Run(cfg, str(tmp_path / "run"), seed=12)
    assert run.manager.load() == 0
    assert tensors_equal(seed.model.state_dict(), run.model.state_dict())
    run.train(2)
    run.manager.close()
    # Launched again, it resumes from its own step 2 and says the initial load is not read.
    again = Run(cfg, str(tmp_path / "run"), seed=13)
    with caplog.at_level("INFO", logger="titan"):
        assert again.manager.load() == 2
    again.manager.close()
    assert "--checkpoint.initial_load_path" in caplog.text and "resumes from its own step 2" in caplog.text


def test_nothing_to_load_returns_none(tmp_path):
    run = Run(_cfg(), str(tmp_path))
    assert run.manager.load() is None
    run.manager.close()


def test_disabled_manager_neither_saves_nor_resumes(tmp_path):
    run = Run(CheckpointConfig(enable=False), str(tmp_path))
    run.train(3)
    assert not (tmp_path / "checkpoint").exists()
    assert run.manager.load() is None
    run.manager.close()


def test_going_back_to_an_earlier_step_sets_the_later_ones_aside(tmp_path):
    """`load_step 2` of steps 2, 4, 6: the run continues from 2, and 4 and 6 (the abandoned
    continuation) move to discarded-*/, so a later resume finds this continuation's newest
    step, not step 6, and retention does not count them; nothing is deleted."""
    run = Run(_cfg(interval=2, keep_latest_k=0), str(tmp_path))
    run.train(6)
    run.manager.close()
    back = Run(_cfg(interval=2, keep_latest_k=0, load_step=2), str(tmp_path), seed=3)
    assert back.manager.load() == 2
    assert back.manager.steps() == [2, 4, 6]  # loading alone moves nothing
    back.train_state.step = 2
    back.train(2)  # saves step 4: the continuation's first save
    back.manager.close()
    assert back.manager.steps() == [2, 4]
    folder = tmp_path / "checkpoint"
    (aside,) = [p for p in folder.iterdir() if p.name.startswith("discarded-")]
    assert sorted(p.name for p in aside.iterdir()) == ["step-4", "step-6"]
    assert (aside / "step-6" / "titan_checkpoint.json").is_file()
    latest = Run(_cfg(interval=2), str(tmp_path), seed=4)
    assert latest.manager.load() == 4  # this continuation's, not the abandoned step 6
    assert tensors_equal(latest.model.state_dict(), back.model.state_dict())
    latest.manager.close()


def test_an_optimizer_saved_before_its_first_step_stays_fresh(tmp_path):
    """torch fills an empty optimizer's state by stepping it on zero gradients, which left
    AdamW's step counters at 1: a run that saved before its first update (an RL critic during
    the SFT warm-up, a run preempted at step 0) then bias-corrected its first update as the
    second. Saving leaves the optimizer fresh, the checkpoint holds step 0, and training after
    a save, or after loading that save, equals training that never saved, bit for bit."""
    from titan.ckpt import OptimizerWrapper

    def trained(model, opt):
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            model(torch.randint(0, 32, (2, 8), generator=gen)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()

    def fresh():
        torch.manual_seed(0)
        model = TinyLM()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    untouched = trained(*fresh())
    model, opt = fresh()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in OptimizerWrapper(model, opt).state_dict().items()}
    assert not opt.state
    steps = {k: float(v) for k, v in saved.items() if k.endswith(".step")}
    assert steps and set(steps.values()) == {0.0}
    assert tensors_equal(trained(model, opt), untouched)
    loaded_model, loaded_opt = fresh()
    OptimizerWrapper(loaded_model, loaded_opt).load_state_dict(saved)
    assert tensors_equal(trained(loaded_model, loaded_opt), untouched)


def test_a_resumed_optimizer_keeps_this_runs_hyperparameters_and_the_saved_moments(caplog):
    """torch's load takes the saving run's weight decay, betas, eps and kernel choice, so a
    run resumed with other flags silently kept the old ones. The moments and step counts come
    from the checkpoint, the LR with the scheduler's position, the rest is this run's; the
    difference is logged. A resume with the same hyperparameters logs nothing."""
    from titan.ckpt import OptimizerWrapper

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    model(torch.randint(0, 32, (2, 8))).float().square().mean().backward()
    opt.step()
    saved = OptimizerWrapper(model, opt).state_dict()
    other = TinyLM()
    resumed = torch.optim.AdamW(other.parameters(), lr=5e-3, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6,
                                foreach=True)
    with caplog.at_level("WARNING", logger="titan"):
        OptimizerWrapper(other, resumed).load_state_dict(saved)
    group = resumed.param_groups[0]
    assert (group["weight_decay"], group["betas"], group["eps"], group["foreach"]) == (0.0, (0.8, 0.99), 1e-6, True)
    assert group["lr"] == 1e-2  # the schedule's: restored with the scheduler's position
    for mine, theirs in zip(other.parameters(), model.parameters(), strict=True):
        assert torch.equal(resumed.state[mine]["exp_avg"], opt.state[theirs]["exp_avg"])
        assert float(resumed.state[mine]["step"]) == 1.0
    assert ("the optimizer's hyperparameters are this run's, not the checkpoint's: betas (0.9, 0.95) -> (0.8, 0.99), "
            "eps 1e-08 -> 1e-06, foreach None -> True, weight_decay 0.1 -> 0.0") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="titan"):
        OptimizerWrapper(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                                                  eps=1e-8)).load_state_dict(saved)
    assert "hyperparameters" not in caplog.text


def test_the_runs_facts_travel_in_every_manifest_and_a_resume_reads_them(tmp_path, caplog):
    """What the trainer says about its run (its batch) is written into each step's manifest
    and read back by the load; a step written without them (an older titan) reads None, and a
    step written by another number of ranks says it was resharded."""
    import json

    from titan.ckpt import layout

    run = Run(_cfg(interval=2), str(tmp_path))
    run.manager.run_facts = {"batch": {"global_batch_size": 16, "seq_len": 32}}
    run.train(2)
    run.manager.close()
    manifest_path = os.path.join(layout.step_path(run.manager.folder, 2), layout.MANIFEST)
    manifest = json.loads(open(manifest_path).read())
    assert manifest["run"] == {"batch": {"global_batch_size": 16, "seq_len": 32}}
    again = Run(_cfg(interval=2), str(tmp_path))
    assert again.manager.loaded_run_facts is None
    with caplog.at_level("INFO", logger="titan"):
        assert again.manager.load() == 2
    again.manager.close()
    assert again.manager.loaded_run_facts == manifest["run"]
    assert "resharded" not in caplog.text
    # As an older titan wrote it, by 2 ranks.
    manifest.pop("run")
    manifest["world_size"] = 2
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    caplog.clear()
    older = Run(_cfg(interval=2), str(tmp_path))
    with caplog.at_level("INFO", logger="titan"):
        assert older.manager.load() == 2
    older.manager.close()
    assert older.manager.loaded_run_facts is None
    assert "(written by 2 ranks, resharded onto 1)" in caplog.text


def test_a_step_another_kind_of_run_wrote_is_refused_before_loading(tmp_path):
    """A `titan sft` folder resumed by `titan train` failed on the data loader's entries, "probably
    written under a different parallel layout". The manifest names the writing trainer; another
    trainer is refused before anything loads, naming the initial load that takes the weights."""
    sft = Run(_cfg(interval=2), str(tmp_path))
    sft.manager.run_facts = {"trainer": "SFTTrainer"}
    sft.train(2)
    sft.manager.close()
    pretrain = Run(_cfg(interval=2), str(tmp_path), seed=5)
    pretrain.manager.run_facts = {"trainer": "Trainer"}
    before = {k: v.clone() for k, v in pretrain.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"written by another kind of run \(SFTTrainer\) than this one "
                                              r"\(Trainer\).*--checkpoint.initial_load_path .*step-2"):
        pretrain.manager.load()
    pretrain.manager.close()
    assert tensors_equal(pretrain.model.state_dict(), before)
    again = Run(_cfg(interval=2), str(tmp_path), seed=5)
    again.manager.run_facts = {"trainer": "SFTTrainer"}
    assert again.manager.load() == 2
    again.manager.close()


def test_save_now_keeps_a_saved_step_unless_told_to_resave_it(tmp_path):
    """A preemption save of a step this run saved already keeps that checkpoint (nothing
    moved); with ``resave`` (work done since without a step: an RL critic's warm-up) it
    replaces it with the state as it is now."""
    run = Run(_cfg(interval=2), str(tmp_path))
    run.train(2)
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    with torch.no_grad():
        for param in run.model.parameters():
            param.add_(1.0)
    moved = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert run.manager.save_now(2)
    check = Run(_cfg(), str(tmp_path), seed=3)
    assert check.manager.load() == 2 and tensors_equal(check.model.state_dict(), saved)
    assert run.manager.save_now(2, resave=True)
    again = Run(_cfg(), str(tmp_path), seed=4)
    assert again.manager.load() == 2 and tensors_equal(again.model.state_dict(), moved)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]
    run.manager.close(), check.manager.close(), again.manager.close()


def test_copy_whole_weights_fills_every_entry_and_names_a_missing_or_misshaped_one():
    """Whole tensors by name into a model (one process: the shard is the tensor); a missing
    entry or another shape raises with the caller's message, built from the name and shapes."""
    from titan.ckpt import copy_whole_weights

    model = torch.nn.Linear(3, 2)
    whole = {"weight": torch.arange(6.0).view(2, 3), "bias": torch.tensor([7.0, 8.0])}

    def problem(name, found, want):
        return f"{name}: {found} against {want}"

    copy_whole_weights(model, whole, problem=problem)
    assert torch.equal(model.weight, whole["weight"]) and torch.equal(model.bias, whole["bias"])
    with pytest.raises(ValueError, match=r"^bias: None against \(2,\)$"):
        copy_whole_weights(model, {"weight": whole["weight"]}, problem=problem)
    with pytest.raises(ValueError, match=r"^weight: \(3, 2\) against \(2, 3\)$"):
        copy_whole_weights([model], {**whole, "weight": torch.zeros(3, 2)}, problem=problem)
