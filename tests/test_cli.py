"""The `titan` command: recipes, flag names, overrides and errors."""

import os
import subprocess
import sys

import pytest

from titan.recipes.cli import parse_train_args, split_recipe_flag
from titan.recipes.recipes import RECIPES, recipe

FLAGS_USERS_KNOW = [
    "--training.steps",
    "--training.local_batch_size",
    "--training.global_batch_size",
    "--training.seq_len",
    "--optimizer.lr",
    "--lr_scheduler.warmup_steps",
    "--metrics.log_freq",
    "--job.dump_folder",
    "--debug.seed",
    "--debug.deterministic",
    "--parallelism.tensor_parallel_degree",
    "--checkpoint.enable",
]


def test_help_lists_recipes_and_flags():
    out = subprocess.run(
        [sys.executable, "-m", "titan.recipes.cli", "train", "--help"],
        capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "250"},
    ).stdout
    for name in RECIPES:
        assert name in out
    for flag in FLAGS_USERS_KNOW:
        assert flag in out, flag


def test_overrides_apply_on_top_of_the_recipe():
    cfg = parse_train_args(["--config", "llama3_debug", "--training.steps", "7", "--optimizer.lr", "0.01", "--debug.deterministic"])
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == 0.01
    assert cfg.debug.deterministic is True
    assert cfg.model.flavor == recipe("llama3_debug").model.flavor


def test_config_flag_forms():
    assert split_recipe_flag(["--config=llama3_8b", "--x", "1"]) == ("llama3_8b", ["--x", "1"])
    assert split_recipe_flag(["--x", "1"])[0] == "llama3_debug"


def test_unknown_recipe_names_the_choices():
    with pytest.raises(SystemExit, match="llama3_debug"):
        parse_train_args(["--config", "nope"])


def test_bad_value_is_rejected_by_validation(capsys):
    with pytest.raises(SystemExit):
        parse_train_args(["--optimizer.lr", "-1"])
    assert "--optimizer.lr must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_builds_a_valid_config(name):
    cfg = recipe(name)
    assert cfg.training.steps > 0 and cfg.model.name == "llama3"
