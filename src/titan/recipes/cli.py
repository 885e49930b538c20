"""The ``titan`` command: ``titan train|sft|rl|dpo|kto|reward|gkd --config <recipe> [--section.field value ...]``.

The recipe decides the command line: the flag sections are the fields of the config type the
recipe returns, and the loop that runs it is the one registered for that type in
``titan.recipes.runners`` (pretraining: ``TrainerConfig`` -> ``Trainer``). ``titan sft`` is
``titan train`` with the SFT recipes as its default and listing; ``titan rl`` likewise with
the RL recipes.

Errors. A problem with the command line or its inputs (a bad value, a missing file, an
unwritable folder, impossible parallel degrees, an unknown recipe) is reported as one line,
``titan train: error: <message>``, exit code 2, no traceback. A run that fails later for a
reason outside the config (a non-finite loss, a checkpoint that cannot be used) reports one
line too, with exit code 1. Any other exception is a bug and keeps its traceback.
``--debug.traceback`` (read here, before the config is parsed, so it works whatever fails)
re-raises every error with its full traceback. Every rank of a multi-rank run validates the
same config and fails the same way, so only rank 0 prints configuration errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import faulthandler
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import tyro
from titan.ckpt import CheckpointError
from titan.dist import CollectiveTimeoutError, PeerLostError, leaving_after_failure
from titan.train.config import RunConfig, TrainerConfig
from titan.train.data.config import BUILTIN_DATASETS, DatasetConfig
from titan.train.data.sft_config import SyntheticTaskConfig
from titan.train.loss import NonFiniteLossError
from titan.train.quantize import MissingExtraError, check_quantize_installed

from titan.recipes.dry_run import (
    dry_run_main,
    fake_backend_requested,
    split_world_size_flag,
    world_size_from_env,
)
from titan.recipes.families import HF_FLAVOR, hf_flavor_args, model_spec, model_spec_for
from titan.recipes.memory_check import check_memory, warn_beyond_context
from titan.recipes.recipes import RECIPES, recipe
from titan.recipes.runners import DEFAULT_RECIPES, runner_for
from titan.recipes.torchtitan_compat import (
    CONFIG_FILE_FLAG,
    split_config_file,
    titan_argv,
    translate,
)

USAGE = """usage: titan train [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan sft [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan rl [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan dpo [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan kto [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan reward [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan gkd [--config RECIPE] [--section.field VALUE ...] [--debug.traceback]
       titan dry-run --world_size N [--config RECIPE] [--section.field VALUE ...]
       titan plan --gpus <N>x<DEVICE> [--config RECIPE] [--json] [--top K] [--section.field VALUE ...]
       titan recipes
       titan data tokenize SRC OUT [--tokenizer.kind K --tokenizer.path P] [--num_proc N]
       titan plot RUN_DIR [RUN_DIR ...] [--out DIR] [--keys loss,lr,...]

Commands:
  train     train a model; RECIPE picks the starting config, flags override it
            (COMM_MODE=fake_backend with NGPU/WORLD_SIZE=N makes it a dry run)
  sft       supervised fine-tuning: like train, starting from the SFT recipes
  rl        RL post-training (GRPO family): like train, starting from the RL recipes
  dpo       preference optimization (DPO family) on chosen/rejected pairs: like train,
            starting from the DPO recipes
  kto       KTO on completions labelled desirable or not (or on pairs): like train,
            starting from the KTO recipes
  reward    train a reward model (a score head) on chosen/rejected pairs: like train,
            starting from the reward recipes; export it for `titan rl --rl.rewards model`
  gkd       distill a teacher (--gkd.teacher_model) into the model on SFT data and on the
            model's own completions (GKD): like train, starting from the GKD recipes
  dry-run   validate and parallelize the config for N ranks on this CPU (fake process
            group, meta device); print each pipeline rank's params and memory estimate
  plan      rank every valid parallel layout of the config's model for N devices (H100,
            H200, B200, A100, MI300X): predicted tokens/s/GPU, MFU, memory per rank, and
            the `titan train` flags of each (`titan plan --help` for its options)
  recipes   list the recipes
  data      `data tokenize`: tokenize a text corpus once into memory-mapped shards, for
            --dataset.name tokenized --dataset.path OUT
  plot      draw runs' metrics.jsonl as PNGs (loss, throughput, memory, lr; --keys for
            others), several runs overlaid

Errors are one line with exit code 2 (bad flags or inputs) or 1 (the run failed);
--debug.traceback shows the full traceback instead.
"""

TRACEBACK_FLAG = "--debug.traceback"

# Exit codes: the command line or its inputs are wrong / the run itself failed.
EXIT_USAGE = 2
EXIT_RUN_FAILED = 1

# OS errors about the user's paths; other OS errors (sockets, timeouts) keep their traceback.
PATH_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError,
               IsADirectoryError)


class UsageError(Exception):
    """A problem with the command line or its inputs: one line on stderr, exit code 2."""


def split_traceback_flag(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Pull ``--debug.traceback`` out of ``argv``: (whether it was given, the rest)."""
    rest = [arg for arg in argv if arg not in (TRACEBACK_FLAG, "--debug.traceback=True")]
    return len(rest) != len(argv), rest


def split_recipe_flag(argv: Sequence[str], default: str = DEFAULT_RECIPES["train"]) -> tuple[str, list[str]]:
    """Pull ``--config NAME`` / ``--config=NAME`` out of ``argv``; the rest are tyro flags."""
    name, rest = default, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise UsageError("--config needs a recipe name; see `titan recipes`")
            name = args[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def recipe_command(name: str) -> str | None:
    """The subcommand the recipe ``name`` belongs to (``train``, ``sft``...), by its config type."""
    try:
        return runner_for(recipe(name)).command
    except ValueError:
        return None


def recipes_description(command: str | None = None) -> str:
    """One line per recipe (those of ``command`` only, when given), for ``--help`` and
    ``titan recipes``."""
    lines = []
    for name, fn in RECIPES.items():
        if command is not None and recipe_command(name) != command:
            continue
        first = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        default = " (default)" if name == DEFAULT_RECIPES.get(command or "train") else ""
        lines.append(f"  {name:<24}{first}{default}")
    return "\n".join(lines)


def config_flags(config: Any, prefix: str = "") -> list[str]:
    """Every ``--section.field`` flag of a config tree (for "did you mean" suggestions)."""
    flags = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            flags += config_flags(value, f"{prefix}{field.name}.")
        else:
            flags.append(f"--{prefix}{field.name}")
    return flags


def _flag_of(argument: Any) -> str:
    """The flag of one of tyro's argument definitions (private type; read defensively)."""
    names = getattr(getattr(argument, "lowered", None), "name_or_flags", None)
    return "/".join(names) if names else "an argument"


def _parse_error_message(event: Any, default: Any, prog: str, argv: list[str]) -> str | None:
    """One line for a tyro parse-error event, or None to fall back to tyro's own text."""
    from tyro import _errors as ev

    see_help = f"see `{prog} --help`"
    if isinstance(event, ev.InstantiationFailure):
        if event.argument is None:
            return event.message  # a __post_init__ message: names the flag and the fix
        return f"{_flag_of(event.argument)}: {event.message}; {see_help}"
    if isinstance(event, ev.UnrecognizedArgs):
        flags = [t.split("=", 1)[0] for t in event.tokens if t.startswith("--")]
        if flags:
            close = difflib.get_close_matches(flags[0], config_flags(default), n=1)
            hint = f"did you mean {close[0]}?" if close else see_help
            return f"unrecognized flag {flags[0]}; {hint}"
        # A stray value: most often one given to a boolean flag, which takes none.
        value = event.tokens[0]
        before = argv[argv.index(value) - 1] if value in argv[1:] else ""
        if before.startswith("--"):
            section, _, field = before[2:].rpartition(".")
            negated = f"--{section}.no_{field}" if section else f"--no_{field}"
            return (f"{before} takes no value, got {value!r}; write {before} to switch it on "
                    f"or {negated} to switch it off")
        return f"unexpected argument {value!r}; {see_help}"
    if isinstance(event, ev.BadValue):
        flag = _flag_of(event.argument)
        if event.offending_value is None:
            return f"{flag} needs a value; {see_help}"
        return f"{flag} takes no value, got {event.offending_value!r}; {see_help}"
    if isinstance(event, ev.InvalidChoice):
        return f"{_flag_of(event.argument)} {event.value!r} is not one of {', '.join(event.choices)}"
    if isinstance(event, ev.MissingArgs):
        names = [_flag_of(getattr(a, "arg", None)) for a in event.missing_arguments]
        return f"missing required flags: {', '.join(names)}"
    return None


def _condense(text: str) -> str:
    """tyro's boxed error text as one line (fallback for events without a message above)."""
    lines = []
    for line in text.splitlines():
        line = line.strip().strip("│╭╮╰╯─ ").strip()
        if line and not line.startswith(("For full helptext", "Value error", "Unrecognized options")):
            lines.append(line)
    return "; ".join(lines) or "invalid arguments"


@contextlib.contextmanager
def _one_line_parse_errors(default: Any, prog: str, argv: list[str]) -> Iterator[None]:
    """Turn tyro's boxed parse errors into :class:`UsageError` (one line).

    tyro's parse-error hook (``tyro._errors.on_parse_error``, private) gives structured events;
    where it is missing or an event is not handled, tyro's own output is captured and condensed.
    """
    captured = io.StringIO()

    def hook(event: Any) -> None:
        message = _parse_error_message(event, default, prog, argv)
        if message is not None:
            raise UsageError(message)

    try:
        from tyro._errors import on_parse_error
    except ImportError:  # an older tyro: only the captured-output fallback
        on_parse_error = None
    try:
        with contextlib.redirect_stderr(captured):
            with on_parse_error(hook) if on_parse_error else contextlib.nullcontext():
                yield
    except UsageError:
        raise
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise UsageError(_condense(captured.getvalue())) from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())  # warnings printed while parsing stay visible


def _flag_names(config_type: type) -> tuple[str, ...]:
    """The command-line names of a config dataclass's fields (``no_<name>`` for switches too)."""
    names = []
    for f in dataclasses.fields(config_type):
        names.append(f.name)
        if f.type in (bool, "bool"):
            names.append(f"no_{f.name}")
    return tuple(names)


DATASET_FLAG_NAMES = _flag_names(DatasetConfig)
SYNTHETIC_CORPUS_FIELDS = tuple(name for name in DATASET_FLAG_NAMES if name.startswith("synthetic_"))
SYNTHETIC_TASK_FIELDS = _flag_names(SyntheticTaskConfig)

def _unread_dataset_fields(section: str) -> tuple[tuple[tuple[str, ...], Any, str], ...]:
    """`DEPENDENT_FLAGS` entries of a `DatasetConfig` section (``dataset``, ``validation.dataset``):
    the fields only some sources read (`DatasetConfig.check_unread_fields` says why each)."""
    def of(config: Any) -> DatasetConfig:
        for part in section.split("."):
            config = getattr(config, part)
        return config

    flag = f"--{section}"
    return (
        ((f"{flag}.subset", f"{flag}.split"), lambda c: of(c).is_hub, f"a hub dataset ({flag}.name)"),
        ((f"{flag}.text_field",), lambda c: of(c).name not in (*BUILTIN_DATASETS, "text"),
         f"{flag}.name json, parquet or a hub dataset"),
        ((f"{flag}.text_sample_by",), lambda c: of(c).name == "text", f"{flag}.name text"),
    )


# Flags that change nothing unless another setting is on: (the flags, whether that setting is
# on in the parsed config, the setting to name). A flag the run would silently ignore is refused.
DEPENDENT_FLAGS = (
    (("--compile.granularity", "--compile.components", "--compile.backend", "--compile.fullgraph",
      "--compile.no_fullgraph"), lambda c: c.compile.enable, "--compile.enable"),
    (("--activation_checkpoint.selective_layer_every", "--activation_checkpoint.selective_op",
      "--activation_checkpoint.no_selective_op"),
     lambda c: c.activation_checkpoint.mode == "selective", "--activation_checkpoint.mode selective"),
    (("--activation_checkpoint.preserve_rng_state",),
     lambda c: c.activation_checkpoint.mode != "none", "--activation_checkpoint.mode full or selective"),
    (("--parallelism.pipeline_parallel_schedule", "--parallelism.pipeline_parallel_microbatch_size",
      "--parallelism.pipeline_parallel_layers_per_stage", "--parallelism.pipeline_parallel_split_points",
      "--parallelism.pipeline_parallel_first_stage_less_layers", "--parallelism.pipeline_parallel_last_stage_less_layers"),
     lambda c: c.parallelism.pipeline_parallel_degree > 1, "--parallelism.pipeline_parallel_degree > 1"),
    (("--parallelism.pipeline_parallel_first_stage_less_layers", "--parallelism.pipeline_parallel_last_stage_less_layers"),
     lambda c: not c.parallelism.pipeline_parallel_split_points,
     "the even split (--parallelism.pipeline_parallel_split_points name every stage's blocks)"),
    (("--parallelism.enable_async_tensor_parallel",), lambda c: c.parallelism.tensor_parallel_degree > 1,
     "--parallelism.tensor_parallel_degree > 1"),
    (("--checkpoint.interval", "--checkpoint.keep_latest_k", "--checkpoint.async_mode", "--checkpoint.load_step",
      "--checkpoint.folder", "--checkpoint.exclude_from_loading", "--checkpoint.last_save_model_only",
      "--checkpoint.no_last_save_model_only", "--checkpoint.export_dtype", "--checkpoint.last_save_in_hf"),
     lambda c: c.checkpoint.enable, "--checkpoint.enable"),
    (("--metrics.wandb_project", "--metrics.wandb_run_name", "--metrics.wandb_mode"),
     lambda c: c.metrics.enable_wandb, "--metrics.enable_wandb"),
    (("--metrics.save_tb_folder",), lambda c: c.metrics.enable_tensorboard, "--metrics.enable_tensorboard"),
    (("--profiling.profiler_warmup", "--profiling.profiler_active", "--profiling.save_traces_folder"),
     lambda c: c.profiling.enable_profiling, "--profiling.enable_profiling"),
    (("--profiling.profile_freq",), lambda c: c.profiling.enable_profiling or c.profiling.enable_memory_snapshot,
     "--profiling.enable_profiling or --profiling.enable_memory_snapshot"),
    (("--profiling.save_memory_snapshot_folder",), lambda c: c.profiling.enable_memory_snapshot,
     "--profiling.enable_memory_snapshot"),
    (("--fault_tolerance.replica_id", "--fault_tolerance.group_size", "--fault_tolerance.min_replica_size"),
     lambda c: c.fault_tolerance.enable, "--fault_tolerance.enable"),
    (tuple(f"--dataset.{name}" for name in SYNTHETIC_CORPUS_FIELDS), lambda c: c.dataset.name == "synthetic",
     "--dataset.name synthetic"),
    (("--dataset.streaming",), lambda c: c.dataset.streams, "a hub dataset or local files (--dataset.name)"),
    *(entry for section in ("dataset", "validation.dataset") for entry in _unread_dataset_fields(section)),
    (("--validation.freq", "--validation.steps", "--validation.local_batch_size", "--validation.seq_len",
      *(f"--validation.dataset.{name}" for name in DATASET_FLAG_NAMES)),
     lambda c: c.validation.enable, "--validation.enable"),
    (tuple(f"--sft_data.{name}" for name in SYNTHETIC_TASK_FIELDS), lambda c: c.sft_data.resolved_format == "synthetic",
     "--sft_data.format synthetic"),
    ((*(f"--rl_data.{name}" for name in SYNTHETIC_TASK_FIELDS), "--rl_data.sft_demonstrations"),
     lambda c: c.rl_data.resolved_format == "synthetic", "--rl_data.format synthetic"),
)


def ineffective_flags(cli_argv: Sequence[str], config: Any, *, exempt: Sequence[str] = ()) -> list[str]:
    """The flags on the command line (`cli_argv`, titan's spellings) that `config` would
    ignore, each with the setting it needs. A torchtitan TOML file's are not checked: its
    sections spell out defaults (a checkpoint interval with checkpointing off)."""
    given = {arg.partition("=")[0] for arg in cli_argv if arg.startswith("--")} - set(exempt)
    found = []
    for flags, takes_effect, needs in DEPENDENT_FLAGS:
        section = flags[0][2:].split(".")[0]
        if not hasattr(config, section):  # a command whose config has no such section
            continue
        for flag in flags:
            if flag in given and not takes_effect(config):
                found.append(f"{flag} has no effect without {needs}")
    return found


def _command_line_flags(argv: Sequence[str]) -> list[str]:
    """The command line's own flags in titan's spelling, without a TOML file's. A torchtitan
    flag that needs the file to translate (a float8 recipe whose converter the file names)
    stays as typed."""
    cli = split_config_file(argv)[1]
    try:
        return translate(cli)
    except ValueError:  # CompatError
        return list(cli)


def parse_train_args(argv: Sequence[str], *, command: str = "train", exempt_flags: Sequence[str] = ()) -> Any:
    """Resolve ``--config`` to a recipe, then apply the remaining flags with tyro.

    The flags are those of the recipe's own config type (``type(default)``), so a recipe that
    returns another config tree (SFT, RL) gets its own sections; ``--job.config_file FILE.toml``
    sets flags from a torchtitan-style TOML file before the command line's, and torchtitan's
    spellings of titan's flags are accepted (`titan.recipes.torchtitan_compat`). Raises
    :class:`UsageError`.
    """
    prog = f"titan {command}"
    default_name = DEFAULT_RECIPES.get(command, DEFAULT_RECIPES["train"])
    name, rest = split_recipe_flag(argv, default=default_name)
    argv_rest = rest
    try:
        default = recipe(name)
        # A torchtitan job file run without --config: its omissions mean torchtitan's defaults.
        explicit_recipe = len(rest) < len(argv)  # split_recipe_flag took --config NAME out
        rest = titan_argv(rest, job_file_defaults=command == "train" and not explicit_recipe)
    except ValueError as err:  # CompatError is one
        raise UsageError(str(err)) from None
    description = (
        f"Run recipe {name!r} (--config RECIPE picks another); every flag below overrides it.\n"
        f"{CONFIG_FILE_FLAG} FILE.toml sets flags from a torchtitan-style TOML file first; torchtitan's\n"
        f"spellings of these flags are accepted too. {TRACEBACK_FLAG} shows the full traceback of an error.\n\n"
        f"Recipes:\n{recipes_description(command)}"
    )
    with _one_line_parse_errors(default, prog, rest):
        config = tyro.cli(
            type(default),
            default=default,
            args=rest,
            prog=prog,
            description=description,
            use_underscores=True,  # --training.local_batch_size, as torchtitan users type it
        )
    ignored = ineffective_flags(_command_line_flags(argv_rest), config, exempt=exempt_flags)
    if ignored:
        raise UsageError(f"{ignored[0]}: set it or drop the flag")
    return config


def resolve_hub_sources(config: Any, *, weights: bool = True) -> Any:
    """Hub repository ids given as ``--checkpoint.initial_load_path`` (with
    ``--checkpoint.initial_load_in_hf``), ``--tokenizer.path`` (kind hf), the chat template
    paths, ``--rl.reward_model``, ``--rl.teacher_model``, ``--rl.critic_model`` and
    ``--gkd.teacher_model``, as TRL takes
    ``model_name_or_path``: each is replaced by the local folder of its snapshot in the Hugging
    Face cache, downloaded if needed (without ``weights``, as a dry run or plan needs it: the
    configuration and tokenizer only). Local paths are left alone. Returns ``config``."""
    from titan.ckpt.hub import CONFIG_FILES, MODEL_FILES

    checkpoint = getattr(config, "checkpoint", None)
    if getattr(checkpoint, "initial_load_in_hf", False) and checkpoint.initial_load_path:
        checkpoint.initial_load_path = from_hub(
            checkpoint.initial_load_path, flag="--checkpoint.initial_load_path",
            patterns=MODEL_FILES if weights else CONFIG_FILES, revision=checkpoint.initial_load_revision,
            revision_flag="--checkpoint.initial_load_revision")
    resolve_hub_tokenizer(getattr(config, "tokenizer", None))
    resolve_hub_templates(config)
    rl = getattr(config, "rl", None)
    if weights and getattr(rl, "reward_model", None):  # --rl.rewards model: a Hub id as TRL takes one
        rl.reward_model = from_hub(rl.reward_model, flag="--rl.reward_model", patterns=MODEL_FILES)
    if weights and getattr(rl, "teacher_model", None):  # TRL's teacher_model_name_or_path
        rl.teacher_model = from_hub(rl.teacher_model, flag="--rl.teacher_model", patterns=MODEL_FILES)
    if weights and getattr(rl, "critic_model", None):  # OpenRLHF's critic_pretrain
        rl.critic_model = from_hub(rl.critic_model, flag="--rl.critic_model", patterns=MODEL_FILES)
    gkd = getattr(config, "gkd", None)
    if weights and getattr(gkd, "teacher_model", None):  # TRL's GKD teacher_model_name_or_path
        gkd.teacher_model = from_hub(gkd.teacher_model, flag="--gkd.teacher_model", patterns=MODEL_FILES)
    return config


def resolve_hub_templates(config: Any) -> None:
    """``--sft_data.chat_template_path`` (and the other data sections': ``rl_data``,
    ``dpo_data``, ``kto_data``, ``reward_data``) given as a Hub id (TRL takes a tokenizer's
    repository there): the snapshot folder of its tokenizer files."""
    from titan.ckpt.hub import TOKENIZER_FILES

    for section in ("sft_data", "rl_data", "dpo_data", "kto_data", "reward_data"):
        data = getattr(config, section, None)
        if getattr(data, "chat_template_path", None):
            data.chat_template_path = from_hub(data.chat_template_path, flag=f"--{section}.chat_template_path",
                                               patterns=TOKENIZER_FILES)


def resolve_model_sources(config: Any, argv: Sequence[str], *, weights: bool = True) -> Any:
    """Where the run's model and tokenizer come from, before anything reads them (training, dry
    runs and plans alike): Hub ids to snapshot folders (`resolve_hub_sources`), the folder's own
    tokenizer when the command line `argv` names none (`adopt_source_tokenizer`), and
    ``--model.flavor hf`` from its ``config.json`` (`resolve_hf_flavor`). Returns ``config``."""
    resolve_hub_sources(config, weights=weights)
    adopt_source_tokenizer(config, argv)
    return resolve_hf_flavor(config)


def resolve_hub_tokenizer(tokenizer: Any) -> None:
    """A Hugging Face tokenizer named by its model's Hub id: its snapshot folder instead."""
    from titan.ckpt.hub import TOKENIZER_FILES

    if getattr(tokenizer, "kind", None) == "hf" and tokenizer.path:
        tokenizer.path = from_hub(tokenizer.path, flag="--tokenizer.path", patterns=TOKENIZER_FILES,
                                  revision=getattr(tokenizer, "revision", None), revision_flag="--tokenizer.revision")


HUB_IDS: dict[str, str] = {}
"""The Hub id each snapshot folder `from_hub` resolved came from, for messages in the user's terms."""


def as_typed(path: str) -> str:
    """`path` as the user typed it: the Hub id of a snapshot folder `from_hub` resolved."""
    return HUB_IDS.get(path, path)


def from_hub(path: str, *, flag: str, patterns: Sequence[str], revision: str | None = None,
             revision_flag: str = "revision") -> str:
    """`path`, or for a Hub repository id the local folder of its snapshot at `revision`
    (`resolve_hub_folder`), said once on rank 0; a UsageError naming the flag when it cannot be
    had."""
    from titan.ckpt.hub import is_hub_repo_id, resolve_hub_folder

    rank0 = int(os.environ.get("RANK", "0")) == 0
    if is_hub_repo_id(path) and not rank0:
        try:  # every rank fetches (the cache locks each file); rank 0 shows the progress
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except ImportError:  # resolve_hub_folder names the missing package
            pass
    try:
        folder = resolve_hub_folder(path, flag=flag, patterns=patterns, revision=revision,
                                    revision_flag=revision_flag)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if folder != path:
        HUB_IDS[folder] = path
        if rank0:  # the snapshot folder's name is the commit: the exact revision this run reads
            print(f"titan: {path} from the Hugging Face Hub: {folder}", file=sys.stderr)
    return folder


def resolve_hf_flavor(config: Any) -> Any:
    """``--model.flavor hf`` (the commands run this on the parsed config): check that the run
    starts from a Hugging Face checkpoint whose ``config.json`` this family builds, and give the model that checkpoint's vocabulary unless
    ``--model.vocab_size`` says otherwise (the tokenizer's, padded, would not fit its
    embedding). Returns ``config``."""
    model = getattr(config, "model", None)
    if getattr(model, "flavor", None) != HF_FLAVOR or not isinstance(config, RunConfig):
        return config
    try:
        args = hf_flavor_args(model_spec(model.name), config.checkpoint)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if model.vocab_size is None:
        model.vocab_size = args.vocab_size
    return config


def check_output_folders(config: Any) -> None:
    """Refuse an output folder that cannot be created or written, before any work starts: the
    job's dump folder and, when checkpoints are on, the checkpoint folder (a save that fails
    after hours of training would lose them)."""
    folder = getattr(getattr(config, "job", None), "dump_folder", None)
    if folder:
        _check_writable("--job.dump_folder", folder)
    checkpoint = getattr(config, "checkpoint", None)
    if getattr(checkpoint, "enable", False) and checkpoint.folder:
        _check_writable("--checkpoint.folder", checkpoint.folder_in(folder or ""))


def _check_writable(flag: str, folder: str) -> None:
    """Create `folder` if missing and write a scratch file in it, or raise a UsageError naming `flag`."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".titan-write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(
            f"{flag} {folder!r} is not writable ({reason}); choose a folder you can write to"
        ) from None


def check_tokenizer(config: Any) -> None:
    """A tokenizer file that exists but does not parse is named by its flag."""
    tokenizer = getattr(config, "tokenizer", None)
    if getattr(tokenizer, "kind", None) != "hf":
        return
    try:
        tokenizer.build()
    except (ValueError, OSError, KeyError) as err:
        raise UsageError(
            f"--tokenizer.path {tokenizer.path!r} is not a usable Hugging Face tokenizer "
            f"({(str(err) or type(err).__name__).splitlines()[0]}); point it at a tokenizer.json or the folder holding one"
        ) from None


def adopt_source_tokenizer(config: Any, argv: Sequence[str]) -> None:
    """Tokenize with the model's own tokenizer when the run starts from a Hugging Face folder
    (or Hub id) that ships a ``tokenizer.json`` and the command line names no tokenizer (no
    ``--tokenizer.*`` flag, no job file): as TRL and transformers load the tokenizer beside the
    weights. Said once on rank 0; a tokenizer the user chose is checked by
    `check_tokenizer_of_hf_source` instead."""
    checkpoint, tokenizer = getattr(config, "checkpoint", None), getattr(config, "tokenizer", None)
    folder = getattr(checkpoint, "initial_load_path", None)
    if not (folder and getattr(checkpoint, "initial_load_in_hf", False) and tokenizer is not None):
        return
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return
    job_file, cli = split_config_file(argv)
    if job_file is not None or any(arg.startswith("--tokenizer.") for arg in cli):
        return
    if tokenizer.kind == "hf" and tokenizer.path and os.path.exists(tokenizer.path) and \
            os.path.samefile(tokenizer.hub_files()[0], os.path.join(folder, "tokenizer.json")):
        return
    tokenizer.kind, tokenizer.path = "hf", folder
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"titan: tokenizing with {as_typed(folder)}'s own tokenizer (--tokenizer.kind/--tokenizer.path choose "
              "another)", file=sys.stderr)


def check_tokenizer_of_hf_source(config: Any) -> None:
    """A run starting from a Hugging Face folder that holds its own ``tokenizer.json`` must
    tokenize as that model did: the byte tokenizer (the recipes' default) would feed the
    pretrained embeddings other ids, and the run would train without any error. Refused with
    the flags that fix it; a Hub tokenizer whose vocabulary differs from the folder's is
    warned about (extending a vocabulary is a choice, mixing two up is not)."""
    checkpoint, tokenizer = getattr(config, "checkpoint", None), getattr(config, "tokenizer", None)
    folder = getattr(checkpoint, "initial_load_path", None)
    if not (folder and getattr(checkpoint, "initial_load_in_hf", False) and tokenizer is not None):
        return
    own = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(own):
        return
    if tokenizer.kind != "hf":
        raise UsageError(
            f"{as_typed(folder)} holds the model's own tokenizer.json, but this run tokenizes with the "
            f"{tokenizer.kind} tokenizer: the pretrained weights would see other token ids. Add "
            f"--tokenizer.kind hf --tokenizer.path {as_typed(folder)}"
        )
    from tokenizers import Tokenizer  # a Hub tokenizer is in use: the library is there

    mine = tokenizer.hub_files()[0]
    if os.path.samefile(mine, own) or Tokenizer.from_file(mine).get_vocab() == Tokenizer.from_file(own).get_vocab():
        return
    if int(os.environ.get("RANK", "0")) == 0:  # before logging is set up: rank 0 prints it once
        print(f"titan: warning: --tokenizer.path {tokenizer.path} has another vocabulary than {own}, the "
              "tokenizer the checkpoint was trained with: its token ids mean other things to the pretrained weights",
              file=sys.stderr)


def check_initial_load_path(config: Any) -> None:
    """A checkpoint to start from must exist (its contents are checked when it is loaded)."""
    from titan.ckpt.hub import is_hub_repo_id

    path = getattr(getattr(config, "checkpoint", None), "initial_load_path", None)
    if path and not os.path.exists(path):
        hint = (" (a Hugging Face Hub model? add --checkpoint.initial_load_in_hf to read it from the Hub)"
                if is_hub_repo_id(path) else "")
        raise UsageError(
            f"--checkpoint.initial_load_path {path} does not exist{hint}; fix the path or drop the flag"
        )


def preflight(config: Any, argv: Sequence[str] = ()) -> None:
    """Checks of the user's inputs that need this machine, run before any setup or logging
    (so that the error is the only line printed); `argv`: the command line, to tell what the
    user named from what the recipe set."""
    resolve_model_sources(config, argv)
    check_output_folders(config)
    check_initial_load_path(config)
    if isinstance(config, TrainerConfig):
        from titan.train.data import validate_data_config

        validate_data_config(config.dataset, config.tokenizer)
    check_tokenizer(config)
    check_tokenizer_of_hf_source(config)
    if getattr(config, "quantize", None) is not None:
        check_quantize_installed(config.quantize)  # before the memory check builds the model
    if isinstance(config, RunConfig):  # every loop's config; a plugin's may be anything
        spec = model_spec_for(config)
        spec.check_flavor(config.model.flavor)
        warn_beyond_context(config, getattr(spec.flavors[config.model.flavor], "max_seq_len", None))


def report_native_crashes() -> None:
    """On a fatal signal (a segfault, or an abort such as glibc's on a corrupted heap, in a
    kernel, a collective or an extension) print every thread's Python stack to stderr before
    the process dies: a rank's log then says where it died instead of one line from the C
    library. Left as is where already on (``python -X faulthandler``, pytest) or where stderr
    has no file descriptor to write to."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation, RuntimeError):
        pass


def run(argv: Sequence[str], *, command: str = "train") -> int:
    """Run ``titan train`` / ``titan sft`` / ``titan rl``: parse, check, build the recipe's loop and train."""
    report_native_crashes()
    config = parse_train_args(argv, command=command)
    if fake_backend_requested():
        return dry_run_main(resolve_model_sources(config, argv, weights=False), world_size_from_env())
    preflight(config, argv)
    # Before anything is built: a run that cannot fit never starts.
    memory = check_memory(config) if isinstance(config, RunConfig) else None
    loop = runner_for(config).build(config)
    if memory is not None and getattr(loop, "is_rank0", False):
        log = logging.getLogger("titan")
        if memory.fits:
            log.info(memory.summary())
        else:
            log.warning("%s: running anyway (--debug.skip_memory_check)", memory.summary())
    try:
        loop.train()
    except BaseException:
        # This rank's own error: close without waiting for peers that may be stuck in a
        # collective it will not join (the error, not their timeout, ends the run).
        with leaving_after_failure():
            try:
                loop.close()
            except Exception:  # the run's error is the one to report
                logging.getLogger("titan").warning("closing the run after its error failed too", exc_info=True)
        raise
    loop.close()
    return 0


def train(argv: Sequence[str]) -> int:
    """Run ``titan train``; returns the process exit code."""
    return run(argv, command="train")


def _one_line(err: BaseException) -> str:
    """The error's message on one line (validation messages may list several problems)."""
    text = str(err) or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and "--" not in text:
        text = f"{err.strerror or type(err).__name__}: {err.filename}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line[2:] if line.startswith("- ") else line for line in lines]  # bullet lists
    head, rest = lines[0], lines[1:]
    if rest:
        head = f"{head.rstrip(':')}: {'; '.join(rest)}"
    if not isinstance(err, UsageError) and "--" not in head:
        # Not one of titan's own messages (those name the flag): point to the traceback.
        head += f" (rerun with {TRACEBACK_FLAG} for the traceback)"
    return head


def _exit_code(err: BaseException) -> int | None:
    """The exit code for an error reported as one line, or None for a bug (traceback)."""
    if isinstance(err, (NonFiniteLossError, CheckpointError, CollectiveTimeoutError, PeerLostError)):
        return EXIT_RUN_FAILED
    if isinstance(err, (UsageError, ValueError, MissingExtraError, *PATH_ERRORS)):
        return EXIT_USAGE
    return None


def _report(prog: str, err: BaseException, code: int) -> None:
    """Print the one-line error: on rank 0 only for configuration errors (every rank has the
    same config and fails alike); from every rank, tagged, when the run itself failed."""
    rank = int(os.environ.get("RANK", "0") or 0)
    if code == EXIT_USAGE and rank != 0:
        return
    tag = f"[rank {rank}] " if rank != 0 else ""
    print(f"{prog}: error: {tag}{_one_line(err)}", file=sys.stderr, flush=True)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are :class:`UsageError` (one line, exit code 2)."""

    def error(self, message: str):
        raise UsageError(f"{message}; see `{self.prog} --help`")


def data(argv: Sequence[str]) -> int:
    """Run ``titan data tokenize SRC OUT ...`` (the work is ``titan.train.data.tokenize_corpus``)."""
    parser = _ArgumentParser(prog="titan data")
    actions = parser.add_subparsers(dest="action", required=True)
    p = actions.add_parser(
        "tokenize",
        help="tokenize a corpus once, for --dataset.name tokenized",
        description="Tokenize SRC (local .jsonl/.json/.txt/.parquet files, a folder or glob of "
        "them, or a hub dataset name) into the corpus folder OUT, which training reads with "
        "--dataset.name tokenized --dataset.path OUT. Atomic; rerun the same command to resume.",
    )
    p.add_argument("src", help="local file, folder or glob, or a Hugging Face hub dataset name")
    p.add_argument("out", help="the corpus folder to create")
    p.add_argument("--tokenizer.kind", dest="kind", choices=["byte", "hf"], default="byte")
    p.add_argument("--tokenizer.path", dest="path", help="tokenizer.json, its folder, or a Hub model id (hf)")
    p.add_argument("--tokenizer.revision", dest="revision", help="a Hub id's branch, tag or commit (default main)")
    p.add_argument("--text_field", "--text-field", default="text", help="column with the text")
    p.add_argument("--num_proc", "--num-proc", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: every core)")
    p.add_argument("--format", choices=["text", "json", "parquet"],
                   help="local file format (default: from the file endings)")
    p.add_argument("--split", default="train")
    p.add_argument("--subset", help="hub dataset configuration name")
    p.add_argument("--text_sample_by", "--text-sample-by", default="line",
                   choices=["line", "paragraph", "document"], help="text files: one document per ...")
    p.add_argument("--rows_per_shard", "--rows-per-shard", type=int,
                   help="documents per corpus shard (default 262144; with --streaming, one corpus shard per "
                   "source file)")
    p.add_argument("--streaming", action="store_true",
                   help="stream SRC instead of loading it first (a hub corpus larger than the disk): one corpus "
                   "shard per source file, each tokenized by one process")
    p.add_argument("--cache_dir", "--cache-dir", help="datasets cache (local files: a temporary one)")
    p.add_argument("--no_progress", "--no-progress", action="store_true")
    args = parser.parse_args(list(argv))
    if args.streaming and args.rows_per_shard is not None:
        raise UsageError("--rows_per_shard is not read with --streaming (one corpus shard per source file); "
                         "drop one of them")
    from titan.train.data import TokenizerConfig, tokenize_corpus  # late: --help stays fast
    from titan.train.data.corpus_writer import DEFAULT_ROWS_PER_SHARD

    if args.no_progress:
        import datasets

        datasets.disable_progress_bars()
    tokenizer = TokenizerConfig(kind=args.kind, path=args.path, revision=args.revision)
    resolve_hub_tokenizer(tokenizer)
    manifest = tokenize_corpus(
        args.src, args.out, tokenizer,
        text_field=args.text_field, format=args.format, split=args.split, subset=args.subset,
        text_sample_by=args.text_sample_by, num_proc=args.num_proc,
        rows_per_shard=args.rows_per_shard or DEFAULT_ROWS_PER_SHARD, cache_dir=args.cache_dir,
        progress=not args.no_progress, streaming=args.streaming,
    )
    print(f"{args.out}: {manifest['num_documents']} documents, {manifest['num_tokens']} tokens "
          f"({manifest['dtype']}, {len(manifest['shards'])} shards)")
    return 0


def _dispatch(command: str, rest: list[str]) -> int:
    if command in ("train", "sft", "rl", "dpo", "kto", "reward", "gkd"):
        return run(rest, command=command)
    if command == "dry-run":
        world_size, rest = split_world_size_flag(rest)
        config = resolve_model_sources(parse_train_args(rest), rest, weights=False)
        return dry_run_main(config, world_size or world_size_from_env())
    if command == "plan":
        # The layout and AC flags are the planner's to combine (a schedule without PP picks the
        # pipelined rows; it refuses what it does not rank itself), not the run's.
        from titan.recipes.plan import LAYOUT_FLAGS, TP_ONLY_FLAGS, plan

        # A pipeline split of the run's own pins pipelined layouts (the planner picks their degree).
        exempt = (*LAYOUT_FLAGS, "--parallelism.pipeline_parallel_layers_per_stage",
                  "--parallelism.pipeline_parallel_split_points", "--parallelism.pipeline_parallel_first_stage_less_layers",
                  "--parallelism.pipeline_parallel_last_stage_less_layers", *TP_ONLY_FLAGS)
        def parse(argv: list[str]) -> Any:
            return resolve_model_sources(parse_train_args(argv, exempt_flags=exempt), argv, weights=False)

        return plan(rest, parse)
    if command == "recipes":
        print(recipes_description())
        return 0
    if command == "data":
        return data(rest)
    if command == "plot":
        from titan.train.plot import main as plot_main  # matplotlib loads only for this command

        return plot_main(rest)
    print(f"titan: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``titan`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nRecipes:\n" + recipes_description())
        return 0
    command, rest = args[0], args[1:]
    show_traceback, rest = split_traceback_flag(rest)
    try:
        return _dispatch(command, rest)
    except Exception as err:
        code = _exit_code(err)
        if show_traceback or code is None:
            raise
        _report(f"titan {command}", err, code)
        return code


if __name__ == "__main__":
    sys.exit(main())
