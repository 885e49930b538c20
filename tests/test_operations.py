"""Operating a run: validation loss (against a hand computation, and equal under FSDP and PP),
preemption by SIGTERM (the step finishes, a checkpoint is saved, exit 0, the same command
resumes), the resolved config saved in the run folder and the closing summary."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forked_cli import run_command

TINY = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--metrics.no_enable_progress_bar", "--debug.seed", "0"]
VALIDATION = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
              "--validation.dataset.synthetic_documents", "500", "--training.steps", "4", "--metrics.log_freq", "4"]


def titan(dump: Path, *flags: str, ranks: int = 1, **popen) -> list[str]:
    """The command line of `titan train` on `ranks` processes."""
    launcher = [sys.executable, "-m", "titan.recipes.cli"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli"]
    return [*launcher, "train", *TINY, "--job.dump_folder", str(dump), *flags]


def run(dump: Path, *flags: str, ranks: int = 1) -> subprocess.CompletedProcess:
    cmd = titan(dump, *flags, ranks=ranks)
    done = run_command(cmd, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_validation_loss_is_the_mean_cross_entropy_of_held_out_batches(tmp_path):
    """In process: the logged validation loss equals a hand-written evaluation of the same
    batches with the trained weights; passes run at steps 2 and 4, logged on those steps, and
    each pass prints its figures on the console. Training with --training.loss_type dft,
    validation still reports the NLL, while the training loss is DFT's: each token's p
    (-log p) is at most 1/e."""
    import tyro
    from titan.train.config import TrainerConfig
    from titan.train.trainer import Trainer

    from titan.recipes.families import model_spec
    from titan.recipes.recipes import recipe

    cfg = tyro.cli(TrainerConfig, default=recipe("llama3_debug_synthetic"),
                   args=[*TINY[2:], *VALIDATION, "--training.loss_type", "dft", "--job.dump_folder", str(tmp_path)],
                   use_underscores=True)
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    printed = []  # what the titan logger prints (its own console handler; pytest's sees none)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: printed.append(record.getMessage())
    logging.getLogger("titan").addHandler(handler)
    try:
        logged = trainer.train()
        model = trainer.model_parts[0]
        batches = trainer.validator._fixed_batches()
        with torch.no_grad():
            logits = torch.cat([model(b["input_ids"]) for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        expected = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    finally:
        logging.getLogger("titan").removeHandler(handler)
        trainer.close()
    validated = [r for r in logged if "validation_loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    assert validated[-1]["validation_loss"] == pytest.approx(expected, rel=1e-6)
    assert validated[-1]["validation_perplexity"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-6)
    assert validated[0]["validation_loss"] != validated[-1]["validation_loss"]  # weights changed in between
    for r in validated:
        assert (f"step {r['step']}: held-out loss {r['validation_loss']:.4f}  perplexity "
                f"{r['validation_perplexity']:.2f}  ({r['validation_tokens']:,} tokens)") in printed
    assert all(r["loss"] <= math.exp(-1) for r in logged) and expected > 1  # the NLL is log(vocab)-ish
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["type"] == "TrainerConfig" and saved["validation"]["freq"] == 2


def _validated(tmp_path, *flags):
    """A 2-step in-process run validating at step 2: (the logged validation record, the
    validator, the trained model)."""
    import tyro
    from titan.train.config import TrainerConfig
    from titan.train.trainer import Trainer

    from titan.recipes.families import model_spec
    from titan.recipes.recipes import recipe

    cfg = tyro.cli(TrainerConfig, default=recipe("llama3_debug_synthetic"),
                   args=[*TINY[2:], "--validation.enable", "--validation.freq", "2", "--training.steps", "2",
                         "--metrics.log_freq", "2", "--job.dump_folder", str(tmp_path), *flags], use_underscores=True)
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    try:
        logged = trainer.train()
        return next(r for r in logged if "validation_loss" in r), trainer.validator, trainer.model_parts[0]
    finally:
        trainer.close()


def test_validation_takes_its_own_batch_shape(tmp_path):
    """`--validation.local_batch_size` / `--validation.seq_len` (torchtitan's flags): the held-out
    microbatches have that shape (2 steps x 3 rows x 16 tokens scored), not training's 4 x 32."""
    record, validator, _ = _validated(tmp_path, "--validation.steps", "2", "--validation.local_batch_size", "3",
                                      "--validation.seq_len", "16", "--validation.dataset.synthetic_documents", "500")
    shapes = {tuple(b["input_ids"].shape) for b in validator._fixed_batches()}
    assert shapes == {(3, 16)} and record["validation_tokens"] == 2 * 3 * 16


def test_validation_steps_minus_one_scores_the_whole_held_out_corpus(tmp_path):
    """`--validation.steps -1`: every global batch of one pass over the held-out files, up to the
    one that reaches their end; the loss is the mean cross entropy of exactly those batches."""
    from titan.train.data import ByteTokenizer

    texts = [f"held-out line {i}: " + "text " * (i % 5) for i in range(40)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    record, validator, model = _validated(
        tmp_path, "--validation.steps", "-1", "--validation.dataset.name", "json", "--validation.dataset.path",
        str(tmp_path / "held.jsonl"), "--validation.dataset.cache_dir", str(tmp_path / "cache"),
        "--validation.dataset.no_shuffle")
    framed = sum(len(ByteTokenizer().encode(t, bos=True, eos=True)) for t in texts)
    per_batch = 4 * 33  # one data-parallel rank: 4 windows of seq_len + 1 tokens per fetch
    batches = list(validator._fixed_batches())
    assert len(batches) == -(-framed // per_batch) - 1  # the batch reaching the end is left out
    assert record["validation_tokens"] == len(batches) * 4 * 32
    with torch.no_grad():
        logits = torch.cat([model(b["input_ids"]) for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    expected = float(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    assert record["validation_loss"] == pytest.approx(expected, rel=1e-6)
    assert validator._batches is None  # read afresh each pass, never all held


@pytest.mark.parametrize("kwargs, rows, message", [
    ({"seq_len": 64}, (4, 32, False), "--validation.seq_len 64 is longer than --training.seq_len 32"),
    ({"local_batch_size": 2}, (4, 32, True), "must equal training's \\(4 x 32\\) under pipeline parallel"),
    ({"seq_len": 30}, (4, 32, False, 4), "--validation.seq_len 30 must divide by 4"),
])
def test_validation_shapes_the_run_cannot_evaluate_are_refused(kwargs, rows, message):
    from titan.train.validation import ValidationConfig

    local, seq, pipelined, *multiple = rows
    with pytest.raises(ValueError, match=message):
        ValidationConfig(**kwargs).shape(local, seq, pipelined=pipelined, multiple_of=multiple[0] if multiple else 1)
    assert ValidationConfig().shape(4, 32, pipelined=True) == (4, 32)
    with pytest.raises(ValueError, match="--validation.steps must be >= 1, or -1"):
        ValidationConfig(steps=0)


VALIDATION_LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "pp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"],
}


@pytest.mark.slow
@pytest.mark.xdist_group("validation_runs")  # one worker launches and reads (tests/conftest.py)
@pytest.mark.parametrize("layout", list(VALIDATION_LAYOUTS))
def test_validation_equals_one_process(layout, train_group):
    flags = [*TINY, *VALIDATION]
    one = train_group("validation_one", 1, {"one": flags}) / "one"
    two = train_group("validation_two", 2, {name: [*flags, *layout_flags]
                                            for name, layout_flags in VALIDATION_LAYOUTS.items()}) / layout
    one = [r["validation_loss"] for r in records(one) if "validation_loss" in r]
    two = [r["validation_loss"] for r in records(two) if "validation_loss" in r]
    assert len(one) == len(two) == 2
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two, strict=True)), (one, two)


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_resumes(tmp_path):
    flags = ["--training.steps", "400", "--metrics.log_freq", "1", "--checkpoint.enable",
             "--checkpoint.interval", "1000"]
    proc = subprocess.Popen(titan(tmp_path, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = max(r["step"] for r in records(tmp_path))
    assert stopped < 400 and f"stopped at step {stopped}" in err, err[-2000:]
    assert (tmp_path / "checkpoint" / f"step-{stopped}").is_dir()
    assert "preempted: steps 0-" in err

    # The same command (only fewer total steps, to keep the test short) resumes.
    resumed = run(tmp_path, *flags, "--training.steps", str(stopped + 2))
    assert f"resumed from step {stopped}" in resumed.stderr
    assert [r["step"] for r in records(tmp_path)][-2:] == [stopped + 1, stopped + 2]
    assert "training done" in resumed.stderr


@pytest.mark.slow
def test_profiler_flags_write_traces_from_titan_train(tmp_path):
    """`--profiling.enable_profiling` through the real loop: a Chrome trace of the window that
    ends on step 4, readable JSON with trace events."""
    run(tmp_path, "--training.steps", "4", "--profiling.enable_profiling", "--profiling.profile_freq", "4",
        "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1")
    traces = sorted(tmp_path.rglob("*trace*.json"))
    assert traces, sorted(p.name for p in tmp_path.rglob("*"))
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
