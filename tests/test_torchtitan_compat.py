"""torchtitan's flag spellings and TOML job files (`titan.recipes.torchtitan_compat`): each
spelling lands on the titan field torchtitan means, conflicts and titan-less features are
refused with the reason, and a torchtitan-style TOML trains through `titan train`."""

import json

import pytest
from forked_cli import run_titan

from titan.recipes.cli import UsageError, parse_train_args
from titan.recipes.torchtitan_compat import translate

# A job file in torchtitan's layout (the sections and keys of its Llama 3 TOMLs), made small:
# the spellings torchtitan uses where titan's differ are the point.
TORCHTITAN_TOML = """\
[job]
dump_folder = "{dump}"
description = "Llama 3 debug training, torchtitan's job file"
print_args = false
use_for_integration_test = true

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false

[model]
name = "llama3"
flavor = "debugmodel_tiny"
hf_assets_path = "{assets}"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
lr_min = 0.1

[training]
local_batch_size = 2
seq_len = 32
max_norm = 1.0
steps = 10
compile = false
seed = 3
deterministic = true

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
disable_loss_parallel = true
enable_compiled_autograd = false

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[compile]
enable = false
components = ["model", "loss"]

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = "output"

[validation]
enabled = false
dataset = "c4_validation"
freq = 5
steps = 10
"""


def toml_file(tmp_path, text=TORCHTITAN_TOML, name="llama3_debug.toml"):
    path = tmp_path / name
    path.write_text(text.format(dump=tmp_path / "out", assets=tmp_path / "assets"))
    return path


def write_tokenizer(folder):
    """A real tokenizer.json in `folder` (torchtitan's hf_assets_path layout): a byte-level BPE
    trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, trainer=trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))


def parsed(*flags):
    return parse_train_args(["--config", "llama3_debug", *flags])


@pytest.mark.parametrize("flags, field, expected", [
    (["--training.seed", "7"], "debug.seed", 7),
    (["--training.seed=7"], "debug.seed", 7),
    (["--training.batch_size", "3"], "training.local_batch_size", 3),
    (["--checkpoint.enable_checkpoint", "--checkpoint.model_weights_only"], "checkpoint.last_save_model_only", True),
    (["--training.deterministic"], "debug.deterministic", True),
    (["--training.enable_cpu_offload"], "parallelism.fsdp_cpu_offload", True),
    (["--training.compile"], "compile.enable", True),
    (["--checkpoint.enable_checkpoint"], "checkpoint.enable", True),
    (["--checkpoint.enable_checkpoint", "--checkpoint.no_enable_checkpoint"], "checkpoint.enable", False),
    (["--job.print_args"], "job.print_config", True),
    (["--lr_scheduler.lr_min", "0.1"], "lr_scheduler.min_lr_factor", 0.1),
    (["--validation.enabled"], "validation.enable", True),
    # (with the switch they need: without it titan refuses them as having no effect)
    (["--profiling.enable_profiling", "--profiling.profile_freq", "5"], "profiling.profile_freq", 5),
    (["--profiler.enable_profiling", "--profiler.profile_freq", "5"], "profiling.profile_freq", 5),  # earlier name
    (["--parallelism.disable_loss_parallel"], "parallelism.enable_loss_parallel", False),
    (["--parallelism.no_disable_loss_parallel"], "parallelism.enable_loss_parallel", True),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
     "activation_checkpoint.selective_op", True),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
     "activation_checkpoint.selective_layer_every", 2),
    (["--model.converters", "float8"], "quantize.linear.float8.recipe", "tensorwise"),
    (["--model.converters", "float8", "--float8.recipe_name", "rowwise"], "quantize.linear.float8.recipe", "rowwise"),
    (["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"],
     "quantize.linear.float8.recipe", "rowwise"),
    (["--model.converters", "float8", "--float8.filter_fqns", "attention.wq,output"],
     "quantize.linear.float8.filter_fqns", ["attention.wq", "output"]),
    (["--float8.filter_fqns", "output"], "quantize.linear.float8.recipe", None),  # no converter: no float8
    (["--training.dataset", "c4"], "dataset.name", "allenai/c4"),
    (["--training.dataset", "c4"], "dataset.subset", "en"),
    (["--training.dataset", "c4"], "dataset.streaming", True),  # torchtitan streams c4
    (["--validation.enabled", "--validation.dataset", "c4_validation"], "validation.dataset.streaming", True),
    (["--training.dataset", "c4_test", "--training.dataset_path", "/data/c4_test"], "dataset.streaming", False),
    (["--training.dataset", "c4", "--training.dataset_path", "/data/c4"], "dataset.name", "/data/c4"),
    (["--validation.enabled", "--validation.dataset", "c4_validation"], "validation.dataset.split", "validation"),
    (["--validation.enabled", "--validation.local_batch_size", "4"], "validation.local_batch_size", 4),
    (["--validation.enabled", "--validation.seq_len", "1024"], "validation.seq_len", 1024),
    (["--validation.enabled", "--validation.steps", "-1"], "validation.steps", -1),
    (["--activation_checkpoint.mode", "full", "--activation_checkpoint.preserve_rng_state"],
     "activation_checkpoint.preserve_rng_state", True),
    (["--debug.moe_force_load_balance"], "debug.moe_force_load_balance", True),
    (["--parallelism.expert_parallel_comm_backend", "standard"], "parallelism.expert_parallel_degree", 1),
    (["--model.hf_assets_path", "assets/hf/Llama-3.1-8B"], "tokenizer.path", "assets/hf/Llama-3.1-8B"),
    (["--model.tokenizer_path", "tok/tokenizer.json"], "tokenizer.kind", "hf"),
    (["--parallelism.no_enable_compiled_autograd"], "parallelism.enable_compiled_autograd", None),
    (["--parallelism.expert_tensor_parallel_degree", "1"], "parallelism.expert_tensor_parallel_degree", None),
    (["--float8.force_recompute_fp8_weight_in_bwd", "false"], "float8.force_recompute_fp8_weight_in_bwd", None),
    (["--training.dtype", "float32"], "training.dtype", None),
    # Lists of names, comma-separated on torchtitan's command line (its documented spelling).
    (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"],
     "checkpoint.exclude_from_loading", ["optimizer", "lr_scheduler"]),
    (["--compile.enable", "--compile.components", "model,loss"], "compile.components", ["model", "loss"]),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"],
     "parallelism.pipeline_parallel_split_points", ["layers.2", "layers.4"]),
    (["--mx.recipe_name", "mxfp8_emulated_rceil", "--mx.filter_fqns", "output,attention.wq"],
     "quantize.linear.mx.filter_fqns", ["output", "attention.wq"]),
    # The MoE experts' float8 grouped GEMMs: `moe_fqns` (its DeepSeek-V3 job files), earlier
    # `moe_fqns_prototype`; read under the float8 converter only, as torchtitan does.
    (["--model.converters", "float8", "--float8.moe_fqns", "experts"], "quantize.grouped_mm.float8.fqns", ["experts"]),
    (["--model.converters", "float8", "--float8.moe_fqns_prototype", "experts"], "quantize.grouped_mm.float8.fqns",
     ["experts"]),
    (["--float8.moe_fqns", "experts"], "quantize.grouped_mm.float8.fqns", []),
    # Its attention masks: block_causal attends within each packed document.
    (["--model.use_flex_attn", "--model.attn_mask_type", "block_causal"], "training.document_mask", True),
    (["--model.use_flex_attn", "--model.attn_mask_type", "causal"], "training.document_mask", False),
    (["--model.no_use_flex_attn"], "training.document_mask", False),
])
def test_a_torchtitan_spelling_sets_the_field_it_means(flags, field, expected):
    config = parsed(*flags)
    if field in ("parallelism.enable_compiled_autograd", "parallelism.expert_tensor_parallel_degree",
                 "float8.force_recompute_fp8_weight_in_bwd", "training.dtype"):
        # accepted (asks for nothing), not a titan field
        assert translate(flags) == []
        return
    value = config
    for part in field.split("."):
        value = getattr(value, part)
    assert value == expected


def test_an_every_nth_block_option_is_not_per_op():
    config = parsed("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "3")
    assert (config.activation_checkpoint.selective_layer_every, config.activation_checkpoint.selective_op) == (3, False)


@pytest.mark.parametrize("flags, message", [
    (["--float8.recipe_name", "rowwise"], "only with --model.converters float8"),
    (["--model.converters", "mx"], "--quantize.linear.mx.recipe_name"),
    (["--activation_checkpoint.selective_ac_option", "every"], "'op' or a positive integer"),
    (["--activation_checkpoint.selective_ac_option", "0"], "'op' or a positive integer"),
    (["--parallelism.enable_compiled_autograd"], "no titan equivalent: titan does not run compiled autograd"),
    (["--optimizer.early_step_in_backward"], "no titan equivalent"),
    (["--parallelism.expert_parallel_comm_backend", "deepep"], "not DeepEP's or HybridEP's kernels"),
    (["--parallelism.expert_tensor_parallel_degree", "2"], "no tensor parallel inside experts"),
    (["--experimental.custom_import", "my.models"], "no titan equivalent"),
    (["--training.dataset", "c4_test"], "--training.dataset_path"),
    (["--parallelism.disable_loss_parallel", "maybe"], "takes true or false"),
    (["--float8.force_recompute_fp8_weight_in_bwd"], "no titan equivalent"),
    (["--model.attn_mask_type", "sliding"], "causal or block_causal"),
    (["--training.dtype", "bfloat16"], "computes in --training.mixed_precision_param bfloat16 (mixed precision)"),
    (["--training.max_steps", "100"], "titan's LR schedule spans --training.steps"),
    (["--activation_checkpoint.memory_budget", "0.3"], "no memory-budget AC mode"),
    (["--fault_tolerance.semi_sync_method", "diloco"], "no LocalSGD or DiLoCo"),
    (["--parallelism.context_parallel_load_balancer", "ptrr"], "head-and-tail"),
    (["--checkpoint.no_enable_ft_dataloader_checkpoints"], "always checkpoints the data position"),
])

def test_what_titan_cannot_honour_is_refused_with_the_reason(flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parsed(*flags)

@pytest.mark.parametrize("flags", [
    # torchtitan's fields at the values that ask for nothing titan lacks: accepted, dropped.
    ["--training.max_steps", "-1"], ["--parallelism.pipeline_parallel_schedule_csv", ""],
    ["--parallelism.context_parallel_load_balancer", "headtail"], ["--checkpoint.no_load_only"],
    ["--checkpoint.enable_ft_dataloader_checkpoints"], ["--activation_checkpoint.no_early_stop"],
    ["--activation_checkpoint.memory_budget", "0.5"], ["--activation_checkpoint.no_visualize_memory_budget_pareto"],
    ["--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "moe.router.gate"],
    ["--mx.mxfp8_dim1_cast_kernel_choice", "triton"], ["--comm.save_traces_folder", "comm_traces"],
    ["--fault_tolerance.process_group", "nccl"], ["--fault_tolerance.process_group_timeout_ms", "10000"],
    ["--fault_tolerance.sync_steps", "5"], ["--fault_tolerance.no_should_quantize"],
    ["--fault_tolerance.fragment_sync_delay", "0"], ["--fault_tolerance.fragment_update_alpha", "0.0"],
])
def test_torchtitan_fields_at_values_that_ask_for_nothing_are_accepted(flags):
    assert translate(flags) == []
    parsed(*flags)


def test_a_torchtitan_job_file_sets_every_field_and_the_command_line_overrides_it(tmp_path):
    config = parsed("--job.config_file", str(toml_file(tmp_path)), "--training.steps", "4", "--debug.seed", "9")
    assert config.job.dump_folder == str(tmp_path / "out")
    assert (config.model.name, config.model.flavor) == ("llama3", "debugmodel_tiny")
    assert (config.optimizer.lr, config.optimizer.eps) == (8e-4, 1e-8)
    assert (config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_ratio, config.lr_scheduler.min_lr_factor) == (2, 0.8, 0.1)
    assert (config.training.local_batch_size, config.training.seq_len, config.training.max_norm) == (2, 32, 1.0)
    assert config.training.steps == 4  # the command line wins over the file's 10
    assert config.debug.seed == 9 and config.debug.deterministic  # [training] seed / deterministic
    assert config.parallelism.data_parallel_shard_degree == -1
    assert not config.parallelism.enable_loss_parallel  # disable_loss_parallel = true
    assert not config.checkpoint.enable and config.checkpoint.interval == 500
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.selective_op) == ("selective", True)
    assert config.quantize.linear.float8.recipe is None  # [float8] without the converter: off, as in torchtitan
    assert (config.profiling.profile_freq, config.profiling.save_traces_folder) == (100, "profile_trace")
    assert not config.compile.enable and config.compile.components == ["model", "loss"]
    assert (config.tokenizer.kind, config.tokenizer.path) == ("hf", str(tmp_path / "assets"))
    assert config.quantize.linear.float8.filter_fqns == ["output"]
    assert not config.validation.enable and config.validation.dataset.name == "allenai/c4"
    assert (config.validation.dataset.split, config.validation.freq) == ("validation", 5)


# torchtitan's JobConfig defaults (torchtitan/config/job_config.py, the TOML-era releases) for
# the fields that shape training, by titan's field.
TORCHTITAN_DEFAULTS = {
    "optimizer.lr": 8e-4, "optimizer.beta1": 0.9, "optimizer.beta2": 0.95, "optimizer.eps": 1e-8,
    "optimizer.weight_decay": 0.1, "optimizer.weight_decay_exempt": [],  # every parameter decays
    "lr_scheduler.warmup_steps": 200, "lr_scheduler.decay_ratio": None, "lr_scheduler.decay_type": "linear",
    "lr_scheduler.min_lr_factor": 0.0,
    "training.local_batch_size": 8, "training.global_batch_size": -1, "training.seq_len": 2048,
    "training.max_norm": 1.0, "training.steps": 10000, "training.mixed_precision_param": "bfloat16",
    "training.mixed_precision_reduce": "float32", "training.gc_freq": 50, "compile.enable": False,
    "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_layer_every": 2,
    "activation_checkpoint.selective_op": False,
    "parallelism.data_parallel_replicate_degree": 1, "parallelism.data_parallel_shard_degree": -1,
    "parallelism.tensor_parallel_degree": 1, "parallelism.pipeline_parallel_degree": 1,
    "parallelism.pipeline_parallel_schedule": "1F1B", "parallelism.pipeline_parallel_microbatch_size": 1,
    "parallelism.context_parallel_degree": 1, "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.pipeline_parallel_first_stage_less_layers": 1, "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "metrics.log_freq": 10, "validation.steps": -1,
    "checkpoint.enable": False, "checkpoint.folder": "checkpoint", "checkpoint.interval": 500,
    "checkpoint.last_save_model_only": True, "checkpoint.export_dtype": "float32", "checkpoint.keep_latest_k": 10,
    "checkpoint.async_mode": "disabled", "checkpoint.initial_load_model_only": True,
}


def _field(config, dotted):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def test_what_a_job_file_leaves_out_takes_torchtitans_default(tmp_path):
    """A torchtitan job file trains as in torchtitan: e.g. in bfloat16 and with the LR decaying
    right after warmup, though the file says neither (the CPU debug recipe computes in float32
    and decays over the last 20%). An explicitly named recipe keeps its own values."""
    path = tmp_path / "job.toml"
    path.write_text('[model]\nflavor = "debugmodel_tiny"\n[training]\nsteps = 30\n')
    config = parse_train_args(["--job.config_file", str(path)])
    wrong = {f: _field(config, f) for f, v in TORCHTITAN_DEFAULTS.items() if f != "training.steps" and _field(config, f) != v}
    assert not wrong, wrong
    assert (config.training.steps, config.model.flavor) == (30, "debugmodel_tiny")  # the file's own
    recipe = parse_train_args(["--config", "llama3_debug", "--job.config_file", str(path)])
    assert (recipe.training.mixed_precision_param, recipe.lr_scheduler.decay_ratio) == ("float32", 0.2)


def test_a_job_file_with_split_points_splits_only_there(tmp_path):
    """torchtitan's stage weights apply to its even split; explicit split points (in the file or
    on the command line) name every stage, so the defaulted weights are left out, not refused."""
    path = tmp_path / "job.toml"
    path.write_text('[model]\nflavor = "debugmodel_tiny"\n[parallelism]\npipeline_parallel_degree = 2\n'
                    'pipeline_parallel_split_points = ["layers.1"]\n')
    from titan.dist.pipeline import stage_layer_keys

    config = parse_train_args(["--job.config_file", str(path)])
    assert config.parallelism.pipeline_parallel_split_points == ["layers.1"]
    keys = [str(i) for i in range(4)]
    assert stage_layer_keys(keys, 2, config.parallelism) == [["0"], ["1", "2", "3"]]  # the points, unweighted
    path.write_text('[model]\nflavor = "debugmodel_tiny"\n')
    config = parse_train_args(["--job.config_file", str(path), "--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_split_points", "layers.1"])
    assert stage_layer_keys(keys, 2, config.parallelism) == [["0"], ["1", "2", "3"]]


def test_the_converter_in_the_file_and_the_recipe_on_the_command_line_combine(tmp_path):
    text = TORCHTITAN_TOML.replace('flavor = "debugmodel_tiny"', 'flavor = "debugmodel_tiny"\nconverters = ["float8"]')
    config = parsed("--job.config_file", str(toml_file(tmp_path, text)), "--float8.recipe_name", "rowwise")
    assert config.quantize.linear.float8.recipe == "rowwise"
    assert config.quantize.linear.float8.filter_fqns == ["output"]


def test_the_newer_quantize_section_names_the_recipe_the_converter_uses(tmp_path):
    text = TORCHTITAN_TOML.replace('flavor = "debugmodel_tiny"', 'flavor = "debugmodel_tiny"\nconverters = ["quantize.linear.float8"]')
    text += '\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n'
    assert parsed("--job.config_file", str(toml_file(tmp_path, text))).quantize.linear.float8.recipe == "rowwise"
    assert parsed("--model.converters", "float8", "--quantize.linear.float8.recipe", "rowwise").quantize.linear.float8.recipe == "rowwise"


@pytest.mark.parametrize("text, message", [
    (None, "no such file"),
    ("[training\nsteps = 3\n", "is not valid TOML"),
    ("steps = 3\n", "outside any \\[section\\]"),
    ("[training]\nsteps = 3\nwarmup_fraction = 50\n", "unrecognized flag --training.warmup_fraction"),
    ("[training]\nstart = 1979-05-27\n", "take booleans, numbers"),
    ("[job]\nconfig_file = \"other.toml\"\n", "one TOML file per run"),
])
def test_a_bad_job_file_is_one_line_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "job.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=message):
        parsed("--job.config_file", str(path))


def test_titan_train_runs_a_torchtitan_job_file(tmp_path):
    """The whole command: the file's model, schedule and seed train (its `steps` overridden)."""
    path = toml_file(tmp_path)
    write_tokenizer(tmp_path / "assets")
    result = run_titan(["train", "--config", "llama3_debug", "--job.config_file", path, "--training.steps", "3",
                        "--metrics.no_enable_progress_bar"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model"]["flavor"] == "debugmodel_tiny" and config["debug"]["seed"] == 3
    assert config["lr_scheduler"]["min_lr_factor"] == 0.1
    assert config["tokenizer"]["path"] == str(tmp_path / "assets")


def test_modules_per_stage_become_split_points(tmp_path):
    """torchtitan's `module_fqns_per_model_part` (each stage's modules) is titan's split points;
    stages that are not consecutive runs of blocks are refused by name."""
    from titan.dist.pipeline import stage_layer_keys

    path = tmp_path / "job.toml"
    path.write_text('[model]\nflavor = "debugmodel_tiny"\n[parallelism]\npipeline_parallel_degree = 2\n'
                    'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], '
                    '["layers.3", "norm", "output"]]\npipeline_parallel_schedule = "Interleaved1F1B"\n')
    config = parse_train_args(["--job.config_file", str(path)])
    assert config.parallelism.pipeline_parallel_split_points == ["layers.1", "layers.2", "layers.3"]
    assert [len(stage) for stage in stage_layer_keys([str(i) for i in range(4)], 4, config.parallelism)] == [1, 1, 1, 1]
    for stages, message in (('[["tok_embeddings", "layers.0"], ["layers.2", "output"]]', "not the next consecutive"),
                            ('[["layers.0"], ["tok_embeddings", "layers.1"]]', "stage 1 holds 'tok_embeddings'"),
                            ('[["layers.0", "layers.1"]]', "at least two")):
        path.write_text(f'[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {stages}\n')
        with pytest.raises(UsageError, match=message):
            parse_train_args(["--job.config_file", str(path)])
