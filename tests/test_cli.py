"""The `titan` command: recipes, flag names, overrides, the recipe's own flag tree, and errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked_cli import run_command
from titan.train.config import TrainerConfig

from titan.recipes import cli, runners
from titan.recipes.cli import UsageError, main, parse_train_args, split_recipe_flag
from titan.recipes.families import MODEL_FAMILIES
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


def titan_command() -> list[str]:
    """The installed `titan` console script beside this interpreter (else the module)."""
    script = Path(sys.executable).parent / "titan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "titan.recipes.cli"]


def test_help_lists_recipes_and_flags(tmp_path):
    """Each command's --help lists the recipes it runs (every recipe under some command) and
    the flags torchtitan users know."""
    from titan.recipes.cli import recipe_command

    by_command: dict[str, list[str]] = {}
    for name in RECIPES:
        by_command.setdefault(recipe_command(name), []).append(name)
    assert None not in by_command and "train" in by_command
    helps = run_cases(tmp_path, [(command, [command, "--help"]) for command in by_command], COLUMNS="250")
    for command, names in by_command.items():
        assert helps[command]["code"] == 0, helps[command]["stderr"][-3000:]
        out = helps[command]["stdout"]
        for name in names:
            assert name in out, (command, name)
        if command == "train":
            for flag in FLAGS_USERS_KNOW:
                assert flag in out, flag
            assert "--debug.traceback" in out


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
    with pytest.raises(UsageError, match="llama3_debug"):
        parse_train_args(["--config", "nope"])


def test_bad_value_is_rejected_by_validation():
    with pytest.raises(UsageError, match="--optimizer.lr must be > 0"):
        parse_train_args(["--optimizer.lr", "-1"])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_builds_a_valid_config(name):
    cfg = recipe(name)
    assert runners.runner_for(cfg).command in runners.DEFAULT_RECIPES
    if isinstance(cfg, TrainerConfig):
        assert cfg.training.steps > 0 and cfg.model.name in MODEL_FAMILIES


# ---------------------------------------------------------------- the flag tree follows the recipe


@dataclasses.dataclass(kw_only=True)
class ProbeConfig:
    """A section only the probe recipe's config type has."""

    alpha: int = 1
    """A probe value."""


@dataclasses.dataclass(kw_only=True)
class ProbeTrainerConfig(TrainerConfig):
    """A recipe config type with one extra section."""

    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    """The extra section."""


@dataclasses.dataclass(kw_only=True)
class ProbeSFTConfig:
    """A config tree unrelated to TrainerConfig, run by its own (fake) loop."""

    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    """The only section."""


def test_flag_sections_come_from_the_recipes_config_type(monkeypatch):
    monkeypatch.setitem(RECIPES, "probe", ProbeTrainerConfig)
    cfg = parse_train_args(["--config", "probe", "--probe.alpha", "3", "--training.steps", "2"])
    assert type(cfg) is ProbeTrainerConfig and cfg.probe.alpha == 3 and cfg.training.steps == 2
    # A subclass runs on the pretraining loop unless it registers its own.
    assert runners.runner_for(cfg) is runners.RUNNERS[TrainerConfig]
    with pytest.raises(UsageError, match="--probe.alpha"):  # not a flag of TrainerConfig recipes
        parse_train_args(["--config", "llama3_debug", "--probe.alpha", "3"])


def test_titan_sft_runs_the_loop_registered_for_the_recipes_config_type(monkeypatch):
    ran = []

    class FakeLoop:
        def __init__(self, config):
            self.config = config

        def train(self):
            ran.append(("train", self.config.probe.alpha))

        def close(self):
            ran.append(("close", None))

    monkeypatch.setitem(RECIPES, "probe_sft", ProbeSFTConfig)
    monkeypatch.setitem(runners.DEFAULT_RECIPES, "sft", "probe_sft")
    monkeypatch.setitem(runners.RUNNERS, ProbeSFTConfig, runners.Runner(build=FakeLoop, command="sft"))
    assert main(["sft", "--probe.alpha", "5"]) == 0  # the default recipe of `titan sft`
    assert ran == [("train", 5), ("close", None)]
    assert "probe_sft" in cli.recipes_description("sft")
    assert "probe_sft" not in cli.recipes_description("train")
    assert "llama3_debug" not in cli.recipes_description("sft")


def test_an_unregistered_config_type_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(RECIPES, "orphan", ProbeSFTConfig)
    assert main(["train", "--config", "orphan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titan train: error: no training loop is registered for ProbeSFTConfig")


# ---------------------------------------------------------------- errors: one line, exit code 2


@pytest.mark.parametrize("command", [["train"], ["dry-run", "--world_size", "2"]])
def test_a_missing_optional_dependency_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path, command):
    """float8 without torchao: the pip extra in one line, exit 2, before the memory check or any
    build (it was a traceback after a 'no memory estimate' warning)."""
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes the import fail
    rc = main([*command, "--config", "llama3_debug", "--model.flavor", "debugmodel_tiny",
               "--quantize.linear.float8.recipe", "rowwise", "--training.steps", "1",
               "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert err.endswith("--quantize.linear.float8.recipe needs torchao: pip install 'titan-train[float8]' "
                        "(torchao>=0.18)"), err


def _bad_tokenizer(tmp_path: Path) -> str:
    path = tmp_path / "tokenizer.json"
    path.write_text("this is not json")
    return str(path)


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("")
    return path


# (id, flags given tmp_path, text the one line must contain)
BAD_INPUTS = [
    ("missing_dataset_path", lambda t: ["--dataset.name", "text"], "--dataset.path"),
    ("dataset_path_not_found", lambda t: ["--dataset.name", "text", "--dataset.path", str(t / "nope")],
     "--dataset.path"),
    ("unwritable_dump_folder", lambda t: ["--job.dump_folder", str(_file(t) / "out")], "--job.dump_folder"),
    ("unwritable_checkpoint_folder", lambda t: ["--checkpoint.enable", "--checkpoint.folder", str(_file(t) / "ckpt")],
     "--checkpoint.folder"),
    ("bad_tokenizer_file", lambda t: ["--tokenizer.kind", "hf", "--tokenizer.path", _bad_tokenizer(t)],
     "--tokenizer.path"),
    ("missing_tokenizer_file", lambda t: ["--tokenizer.kind", "hf", "--tokenizer.path", str(t / "nope.json")],
     "--tokenizer.path"),
    ("impossible_degrees", lambda t: ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree=3"),
    ("bad_recipe", lambda t: ["--config", "nope"], "--config 'nope' is not a recipe"),
    ("zero_steps", lambda t: ["--training.steps", "0"], "--training.steps must be >= 1"),
    ("not_a_number", lambda t: ["--training.steps", "abc"], "--training.steps"),
    ("unknown_flag", lambda t: ["--training.stepz", "3"], "did you mean --training.steps?"),
    ("value_for_a_switch", lambda t: ["--checkpoint.enable", "yes"], "--checkpoint.no_enable"),
    ("bad_choice", lambda t: ["--optimizer.name", "SGD"], "--optimizer.name 'SGD'"),
    ("unknown_flavor", lambda t: ["--model.flavor", "huge"], "--model.flavor 'huge'"),
    ("batch_geometry", lambda t: ["--training.global_batch_size", "12"], "--training.global_batch_size"),
    ("missing_initial_checkpoint", lambda t: ["--checkpoint.initial_load_path", str(t / "nope")],
     "--checkpoint.initial_load_path"),
    ("replica_id_out_of_range", lambda t: ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                                           "--fault_tolerance.replica_id", "2"], "--fault_tolerance.replica_id"),
    ("straggler_factor", lambda t: ["--metrics.straggler_factor", "0.5"], "--metrics.straggler_factor"),
]


def run_titan(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*titan_command(), "train", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


# Runs `titan train` once per case inside one interpreter, as the console script would
# (`main(argv)`, its return value the exit code), with file descriptors 1 and 2 pointed at a
# file per case, so whatever reaches the terminal (Python, logging, C++ warnings) is caught.
# One interpreter for every case: starting one costs ~3 s of imports, the failures milliseconds.
RUN_CASES = """
import json, os, sys, tempfile, traceback
from titan.recipes.cli import main

cases, results = json.load(open(sys.argv[1])), {}
for name, argv in cases:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:
            traceback.print_exc()
            code = None
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results[name] = {"code": code, "stdout": out.read().decode(), "stderr": err.read().decode()}
json.dump(results, open(sys.argv[2], "w"))
"""


def run_cases(folder: Path, cases: list[tuple[str, list[str]]], **env: str) -> dict[str, dict]:
    """name -> exit code, stdout and stderr of `titan <argv>` for each (name, argv) of
    `cases`, all in one fresh interpreter (RUN_CASES)."""
    (folder / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run([sys.executable, "-c", RUN_CASES, str(folder / "cases.json"), str(folder / "results.json")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


def bad_input_args(tmp_path: Path, flags) -> list[str]:
    return ["train", "--config", "llama3_debug_synthetic", "--job.dump_folder", str(tmp_path / "dump"),
            *flags(tmp_path)]


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """name -> (the case's folder, its exit code and output), every case in one interpreter."""
    root = tmp_path_factory.mktemp("bad_inputs")
    folders = {name: root / name for name, _, _ in BAD_INPUTS}
    for folder in folders.values():
        folder.mkdir()
    cases = [(name, bad_input_args(folders[name], flags)) for name, flags, _ in BAD_INPUTS]
    results = run_cases(root, cases)
    return {name: (folders[name], results[name]) for name in folders}


def assert_one_line_error(code, stdout: str, stderr: str, needle: str, dump: Path) -> None:
    """Exit code 2, one line on stderr naming the problem, no traceback, nothing trained."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("titan train: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout
    assert not (dump / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("bad_inputs")  # the module's one interpreter runs once (tests/conftest.py)
@pytest.mark.parametrize("name, needle", [(b[0], b[2]) for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_no_traceback(bad_input_results, name, needle):
    folder, got = bad_input_results[name]
    assert_one_line_error(got["code"], got["stdout"], got["stderr"], needle, folder / "dump")


@pytest.mark.slow
def test_bad_input_through_the_console_script_is_one_line(tmp_path):
    """The installed `titan` script itself (a fresh process, its imports included) prints the
    same one line and exits 2."""
    name, flags, needle = next(b for b in BAD_INPUTS if b[0] == "zero_steps")
    result = run_titan(bad_input_args(tmp_path, flags)[1:])
    assert_one_line_error(result.returncode, result.stdout, result.stderr, needle, tmp_path / "dump")


@pytest.mark.slow
def test_an_unreachable_hub_dataset_is_one_line_naming_the_flag(tmp_path):
    """A dataset name that is neither built in nor local is read from the Hub; when the Hub
    cannot be reached (offline here by the environment) the error names the flag and the
    ways out instead of `datasets`' ConnectionError traceback."""
    result = run_titan(["--config", "llama3_debug_synthetic", "--training.steps", "1", "--dataset.name",
                        "no-such-org/no-such-dataset", "--job.dump_folder", str(tmp_path / "dump")],
                       HF_HUB_OFFLINE="1")
    errors = [line for line in result.stderr.splitlines() if line.startswith("titan train: error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "--dataset.name 'no-such-org/no-such-dataset'" in errors[0] and "could not be reached" in errors[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "dump" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_debug_traceback_shows_the_full_traceback(tmp_path):
    args = ["--config", "llama3_debug_synthetic", "--dataset.name", "text", "--dataset.path",
            str(tmp_path / "nope"), "--job.dump_folder", str(tmp_path / "dump")]
    result = run_titan([*args, "--debug.traceback"])
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "FileNotFoundError" in result.stderr and "--dataset.path" in result.stderr


@pytest.mark.slow
def test_every_rank_fails_alike_and_rank_0_prints_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend",
           "c10d", "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli", "train",
           "--training.steps", "0", "--job.dump_folder", str(tmp_path)]
    result = run_command(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # torchrun's agent forked
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "titan train: error:" in line]
    assert errors == ["titan train: error: --training.steps must be >= 1, got 0"], result.stderr[-3000:]


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Exceptions that are not about the user's input are not hidden behind one line."""
    def broken(argv, *, command):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(cli, "run", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(["train"])


def test_validation_messages_listing_several_problems_become_one_line():
    err = ValueError("invalid parallel configuration:\n  - --a must be 1\n  - --b must be 2")
    assert cli._one_line(err) == "invalid parallel configuration: --a must be 1; --b must be 2"


def test_tyro_boxes_are_condensed_when_no_structured_event_is_available():
    """The fallback for tyro versions (or events) without the parse-error hook."""
    box = ("╭─ Value error ───────────────╮\n"
           "│ Error parsing training: --training.steps must be >= 1 │\n"
           "│ ─────────────────────────── │\n"
           "│ For full helptext, see titan train --help │\n"
           "╰─────────────────────────────╯\n")
    assert cli._condense(box) == "Error parsing training: --training.steps must be >= 1"


@pytest.mark.parametrize("flags, message", [
    (["--compile.granularity", "model"], "--compile.granularity has no effect without --compile.enable"),
    (["--compile.components", "loss"], "--compile.components has no effect without --compile.enable"),
    (["--activation_checkpoint.selective_layer_every", "2"],
     "--activation_checkpoint.selective_layer_every has no effect without --activation_checkpoint.mode selective"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "--parallelism.pipeline_parallel_schedule has no effect without --parallelism.pipeline_parallel_degree > 1"),
    (["--parallelism.enable_async_tensor_parallel"],
     "--parallelism.enable_async_tensor_parallel has no effect without --parallelism.tensor_parallel_degree > 1"),
    (["--checkpoint.interval", "5"], "--checkpoint.interval has no effect without --checkpoint.enable"),
    (["--checkpoint.export_dtype", "bfloat16"], "--checkpoint.export_dtype has no effect without --checkpoint.enable"),
    (["--checkpoint.last_save_in_hf"], "--checkpoint.last_save_in_hf has no effect without --checkpoint.enable"),
    (["--checkpoint.folder", "ck"], "--checkpoint.folder has no effect without --checkpoint.enable"),
    (["--metrics.wandb_project", "p"], "--metrics.wandb_project has no effect without --metrics.enable_wandb"),
    (["--metrics.save_tb_folder", "x"], "--metrics.save_tb_folder has no effect without --metrics.enable_tensorboard"),
    (["--profiling.profile_freq", "5"], "--profiling.profile_freq has no effect without --profiling.enable_profiling "
     "or --profiling.enable_memory_snapshot"),
    (["--profiling.profiler_active", "2"], "--profiling.profiler_active has no effect without "
     "--profiling.enable_profiling"),
    (["--fault_tolerance.replica_id", "1"], "--fault_tolerance.replica_id has no effect without "
     "--fault_tolerance.enable"),
    (["--validation.freq", "5"], "--validation.freq has no effect without --validation.enable"),
    (["--validation.dataset.name", "stdlib"], "--validation.dataset.name has no effect without "
     "--validation.enable"),
    (["--dataset.synthetic_documents", "10"], "--dataset.synthetic_documents has no effect without "
     "--dataset.name synthetic"),  # llama3_debug reads the standard library
    (["--dataset.streaming"], "--dataset.streaming has no effect without a hub dataset or local files"),
    (["--dataset.split", "validation"], "--dataset.split has no effect without a hub dataset"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.1",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "1"],
     "--parallelism.pipeline_parallel_last_stage_less_layers has no effect without the even split"),
    (["--dataset.subset", "en"], "--dataset.subset has no effect without a hub dataset"),
    (["--dataset.text_field", "body"], "--dataset.text_field has no effect without --dataset.name json, parquet"),
    (["--validation.enable", "--validation.dataset.text_sample_by", "paragraph"],
     "--validation.dataset.text_sample_by has no effect without --validation.dataset.name text"),
])
def test_a_flag_the_run_would_ignore_is_refused(flags, message):
    """A flag that changes nothing unless another setting is on stops the run with what it
    needs, instead of being silently ignored (the run used to train without it)."""
    with pytest.raises(UsageError, match=message.replace(">", ".").replace("+", ".")):
        parse_train_args(["--config", "llama3_debug", *flags])


def test_dependent_flags_pass_with_what_they_need_and_plan_may_pin_layout_flags():
    config = parse_train_args(["--config", "llama3_debug", "--compile.enable", "--compile.granularity", "model",
                               "--checkpoint.enable", "--checkpoint.interval", "5",
                               "--parallelism.pipeline_parallel_degree", "2",
                               "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    assert config.compile.granularity == "model" and config.checkpoint.interval == 5
    parse_train_args(["--config", "llama3_debug", "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "5",
                      "--metrics.enable_tensorboard", "--metrics.save_tb_folder", "tensorboard"])
    # titan plan ranks the layouts a pinned schedule allows: its layout flags are exempt.
    parse_train_args(["--config", "llama3_debug", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
                     exempt_flags=("--parallelism.pipeline_parallel_schedule",))


def test_a_job_files_dataset_fields_follow_a_corpus_switched_on_the_command_line(tmp_path):
    """A torchtitan job file's `dataset = "c4"` sets the Hub's subset and split; naming another
    corpus on the command line leaves them unread without an error (they are the file's, not
    the user's), while the same fields typed on the command line are refused."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nflavor = "debugmodel_tiny"\n[training]\ndataset = "c4"\n')
    config = parse_train_args(["--job.config_file", str(job), "--dataset.name", "stdlib"])
    assert (config.dataset.name, config.dataset.subset) == ("stdlib", "en")
    with pytest.raises(UsageError, match="--dataset.subset has no effect without a hub dataset"):
        parse_train_args(["--job.config_file", str(job), "--dataset.name", "stdlib", "--dataset.subset", "en"])


def test_python_dash_m_titan_is_the_command_line():
    """`python -m titan ...` (and so `torchrun -m titan train ...`) runs the `titan` command."""
    result = subprocess.run([sys.executable, "-m", "titan", "recipes"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "llama3_debug" in result.stdout


def test_a_native_crash_prints_every_threads_python_stack(monkeypatch):
    """`titan` runs with faulthandler on (`cli.run` turns it on first): a process that dies of
    a fatal signal (here glibc's abort, as on a corrupted heap) prints where each thread was
    instead of one line from the C library."""
    calls = []
    monkeypatch.setattr(cli, "report_native_crashes", lambda: calls.append(1))
    with pytest.raises(UsageError):  # the flags fail to parse after the handler is on
        cli.run(["--no.such_flag", "1"])
    assert calls == [1]
    code = ("import os, titan.recipes.cli as cli\n"
            "def dies_here():\n    os.abort()\n"
            "cli.report_native_crashes()\ndies_here()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Fatal Python error: Aborted" in done.stderr and "in dies_here" in done.stderr, done.stderr[-2000:]
