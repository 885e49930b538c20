"""End to end: `titan train` on the synthetic corpus learns, and logs every metric."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from forked_cli import run_command
from forked_cli import run_titan as run_forked
from titan.train.data import ByteTokenizer, DatasetConfig, synthetic_corpus
from titan.train.metrics import METRIC_KEYS

TINY = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "5",
    "--metrics.log_freq", "5",
]


def run_titan(*args: str, cwd=None, env=None, ranks: int = 1) -> subprocess.CompletedProcess:
    if ranks == 1:  # forked with titan imported (tests/forked_cli.py)
        return run_forked(["train", *args], cwd=cwd, env=env, timeout=600)
    launcher = [sys.executable, "-m", "titan.recipes.cli"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", *launcher[1:]]
    return run_command([*launcher, "train", *args], cwd=cwd, timeout=600, env=env)  # torchrun's agent forked


def read_metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_in_a_used_folder_sets_the_earlier_runs_metrics_aside(tmp_path):
    """Two runs without checkpoints in one folder: the second starts afresh, so the first's
    metrics.jsonl and config.json go to earlier_runs/1 (an interleaved metrics.jsonl would
    mix the two runs' steps); a run that resumes from a checkpoint appends to its records."""
    tiny = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path),
            "--metrics.log_freq", "1", "--training.seq_len", "32"]
    for steps in (3, 2):
        result = run_titan(*tiny, "--training.steps", str(steps))
        assert result.returncode == 0, result.stderr[-3000:]
    assert "held an earlier run's metrics (steps 1-3) and this run starts afresh" in result.stderr
    earlier = tmp_path / "earlier_runs" / "1"
    assert [r["step"] for r in read_metrics(earlier)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert json.loads((earlier / "config.json").read_text())["training"]["steps"] == 3
    assert json.loads((tmp_path / "config.json").read_text())["training"]["steps"] == 2
    # Resumed from the checkpoint of step 2 (the first of these runs starts afresh: its
    # predecessor's records go to earlier_runs/2), the next run appends steps 3-4.
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    for steps in (2, 4):
        result = run_titan(*tiny, *ckpt, "--training.steps", str(steps))
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step 2" in result.stderr and "earlier run" not in result.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(tmp_path / "earlier_runs" / "2")] == [1, 2]


def test_a_fresh_run_sets_an_earlier_runs_profiler_traces_aside_with_its_metrics(tmp_path):
    """Two profiled runs in one folder: the second starts afresh, and its iteration_2 trace
    would have replaced the first run's (and left its iteration_4 beside it). The first run's
    traces go to earlier_runs/1 with its metrics."""
    flags = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path),
             "--training.seq_len", "32", "--profiling.enable_profiling", "--profiling.profile_freq", "2"]
    for steps in (4, 2):
        result = run_titan(*flags, "--training.steps", str(steps))
        assert result.returncode == 0, result.stderr[-3000:]
    assert "held an earlier run's profiles (profile_traces) and this run starts afresh" in result.stderr
    earlier = tmp_path / "earlier_runs" / "1"
    assert sorted(p.name for p in (earlier / "profile_traces").iterdir()) == ["iteration_2", "iteration_4"]
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["iteration_2"]
    assert (earlier / "metrics.jsonl").is_file()


def test_a_finished_run_launched_again_trains_nothing_and_leaves_its_folder(tmp_path):
    """Its last save holds the weights only (the default): launched again with the same
    --training.steps, the run says it is complete and writes nothing (it used to resume from
    the step before and train the last interval again); with more steps it trains on."""
    flags = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path),
             "--metrics.log_freq", "1", "--training.seq_len", "32", "--checkpoint.enable", "--checkpoint.interval", "2",
             "--metrics.enable_tensorboard"]
    assert run_titan(*flags, "--training.steps", "3").returncode == 0
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != ".titan-run.lock"}
    again = run_titan(*flags, "--training.steps", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run is complete: its last step (3, --training.steps) is saved" in again.stderr
    assert "resumed" not in again.stderr
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != ".titan-run.lock"}
    assert {p: t for p, t in after.items() if p in before} == before
    assert not [p for p in after if p not in before]  # no empty TensorBoard event file either
    longer = run_titan(*flags, "--training.steps", "4")
    assert longer.returncode == 0 and "resuming from step 2" in longer.stderr, longer.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 3, 4]


def test_a_resume_with_another_batch_warns_and_another_seed_is_refused(tmp_path):
    """Each checkpoint records the run's optimizer batch. With --training.global_batch_size -1
    the batch follows the local batch and the data-parallel degree, so a resume on fewer
    ranks (here: a smaller local batch, the same arithmetic) halves it without a flag saying
    so: the resumed run warns, naming the flag that keeps the checkpoint's batch; with that
    flag (two accumulated microbatches of 4) it says nothing. Another --debug.seed is refused."""
    flags = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path),
             "--training.seq_len", "32", "--checkpoint.enable", "--checkpoint.interval", "2",
             "--checkpoint.no_last_save_model_only"]
    first = run_titan(*flags, "--training.steps", "2", "--training.local_batch_size", "8")
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((tmp_path / "checkpoint" / "step-2" / "titan_checkpoint.json").read_text())
    assert manifest["run"]["batch"] == {"global_batch_size": 8, "local_batch_size": 8, "data_parallel_degree": 1,
                                        "gradient_accumulation_steps": 1, "seq_len": 32}
    halved = run_titan(*flags, "--training.steps", "3", "--training.local_batch_size", "4")
    assert halved.returncode == 0, halved.stderr[-3000:]
    assert "resumed from step 2" in halved.stderr
    assert ("step 2 was trained with a global batch of 8 (local batch 8 x data-parallel 1 x 1 accumulated); "
            "this run's is 4 (local batch 4 x data-parallel 1 x 1 accumulated): each optimizer step now takes "
            "0.5x the batch") in halved.stderr
    assert "to keep the checkpoint's batch pass --training.global_batch_size 8" in halved.stderr
    shutil.rmtree(tmp_path / "checkpoint" / "step-3")
    kept = run_titan(*flags, "--training.steps", "3", "--training.local_batch_size", "4",
                     "--training.global_batch_size", "8")
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert "resumed from step 2" in kept.stderr and "global batch of" not in kept.stderr
    # Another seed is refused: the resume would restore the saved run's random states and data
    # order while what is drawn afresh followed the new seed. The folder's config stays.
    config = (tmp_path / "config.json").read_text()
    reseeded = run_titan(*flags, "--training.steps", "4", "--training.local_batch_size", "4",
                         "--training.global_batch_size", "8", "--debug.seed", "5")
    assert reseeded.returncode == 2
    assert "--debug.seed 5 is not the seed of the run this one resumes (0, step 3 in" in reseeded.stderr
    assert "resume with --debug.seed 0, or train with another seed as a new run" in reseeded.stderr
    assert (tmp_path / "config.json").read_text() == config
    assert json.loads((tmp_path / "checkpoint" / "step-3" / "titan_checkpoint.json").read_text())["run"]["seed"] == 0


@pytest.mark.slow
def test_an_extended_run_trains_on_the_longer_schedule_as_if_uninterrupted(tmp_path):
    """A 2-step run resumed with --training.steps 4 trains steps 3-4 with the LR (and so the
    losses) of an uninterrupted 4-step run, and warns that the saved run's schedule had
    another LR for step 3 (its end: 0; step 3 used to train at LR 0). Resumed instead with
    another --optimizer.lr and weight decay, both are the flags' (the saved ones used to
    override them, silently)."""
    flags = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
             "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0.5",
             "--debug.deterministic"]
    straight = run_titan(*flags, "--job.dump_folder", str(tmp_path / "straight"), "--training.steps", "4")
    assert straight.returncode == 0, straight.stderr[-3000:]
    ckpt = ["--job.dump_folder", str(tmp_path / "extended"), "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.no_last_save_model_only"]
    assert run_titan(*flags, *ckpt, "--training.steps", "2").returncode == 0
    snapshot = tmp_path / "step-2"
    shutil.copytree(tmp_path / "extended" / "checkpoint" / "step-2", snapshot)
    extended = run_titan(*flags, *ckpt, "--training.steps", "4")
    assert extended.returncode == 0, extended.stderr[-3000:]
    want = {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(tmp_path / "straight")}
    got = {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(tmp_path / "extended")}
    assert got == want, (got, want)
    assert ("the learning rate follows this run's schedule: step 3 trains at 0.002, where the run that saved step 2 "
            "had set 0") in extended.stderr
    # Its full last save launched again, with the same steps or fewer: nothing to train, said so.
    again = run_titan(*flags, *ckpt, "--training.steps", "4")
    assert "this run is complete: step 4 (--training.steps) is saved; nothing to train" in again.stderr
    fewer = run_titan(*flags, *ckpt, "--training.steps", "3")
    assert fewer.returncode == 0 and "the checkpoint's step 4 is past --training.steps 3: nothing to train" in fewer.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "extended")] == [1, 2, 3, 4]
    lower = ["--job.dump_folder", str(tmp_path / "lower"), "--checkpoint.enable", "--checkpoint.interval", "2"]
    shutil.copytree(snapshot, tmp_path / "lower" / "checkpoint" / "step-2")
    resumed = run_titan(*flags, *lower, "--training.steps", "4", "--optimizer.lr", "1e-4",
                        "--optimizer.weight_decay", "0.05")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the optimizer's hyperparameters are this run's, not the checkpoint's: weight_decay 0.1 -> 0.05" in resumed.stderr
    assert [r["lr"] for r in read_metrics(tmp_path / "lower")] == pytest.approx([want[s][1] / 20 for s in (3, 4)], rel=1e-12)


def test_synthetic_run_learns_and_logs_every_key(tmp_path):
    # Half the debug model's width, 2 of its 6 layers: the same approach to the floor in 80 steps
    # (last losses 1.74, 1.75, 1.69, 1.67 against a floor of 1.42) in half the time.
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.steps", "80", "--job.dump_folder", str(tmp_path),
        "--model.dim", "128", "--model.n_layers", "2", *TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] + list(range(5, 81, 5))
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert row["tokens_per_second"] > 0 and row["memory_peak_gib"] > 0
        assert row["mfu"] is None or 0 < row["mfu"] <= 100
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > math.log(256) - 0.5  # starts near uniform over the byte vocabulary
    assert last < first - 2.0, f"loss fell only from {first:.3f} to {last:.3f}"
    # The corpus's entropy floor is the best any model can do: the loss heads for it and,
    # up to batch noise, never beats it.
    floor = synthetic_corpus(DatasetConfig(), ByteTokenizer()).entropy_floor_nats()
    tail = [r["loss"] for r in rows[-4:]]
    assert all(floor - 0.15 < loss < floor + 0.6 for loss in tail), (floor, tail)
    assert "loss" in result.stderr + result.stdout


def test_bad_batch_geometry_fails_before_training(tmp_path):
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.global_batch_size", "12",
        "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path),
    )
    assert result.returncode != 0
    assert "global_batch_size=12" in result.stderr and "--training.global_batch_size" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_max_norm_0_disables_clipping_and_trains(tmp_path):
    """`--training.max_norm 0` is documented to disable clipping; it once scaled every gradient
    by 0 and the loss stayed flat. The clip itself is unit-tested in titan-dist (test_clip)."""
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.steps", "20", "--training.max_norm", "0",
        "--job.dump_folder", str(tmp_path), *TINY,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 1.5, f"loss fell only from {first:.3f} to {last:.3f}"
    assert all(r["grad_norm"] > 0 for r in rows)  # the norm is still computed and logged


def test_the_loop_collects_garbage_on_its_schedule(tmp_path):
    """`--training.gc_freq` / `--training.gc_debug` (torchtitan's flags) are the loop's: with
    debug a full collection after each of the 3 optimizer steps, logged."""
    result = run_titan("--config", "llama3_debug_synthetic", "--training.steps", "3", "--training.gc_debug",
                       "--job.dump_folder", str(tmp_path), *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f"garbage collection after step {s}:" in result.stderr for s in (1, 2, 3)] == [True] * 3


def _cpu_cache_key(env: dict[str, str]) -> str:
    """The cache key a `titan` subprocess with `env` uses (it depends on its thread count)."""
    code = "from titan.train.device_peak import _cpu_cache_key; print(_cpu_cache_key())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.slow
def test_a_cached_cpu_peak_that_throughput_disproves_is_corrected(tmp_path):
    """A CPU peak cached while the machine was loaded reads low: MFU must still stay <= 100%,
    and the cache is raised for the next run (not re-measured: the cached value is used)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CPU_PEAK_FLOPS"}
    env.update(TITAN_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    key, low = _cpu_cache_key(env), 1e3  # far below any CPU
    (cache / "cpu_peak_flops.json").write_text(json.dumps({key: low}))
    result = run_titan(
        "--config", "llama3_debug_synthetic", "--training.steps", "3", "--metrics.log_freq", "1",
        "--job.dump_folder", str(tmp_path / "run"), *TINY[:4], env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["mfu"] == pytest.approx(100.0)  # the first step disproved the low peak
    assert all(0 < r["mfu"] <= 100 + 1e-9 for r in rows), [r["mfu"] for r in rows]
    corrected = json.loads((cache / "cpu_peak_flops.json").read_text())[key]
    achieved = max(r["tflops"] for r in rows) * 1e12
    assert corrected == pytest.approx(achieved, rel=1e-6) and corrected > 1e6


# 2 ranks, one data-parallel rank: its batch is shared by the 2 devices of its TP or PP group.
PER_DEVICE = [
    "--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "2",
    "--metrics.log_freq", "1", "--metrics.no_enable_progress_bar",
    "--parallelism.data_parallel_shard_degree", "1",
]


PER_DEVICE_LAYOUTS = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
}


@pytest.mark.slow
@pytest.mark.xdist_group("per_device_runs")  # one worker launches and reads (tests/conftest.py)
@pytest.mark.parametrize("layout", list(PER_DEVICE_LAYOUTS))
def test_tokens_per_second_is_per_device_under_tp_and_pp(train_group, layout):
    runs = {name: [*PER_DEVICE, *flags] for name, flags in PER_DEVICE_LAYOUTS.items()}
    dump = train_group("per_device_runs", 2, runs) / layout
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # 4 x 32 tokens per step for the one data-parallel rank, shared by 2 devices.
        assert row["device_tokens"] == 4 * 32 // 2
        assert row["tokens_per_second"] == pytest.approx(row["device_tokens"] / row["elapsed_s"], rel=1e-12)
