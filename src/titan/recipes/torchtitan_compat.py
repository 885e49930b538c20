"""torchtitan's flag spellings and TOML job files, for users who bring their commands with them.

titan's flags are torchtitan's wherever the feature is the same (``--training.steps``,
``--parallelism.tensor_parallel_degree``, ``--quantize.linear.float8.recipe`` ...). This module
accepts the spellings torchtitan uses, or used in earlier releases, for the rest, and its
``--job.config_file FILE.toml`` (sections of ``key = value`` lines, one section per flag
group), by rewriting them into titan's flags before they are parsed:

- renamed fields (``--training.seed`` -> ``--debug.seed``, ``--checkpoint.enable_checkpoint``
  -> ``--checkpoint.enable``, ``--float8.*`` -> ``--quantize.linear.float8.*`` ...), their
  ``no_`` forms included;
- ``--parallelism.disable_loss_parallel`` (titan's switch is the other way round);
- ``--activation_checkpoint.selective_ac_option op|N`` (titan: ``selective_op``,
  ``selective_layer_every``);
- ``--model.converters float8`` with torchtitan's ``[float8]`` section (tensorwise unless a
  recipe is named; the section's recipe without the converter is refused, since torchtitan
  would not convert either);
- ``--training.dataset`` / ``--training.dataset_path`` and their ``--validation.*`` pair
  (``c4`` is the Hub's ``allenai/c4``, subset ``en``, as in torchtitan);
- ``--model.tokenizer_path`` / ``--model.hf_assets_path`` (a Hugging Face tokenizer);
- ``--model.attn_mask_type causal|block_causal`` (``--training.document_mask`` off / on) and
  ``--model.use_flex_attn`` (a kernel choice: titan's SDPA computes the same attention).

torchtitan fields titan has no feature for are accepted only with the value that asks for
nothing (``--parallelism.enable_compiled_autograd false``); any other value is refused with the
reason, never dropped. Everything else passes through unchanged to titan's parser, which
names unknown flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CompatError(ValueError):
    """A torchtitan flag or TOML file titan cannot honour (one line, for the command line)."""


CONFIG_FILE_FLAG = "--job.config_file"

RENAMED: dict[str, str] = {
    # torchtitan's (or earlier titan's) flag -> titan's flag, the value unchanged.
    "--training.batch_size": "--training.local_batch_size",  # torchtitan before local/global batches
    "--training.seed": "--debug.seed",
    "--training.deterministic": "--debug.deterministic",
    "--training.enable_cpu_offload": "--parallelism.fsdp_cpu_offload",
    "--training.compile": "--compile.enable",
    "--checkpoint.enable_checkpoint": "--checkpoint.enable",
    "--checkpoint.model_weights_only": "--checkpoint.last_save_model_only",
    "--job.print_args": "--job.print_config",
    "--lr_scheduler.lr_min": "--lr_scheduler.min_lr_factor",
    "--validation.enabled": "--validation.enable",
    "--quantize.linear.float8.recipe_name": "--quantize.linear.float8.recipe",
}

RENAMED_SECTIONS: dict[str, str] = {
    "--profiler.": "--profiling.",  # titan's own name for the section before it took torchtitan's
    "--mx.": "--quantize.linear.mx.",  # torchtitan's section before [quantize.linear.mx]
}

INVERTED: dict[str, str] = {
    # torchtitan's switch -> titan's switch meaning the opposite.
    "--parallelism.disable_loss_parallel": "--parallelism.enable_loss_parallel",
}

FLOAT8_SECTION = "--float8."
FLOAT8_FIELDS = {  # torchtitan's [float8] field -> titan's flag
    "recipe_name": "--quantize.linear.float8.recipe",
    "filter_fqns": "--quantize.linear.float8.filter_fqns",
    "enable_fsdp_float8_all_gather": "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp": "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "emulate": "--quantize.linear.float8.emulate",
    # The MoE modules whose grouped GEMMs go float8 (rowwise), under the float8 converter:
    # `moe_fqns` in its DeepSeek-V3 job files, `moe_fqns_prototype` before.
    "moe_fqns": "--quantize.grouped_mm.float8.fqns",
    "moe_fqns_prototype": "--quantize.grouped_mm.float8.fqns",
}
FLOAT8_LISTS = ("filter_fqns", "moe_fqns", "moe_fqns_prototype")
FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")
TITAN_FLOAT8_RECIPE = "--quantize.linear.float8.recipe"

NOTHING_ASKED: dict[str, tuple[tuple[Any, ...], str]] = {
    # torchtitan flag -> (the values that ask for nothing, why titan has no such feature)
    "--job.use_for_integration_test": ((False, True), ""),  # torchtitan's own test registry; no effect on a run
    "--metrics.disable_color_printing": ((False, True), ""),  # titan's logs are plain text either way
    "--model.print_after_conversion": ((False,), "titan logs the converted linears' count, not the model"),
    "--parallelism.enable_compiled_autograd": ((False,), "titan does not run compiled autograd"),
    "--parallelism.expert_tensor_parallel_degree": (("1",), "titan computes each expert whole on its expert-"
                                                    "parallel rank (no tensor parallel inside experts)"),
    "--optimizer.early_step_in_backward": ((False,), "titan steps the optimizer after the backward "
                                           "(gradient clipping needs every gradient)"),
    "--memory_estimation.enabled": ((False,), "titan checks memory before every run; `titan dry-run` "
                                    "prints the estimate without running"),
    "--memory_estimation.disable_fake_mode": ((False,), "see --memory_estimation.enabled"),
    "--checkpoint.enable_first_step_checkpoint": ((False,), "save early with --checkpoint.interval 1"),
    "--float8.force_recompute_fp8_weight_in_bwd": ((False,), "titan's float8 keeps torchao's default: the "
                                                   "float8 weight saved for the backward, not recomputed"),
    "--experimental.custom_import": (("",), "titan's model families are registered as plugins"),
    "--parallelism.expert_parallel_comm_backend": (("standard",), "titan's expert parallel exchanges tokens with "
                                                   "torch.distributed all-to-alls (torchtitan's standard backend), "
                                                   "not DeepEP's or HybridEP's kernels"),
    "--experimental.custom_args_module": (("",), "titan's flags come from the recipe's config type"),
    "--training.max_steps": (("-1",), "titan's LR schedule spans --training.steps"),
    "--parallelism.pipeline_parallel_schedule_csv": (("",), "titan runs torch's named schedules "
                                                     "(--parallelism.pipeline_parallel_schedule)"),
    "--parallelism.context_parallel_load_balancer": (("headtail",), "titan's context parallel balances the causal "
                                                     "load head-and-tail (its default)"),
    "--checkpoint.load_only": ((False,), "titan saves where --checkpoint.enable is on"),
    "--checkpoint.enable_ft_dataloader_checkpoints": ((True,), "titan always checkpoints the data position"),
    "--activation_checkpoint.early_stop": ((False,), "titan's checkpointed blocks recompute their whole forward"),
    "--activation_checkpoint.memory_budget": (("0.5",), "titan has no memory-budget AC mode (--activation_checkpoint"
                                              ".mode none|selective|full)"),
    "--activation_checkpoint.visualize_memory_budget_pareto": ((False,), "titan has no memory-budget AC mode"),
    "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": (
        ("moe.router.gate",), "titan's per-op policy saves a block's matmuls by its own rule"),
    # torchao's kernel choice for a cast (the [mx] section's, renamed with it): the same numbers.
    "--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": (("triton", "cuda", "torch"), ""),
    "--comm.save_traces_folder": (("comm_traces",), "titan writes the flight recorder's traces to "
                                  "<dump_folder>/comm_traces"),
    "--fault_tolerance.process_group": (("gloo", "nccl"), ""),  # titan picks the device's backend
    "--fault_tolerance.process_group_timeout_ms": (("10000",), "titan's replica group times out after "
                                                   "--comm.train_timeout_seconds"),
    "--fault_tolerance.semi_sync_method": (("", "None"), "titan's replicas synchronize every step (no LocalSGD or "
                                           "DiLoCo)"),
    "--fault_tolerance.sync_steps": (("5",), "see --fault_tolerance.semi_sync_method"),
    "--fault_tolerance.should_quantize": ((False,), "see --fault_tolerance.semi_sync_method"),
    "--fault_tolerance.fragment_sync_delay": (("0",), "see --fault_tolerance.semi_sync_method"),
    "--fault_tolerance.fragment_update_alpha": (("0.0", "0"), "see --fault_tolerance.semi_sync_method"),
    # Its full-bf16 training (parameters, gradients and optimizer states in bf16, no fp32 copy).
    "--training.dtype": (("float32",), "titan keeps parameters, gradients and optimizer states in float32 and "
                         "computes in --training.mixed_precision_param bfloat16 (mixed precision)"),
}

JOB_FILE_DEFAULTS: tuple[str, ...] = (
    # What a torchtitan job file leaves out means torchtitan's default (its JobConfig), not the
    # CPU debug recipe's: a file written for torchtitan trains the same way here. The fields
    # that shape the training, in titan's spelling, applied under the file (--config RECIPE
    # given explicitly keeps that recipe's values instead).
    "--optimizer.lr", "8e-4", "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.95",
    "--optimizer.eps", "1e-8", "--optimizer.weight_decay", "0.1", "--optimizer.weight_decay_exempt", "none",
    "--lr_scheduler.warmup_steps", "200", "--lr_scheduler.decay_ratio", "None",
    "--lr_scheduler.decay_type", "linear", "--lr_scheduler.min_lr_factor", "0.0",
    "--training.local_batch_size", "8", "--training.global_batch_size", "-1",
    "--training.seq_len", "2048", "--training.max_norm", "1.0", "--training.steps", "10000",
    "--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32",
    "--training.gc_freq", "50",
    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_layer_every", "2",
    "--activation_checkpoint.no_selective_op",
    "--metrics.log_freq", "10",
    "--checkpoint.interval", "500", "--checkpoint.last_save_model_only", "--checkpoint.keep_latest_k", "10",
    "--checkpoint.export_dtype", "float32",
    "--validation.steps", "-1",  # torchtitan validates on the whole held-out split by default
    # Its even pipeline split counts the embedding and the output as a block each (split
    # points, which name every stage's blocks, leave these unread).
    "--parallelism.pipeline_parallel_first_stage_less_layers", "1",
    "--parallelism.pipeline_parallel_last_stage_less_layers", "1",
)

SPLIT_POINTS_FLAG = "--parallelism.pipeline_parallel_split_points"

DATASET_FLAGS = {  # torchtitan flag -> (titan's dataset section, what it sets)
    "--training.dataset": ("--dataset", "name"),
    "--training.dataset_path": ("--dataset", "path"),
    "--validation.dataset": ("--validation.dataset", "name"),
    "--validation.dataset_path": ("--validation.dataset", "path"),
}

HUB_DATASETS = {  # torchtitan's dataset names -> (Hub name, subset, split), streamed as torchtitan does
    "c4": ("allenai/c4", "en", "train"),
    "c4_validation": ("allenai/c4", "en", "validation"),
}

TOKENIZER_FLAGS = ("--model.tokenizer_path", "--model.hf_assets_path")


def _split(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """argv as (flag, its values) pairs; ``--flag=value`` split; tokens before any flag are
    kept as flagless pairs so that the parser reports them."""
    pairs: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            pairs.append((flag, [value] if eq else []))
        elif pairs:
            pairs[-1][1].append(token)
        else:
            pairs.append(("", [token]))
    return pairs


def _bool_form(flag: str) -> tuple[str, bool]:
    """``--a.no_b`` -> (``--a.b``, False); ``--a.b`` -> (``--a.b``, True)."""
    section, dot, name = flag.rpartition(".")
    if name.startswith("no_"):
        return f"{section}{dot}{name[3:]}", False
    return flag, True


def _as_bool(flag: str, values: list[str]) -> bool:
    """A switch given bare (True), as ``--a.no_b`` (handled by the caller) or with a value."""
    if not values:
        return True
    text = values[0].lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise CompatError(f"{flag} takes true or false, got {values[0]!r}")


def _switch(flag: str, on: bool) -> str:
    section, dot, name = flag.rpartition(".")
    return flag if on else f"{section}{dot}no_{name}"


def _list_values(values: list[str]) -> list[str]:
    """torchtitan takes lists comma-separated on its command line; titan space-separated."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _selective_ac(values: list[str]) -> list[str]:
    option = values[0] if values else ""
    if option == "op":
        return ["--activation_checkpoint.selective_op"]
    if option.isdigit() and int(option) >= 1:
        return ["--activation_checkpoint.selective_layer_every", option, "--activation_checkpoint.no_selective_op"]
    raise CompatError(f"--activation_checkpoint.selective_ac_option takes 'op' or a positive integer "
                      f"(checkpoint every N-th block), got {option!r}")


def _attention_mask(values: list[str]) -> list[str]:
    """torchtitan's ``attn_mask_type``: ``causal`` over the packed row, or ``block_causal``,
    causal within each packed document (titan's ``--training.document_mask``; titan also
    restarts RoPE positions per document, which changes no attention score: RoPE's scores
    depend on the distance between tokens only)."""
    mask = values[0] if values else ""
    if mask == "causal":
        return ["--training.no_document_mask"]
    if mask == "block_causal":
        return ["--training.document_mask"]
    raise CompatError(f"--model.attn_mask_type takes causal or block_causal, got {mask!r}")


def _dataset_flags(section: str, name: str | None, path: str | None) -> list[str]:
    """titan's flags for torchtitan's dataset name and local path."""
    label = "--training" if section == "--dataset" else "--validation"
    if name == "c4_test":
        if not path:
            raise CompatError(f"{label}.dataset c4_test is a sample in torchtitan's repository; set "
                              f"{label}.dataset_path to a copy of its files, or use {section}.name synthetic "
                              "or stdlib")
        return [f"{section}.name", path]
    hub = HUB_DATASETS.get(name or "")
    if hub is None:
        if path:  # torchtitan reads the named dataset from this local copy
            return [f"{section}.name", path]
        return [f"{section}.name", name] if name else []
    repo, subset, split = hub
    # torchtitan streams c4 (from the Hub or its local copy) rather than downloading it first.
    return [f"{section}.name", path or repo, f"{section}.subset", subset, f"{section}.split", split,
            f"{section}.streaming"]


def _nothing_asked(flag: str, values: list[str]) -> None:
    """Accept a torchtitan-only field set to the value that asks for nothing; refuse others."""
    base, on = _bool_form(flag)
    accepted, why = NOTHING_ASKED[base]
    if isinstance(accepted[0], bool):
        given: Any = on and _as_bool(flag, values)
    else:
        given = values[0] if values else ""
    if given not in accepted:
        raise CompatError(f"{base} = {given!r} (torchtitan) has no titan equivalent: {why}; remove it")


def _float8_flags(float8: dict[str, list[str]], converters: list[str] | None, *, default_recipe: bool) -> list[str]:
    """torchtitan's [float8] section: read when the float8 converter is on, as torchtitan does;
    the converter alone means tensorwise (torchtitan's default) unless ``default_recipe`` is off."""
    wants = converters is not None and any(c in FLOAT8_CONVERTERS for c in converters)
    if not wants:
        if "recipe_name" in float8 and _list_values(float8["recipe_name"]):
            raise CompatError("--float8.recipe_name is read only with --model.converters float8 (torchtitan's "
                              "rule); add the converter, or use titan's --quantize.linear.float8.recipe")
        float8 = {k: v for k, v in float8.items() if k == "filter_fqns"}  # harmless without a recipe
    out = []
    if wants and default_recipe and "recipe_name" not in float8:
        out += ["--quantize.linear.float8.recipe", "tensorwise"]  # torchtitan's default recipe
    for name, values in float8.items():
        target = FLOAT8_FIELDS[name]
        if name in FLOAT8_LISTS:
            if name != "filter_fqns" and not _list_values(values):
                continue  # no MoE module named: nothing asked
            out += [target, *_list_values(values)]
        elif name == "recipe_name":
            out += [target, *values]
        else:
            out.append(_switch(target, _as_bool(name, values)))
    return out


def _converters(values: list[str]) -> list[str]:
    converters = _list_values(values)
    for converter in converters:
        if converter not in FLOAT8_CONVERTERS:
            raise CompatError(f"--model.converters {converter}: titan converts linears to float8 "
                              "(--model.converters float8, or --quantize.linear.float8.recipe) and to MXFP8 "
                              "(--quantize.linear.mx.recipe_name); name one of those")
    return converters


@dataclass
class _Groups:
    """Flags that only mean something together, gathered over the TOML file and the command
    line (the command line's value of a field wins) and emitted once."""

    datasets: dict[str, dict[str, str]] = field(default_factory=dict)
    float8: dict[str, list[str]] = field(default_factory=dict)
    converters: list[str] | None = None
    titan_recipe: bool = False
    """Whether titan's own --quantize.linear.float8.recipe was given (then the converter adds
    no default recipe)."""

    def flags(self) -> list[str]:
        out: list[str] = []
        for section, given in self.datasets.items():
            out += _dataset_flags(section, given.get("name"), given.get("path"))
        if self.float8 or self.converters is not None:
            out += _float8_flags(self.float8, self.converters, default_recipe=not self.titan_recipe)
        return out


def _translate_into(argv: Sequence[str], groups: _Groups) -> list[str]:
    """titan's flags for ``argv``, in order, except the grouped ones (gathered in ``groups``)."""
    out: list[str] = []
    for flag, values in _split(argv):
        base, on = _bool_form(flag)
        for old, new in RENAMED_SECTIONS.items():
            if flag.startswith(old):
                flag, base = new + flag[len(old):], new + base[len(old):]
        if base in RENAMED:
            flag = _switch(RENAMED[base], on)
            out += [flag, *values]
            groups.titan_recipe |= flag == TITAN_FLOAT8_RECIPE
        elif base in INVERTED:
            out.append(_switch(INVERTED[base], not (on and _as_bool(base, values))))
        elif flag == "--activation_checkpoint.selective_ac_option":
            out += _selective_ac(values)
        elif flag == "--model.converters":
            groups.converters = _converters(values)
        elif base.startswith(FLOAT8_SECTION) and base[len(FLOAT8_SECTION):] in FLOAT8_FIELDS:
            groups.float8[base[len(FLOAT8_SECTION):]] = values if on else ["false"]
        elif flag in DATASET_FLAGS:
            section, key = DATASET_FLAGS[flag]
            groups.datasets.setdefault(section, {})[key] = values[0] if values else ""
        elif flag in TOKENIZER_FLAGS:
            out += ["--tokenizer.kind", "hf", "--tokenizer.path", *values]
        elif base == "--model.use_flex_attn":
            pass  # the kernel only: titan's SDPA computes the same attention
        elif flag == "--model.attn_mask_type":
            out += _attention_mask(values)
        elif base in NOTHING_ASKED:
            _nothing_asked(flag, values)
        elif flag in COMMA_LISTS:
            out += [flag, *_list_values(values)]
        else:
            out += ([flag] if flag else []) + values
            groups.titan_recipe |= flag == TITAN_FLOAT8_RECIPE
    return out


COMMA_LISTS = frozenset({
    # titan's lists of names that torchtitan's command line takes comma-separated
    # ("--checkpoint.exclude_from_loading optimizer,lr_scheduler"); titan's own spelling,
    # space-separated, passes through unchanged. Free-text lists (stop strings) are not here.
    "--checkpoint.exclude_from_loading", "--compile.components", "--parallelism.pipeline_parallel_split_points",
    "--quantize.linear.float8.filter_fqns", "--quantize.linear.mx.filter_fqns", "--quantize.grouped_mm.float8.fqns",
    "--quantize.grouped_mm.mx.fqns",
})


def translate(argv: Sequence[str], *, defaults: Sequence[str] = ()) -> list[str]:
    """Rewrite torchtitan's spellings into titan's flags (module docstring): ``defaults`` (a
    TOML file's flags) first, then the grouped flags of both, then ``argv``, so that the
    command line overrides the file. Raises :class:`CompatError`."""
    groups = _Groups()
    first = _translate_into(defaults, groups)
    last = _translate_into(argv, groups)
    return [*first, *groups.flags(), *last]


def _toml_module():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise CompatError(f"{CONFIG_FILE_FLAG} reads TOML: needs Python >= 3.11 or `pip install tomli`") from None
    return tomllib


MODULES_PER_STAGE_FLAG = "--parallelism.module_fqns_per_model_part"
FIRST_STAGE_MODULES, LAST_STAGE_MODULES = ("tok_embeddings",), ("norm", "output", "lm_head")


def _split_points_of(stages: Any) -> list[str]:
    """torchtitan's ``module_fqns_per_model_part`` (each pipeline stage's modules, e.g.
    ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``) as titan's split
    points (the first block of every stage but the first); refused unless the stages hold
    consecutive blocks in order, the embedding on the first and the output on the last."""
    flag = MODULES_PER_STAGE_FLAG[2:]
    if not (isinstance(stages, list) and len(stages) > 1 and all(isinstance(s, list) and s for s in stages)):
        raise CompatError(f"{flag} = {stages!r}: give a list of at least two non-empty lists of module names")
    starts, expected = [], 0
    for index, modules in enumerate(stages):
        blocks = []
        for name in modules:
            head, _, number = str(name).partition(".")
            if head == "layers" and number.isdigit():
                blocks.append(int(number))
            elif not ((index == 0 and name in FIRST_STAGE_MODULES)
                      or (index == len(stages) - 1 and name in LAST_STAGE_MODULES)):
                raise CompatError(f"{flag}: stage {index} holds {name!r}; titan splits at blocks only, with "
                                  "tok_embeddings on the first stage and norm/output on the last")
        if not blocks or blocks != list(range(expected, expected + len(blocks))):
            raise CompatError(f"{flag}: stage {index} holds blocks {blocks}, not the next consecutive ones from "
                              f"layers.{expected}; every stage runs a run of consecutive blocks")
        starts.append(f"layers.{blocks[0]}")
        expected += len(blocks)
    return starts[1:]


def _toml_value_tokens(flag: str, value: Any) -> list[str]:
    if flag == MODULES_PER_STAGE_FLAG:
        return [SPLIT_POINTS_FLAG, *_split_points_of(value)]
    if isinstance(value, bool):
        return [_switch(flag, value)]
    if isinstance(value, (int, float, str)):
        return [flag, str(value)]
    if isinstance(value, list) and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
        return [flag, *map(str, value)]
    raise CompatError(f"{flag[2:]} = {value!r} in the TOML file: titan's flags take booleans, numbers, "
                      "strings and lists of those")


def _flatten(table: dict[str, Any], prefix: str = "") -> list[str]:
    tokens: list[str] = []
    for key, value in table.items():
        if isinstance(value, dict):
            tokens += _flatten(value, f"{prefix}{key}.")
        elif not prefix:
            raise CompatError(f"{key} = {value!r} is outside any [section] of the TOML file; put it under "
                              "the section of its flag (e.g. steps under [training])")
        else:
            tokens += _toml_value_tokens(f"--{prefix}{key}", value)
    return tokens


def toml_flags(path: str) -> list[str]:
    """The flags a torchtitan-style TOML job file sets, in titan's (or torchtitan's) spelling:
    ``[section] key = value`` -> ``--section.key value``; booleans as switches."""
    file = Path(path)
    if not file.is_file():
        raise CompatError(f"{CONFIG_FILE_FLAG} {path}: no such file")
    try:
        table = _toml_module().loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise CompatError(f"{CONFIG_FILE_FLAG} {path} is not UTF-8 text ({err.reason})") from None
    except ValueError as err:  # tomllib.TOMLDecodeError
        raise CompatError(f"{CONFIG_FILE_FLAG} {path} is not valid TOML: {err}") from None
    tokens = _flatten(table)
    if any(t == CONFIG_FILE_FLAG for t in tokens):
        raise CompatError(f"{path} sets [job] config_file itself; one TOML file per run")
    return tokens


def split_config_file(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull ``--job.config_file PATH`` (or ``=PATH``) out of argv: (the path, the rest)."""
    path, rest, args = None, [], list(argv)
    i = 0
    while i < len(args):
        if args[i] == CONFIG_FILE_FLAG:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise CompatError(f"{CONFIG_FILE_FLAG} needs the path of a TOML file")
            path, i = args[i + 1], i + 2
            continue
        if args[i].startswith(CONFIG_FILE_FLAG + "="):
            path = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return path, rest


def titan_argv(argv: Sequence[str], *, job_file_defaults: bool = False) -> list[str]:
    """The flags titan parses for ``argv``: the TOML file's first (``--job.config_file``), then
    the command line's, which override them, with torchtitan's spellings translated. With
    ``job_file_defaults`` a TOML file's omissions take torchtitan's defaults
    (`JOB_FILE_DEFAULTS`, under the file's own flags)."""
    path, rest = split_config_file(argv)
    if not path:
        return translate(rest)
    return translate(rest, defaults=[*(JOB_FILE_DEFAULTS if job_file_defaults else ()), *toml_flags(path)])
