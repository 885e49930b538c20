"""`titan train --dataset.streaming` on a dataset in the Hub's layout: the trainer streams it,
and a run stopped at a checkpoint resumes to the uninterrupted run's losses."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
import tyro
from titan.train.config import TrainerConfig
from titan.train.data.loader import StreamingDataLoader
from titan.train.trainer import Trainer

from titan.recipes.families import model_spec
from titan.recipes.recipes import recipe


@pytest.fixture
def hub_folder(tmp_path):
    """Three gzipped JSON Lines shards of Python source lines, config "en", split "train"."""
    import inspect

    lines = [line for line in inspect.getsource(json).splitlines() if line.strip()]
    root = tmp_path / "hub"
    (root / "en").mkdir(parents=True)
    for shard in range(3):
        with gzip.open(root / "en" / f"train-{shard:05d}-of-00003.json.gz", "wt") as f:
            for line in lines[shard::3]:
                f.write(json.dumps({"text": line}) + "\n")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/train-*.json.gz\n---\n")
    return root


def _train(hub_folder, dump, steps, *extra):
    args = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--metrics.no_enable_progress_bar", "--metrics.log_freq", "1", "--debug.seed", "0",
            "--dataset.name", str(hub_folder), "--dataset.subset", "en", "--dataset.streaming",
            "--dataset.cache_dir", str(dump / "datasets-cache"), "--tokenizer.kind", "byte",
            "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only",
            "--job.dump_folder", str(dump), *extra]
    cfg = tyro.cli(TrainerConfig, default=recipe("llama3_debug_synthetic"), args=args, use_underscores=True)
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    try:
        assert isinstance(trainer.dataloader, StreamingDataLoader)
        return {r["step"]: r["loss"] for r in trainer.train() if "loss" in r}
    finally:
        trainer.close()


def test_streamed_training_resumes_to_the_uninterrupted_losses(hub_folder, tmp_path):
    whole = _train(hub_folder, tmp_path / "whole", 6)
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    # The run stopped after step 3 (its checkpoint alone, so the LR schedule is the same).
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-3", tmp_path / "split" / "checkpoint" / "step-3")
    resumed = _train(hub_folder, tmp_path / "split", 6)
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]
    assert not list((tmp_path / "whole" / "datasets-cache").rglob("*.arrow"))  # streamed, not converted
