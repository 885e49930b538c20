"""The ``titan`` command: ``titan train --config <recipe> [--section.field value ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import tyro
from titan.ckpt import CheckpointError
from titan.train.config import TrainerConfig
from titan.train.loss import NonFiniteLossError

from titan.recipes.dry_run import (
    dry_run_main,
    fake_backend_requested,
    split_world_size_flag,
    world_size_from_env,
)
from titan.recipes.families import model_spec
from titan.recipes.recipes import DEFAULT_RECIPE, RECIPES, recipe

USAGE = """usage: titan train [--config RECIPE] [--section.field VALUE ...]
       titan dry-run --world_size N [--config RECIPE] [--section.field VALUE ...]
       titan recipes

Commands:
  train     train a model; RECIPE picks the starting config, flags override it
            (COMM_MODE=fake_backend with NGPU/WORLD_SIZE=N makes it a dry run)
  dry-run   validate and parallelize the config for N ranks on this CPU (fake process
            group, meta device); print each pipeline rank's params and memory estimate
  recipes   list the recipes
"""


def split_recipe_flag(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Pull ``--config NAME`` / ``--config=NAME`` out of ``argv``; the rest are tyro flags."""
    name, rest = DEFAULT_RECIPE, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise SystemExit("titan train: --config needs a recipe name; see `titan recipes`")
            name = args[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def recipes_description() -> str:
    """One line per recipe, for ``--help`` and ``titan recipes``."""
    lines = []
    for name, fn in RECIPES.items():
        first = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        default = " (default)" if name == DEFAULT_RECIPE else ""
        lines.append(f"  {name:<24}{first}{default}")
    return "\n".join(lines)


def parse_train_args(argv: Sequence[str]) -> TrainerConfig:
    """Resolve ``--config`` to a recipe, then apply the remaining flags with tyro."""
    name, rest = split_recipe_flag(argv)
    try:
        default = recipe(name)
    except ValueError as err:
        raise SystemExit(f"titan train: {err}") from None
    description = (
        f"Train with recipe {name!r} (--config RECIPE picks another); every flag below overrides it.\n\n"
        f"Recipes:\n{recipes_description()}"
    )
    return tyro.cli(
        TrainerConfig,
        default=default,
        args=rest,
        prog="titan train",
        description=description,
        use_underscores=True,  # --training.local_batch_size, as torchtitan users type it
    )


def train(argv: Sequence[str]) -> int:
    """Run ``titan train``; returns the process exit code."""
    from titan.train.trainer import Trainer  # imported late: --help stays fast

    config = parse_train_args(argv)
    if fake_backend_requested():
        return dry_run_main(config, world_size_from_env())
    trainer = Trainer(config, model_spec=model_spec(config.model.name))
    try:
        trainer.train()
    except (NonFiniteLossError, CheckpointError) as err:
        print(f"titan train: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``titan`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nRecipes:\n" + recipes_description())
        return 0
    command, rest = args[0], args[1:]
    if command == "train":
        return train(rest)
    if command == "dry-run":
        world_size, rest = split_world_size_flag(rest)
        config = parse_train_args(rest)
        return dry_run_main(config, world_size or world_size_from_env())
    if command == "recipes":
        print(recipes_description())
        return 0
    print(f"titan: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
