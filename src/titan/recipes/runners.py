"""Which training loop runs a config: the ``titan`` command looks it up by the config's type.

A recipe returns a config object; its type picks both the flag sections ``titan`` offers (tyro
reads the type) and the loop that runs it (this registry). Pretraining maps ``TrainerConfig``
to ``Trainer``. A new loop (supervised fine-tuning, RL) registers its config type here with
the subcommand whose default recipe and recipe listing it belongs to, e.g.::

    register_runner(SFTConfig, build_sft_trainer, command="sft")

Lookup walks the config type's MRO, so a subclass of ``TrainerConfig`` runs on the pretraining
loop unless it registers its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from titan.train.config import TrainerConfig

from titan.recipes.recipes import DEFAULT_RECIPE


class Loop(Protocol):
    """What the CLI drives: run to the end, then release resources (also after a failure)."""

    def train(self) -> Any:
        """Run the loop to its last step."""

    def close(self) -> None:
        """Release the process group, drain checkpoint saves, close the progress bar."""


@dataclass(frozen=True)
class Runner:
    """How to run one config type."""

    build: Callable[[Any], Loop]
    """Builds the loop from the resolved config (imports lazily: ``--help`` stays fast)."""
    command: str
    """The ``titan`` subcommand whose recipes these are (``train``, ``sft``, ...)."""


RUNNERS: dict[type, Runner] = {}
"""Config type -> runner; extended with :func:`register_runner`."""

DEFAULT_RECIPES: dict[str, str] = {"train": DEFAULT_RECIPE, "sft": "sft_debug", "rl": "grpo_debug", "dpo": "dpo_debug",
                                  "kto": "kto_debug", "reward": "reward_debug", "gkd": "gkd_debug"}
"""The recipe each subcommand starts from when ``--config`` is not given."""


def register_runner(config_type: type, build: Callable[[Any], Loop], *, command: str) -> None:
    """Run configs of ``config_type`` (and its subclasses) with ``build(config)``."""
    RUNNERS[config_type] = Runner(build=build, command=command)


def runner_for(config: Any) -> Runner:
    """The runner registered for ``config``'s type or its closest registered base class."""
    for cls in type(config).__mro__:
        if cls in RUNNERS:
            return RUNNERS[cls]
    raise ValueError(
        f"no training loop is registered for {type(config).__name__}; register one with "
        "titan.recipes.runners.register_runner"
    )


def _build_pretraining(config: TrainerConfig) -> Loop:
    from titan.train.trainer import Trainer  # imported late: --help stays fast

    from titan.recipes.families import model_spec_for

    return Trainer(config, model_spec=model_spec_for(config))


register_runner(TrainerConfig, _build_pretraining, command="train")


def _build_sft(config) -> Loop:
    from titan.train.sft import SFTTrainer  # imported late: --help stays fast

    from titan.recipes.families import model_spec_for

    return SFTTrainer(config, model_spec=model_spec_for(config))


def _register_sft() -> None:
    from titan.train.sft import SFTConfig

    register_runner(SFTConfig, _build_sft, command="sft")


_register_sft()


def _build_rl(config) -> Loop:
    # imported late: --help stays fast. With --rl.generator_ranks the launch's last ranks
    # become generator servers, the others the trainer.
    from titan.rl.controller import build_rl_loop

    from titan.recipes.families import family_of_folder, model_spec_for

    spec = model_spec_for(config)
    teacher = config.rl.teacher_model
    return build_rl_loop(config, model_spec=spec, teacher_spec=family_of_folder(teacher, spec) if teacher else None)


def _register_rl() -> None:
    from titan.rl.config import RLConfig

    register_runner(RLConfig, _build_rl, command="rl")


_register_rl()


def _build_dpo(config) -> Loop:
    from titan.rl.dpo import DPOTrainer  # imported late: --help stays fast

    from titan.recipes.families import model_spec_for

    return DPOTrainer(config, model_spec=model_spec_for(config))


def _register_dpo() -> None:
    from titan.rl.dpo import DPOConfig

    register_runner(DPOConfig, _build_dpo, command="dpo")


_register_dpo()


def _build_kto(config) -> Loop:
    from titan.rl.kto import KTOTrainer  # imported late: --help stays fast

    from titan.recipes.families import model_spec_for

    return KTOTrainer(config, model_spec=model_spec_for(config))


def _register_kto() -> None:
    from titan.rl.kto import KTOConfig

    register_runner(KTOConfig, _build_kto, command="kto")


_register_kto()


def _build_reward(config) -> Loop:
    from titan.rl.reward_trainer import RewardTrainer  # imported late: --help stays fast

    from titan.recipes.families import model_spec_for

    return RewardTrainer(config, model_spec=model_spec_for(config))


def _register_reward() -> None:
    from titan.rl.reward_trainer import RewardConfig

    register_runner(RewardConfig, _build_reward, command="reward")


_register_reward()


def _build_gkd(config) -> Loop:
    from titan.rl.gkd import GKDTrainer  # imported late: --help stays fast

    from titan.recipes.families import family_of_folder, model_spec_for

    spec = model_spec_for(config)
    return GKDTrainer(config, model_spec=spec, teacher_spec=family_of_folder(config.gkd.teacher_model, spec))


def _register_gkd() -> None:
    from titan.rl.gkd import GKDConfig

    register_runner(GKDConfig, _build_gkd, command="gkd")


_register_gkd()
