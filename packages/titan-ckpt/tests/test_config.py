"""`--checkpoint.*` validation names the flag, the bad value and the fix."""

import pytest
from titan.ckpt import CheckpointConfig, CheckpointManager


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"async_mode": "fast"}, r"--checkpoint.async_mode must be one of disabled, async"),
        ({"export_dtype": "fp8"}, r"--checkpoint.export_dtype must be one of float32"),
        ({"interval": 0}, r"--checkpoint.interval must be >= 1"),
        ({"keep_latest_k": -1}, r"--checkpoint.keep_latest_k must be >= 0"),
        ({"load_step": -2}, r"--checkpoint.load_step must be -1"),
        ({"initial_load_in_hf": True}, r"initial_load_in_hf needs --checkpoint.initial_load_path"),
        ({"initial_load_in_hf": True, "initial_load_path": "x", "initial_load_model_only": False},
         r"keep\s+--checkpoint.initial_load_model_only true"),
        ({"exclude_from_loading": "dataloader"}, r"exclude_from_loading must be a list"),
    ],
)
def test_bad_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**kwargs)


def test_defaults_are_valid_for_a_manager(tmp_path):
    import torch

    cfg = CheckpointConfig()
    manager = CheckpointManager(cfg, dump_folder=str(tmp_path), states={}, model_parts=[torch.nn.Linear(2, 2)])
    assert isinstance(manager, CheckpointManager)
    assert manager.folder == str(tmp_path / "checkpoint") == cfg.folder_in(str(tmp_path))
    manager.close()


def test_absolute_folder_ignores_dump_folder(tmp_path):
    import torch

    cfg = CheckpointConfig(folder=str(tmp_path / "elsewhere"))
    manager = CheckpointManager(cfg, dump_folder="/unused", states={}, model_parts=[torch.nn.Linear(2, 2)])
    assert manager.folder == str(tmp_path / "elsewhere") == cfg.folder_in("/unused")
    manager.close()


def test_a_loop_taking_several_steps_at_once_saves_when_it_passes_an_interval(tmp_path):
    """RL with several optimizer steps per rollout moves 3 steps at a time: 3, 6, 9, 12 with
    interval 5 must save at 6 (passed 5) and 12 (passed 10), and nothing else."""
    from ckpt_testlib import TinyLM
    from titan.ckpt import CheckpointConfig, CheckpointManager

    manager = CheckpointManager(CheckpointConfig(enable=True, interval=5, last_save_model_only=False),
                                dump_folder=str(tmp_path), states={}, model_parts=[TinyLM()])
    saved = [step for step in (3, 6, 9, 12) if manager.maybe_save(step, since=step - 3)]
    manager.close()
    assert saved == [6, 12]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-12", "step-6"]
