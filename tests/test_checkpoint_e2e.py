"""Issue 4 end to end through `titan train`: checkpoints survive SIGKILL, reshard across layouts,
survive a crash in the middle of a save, save in the background, retain k steps, speak
Hugging Face, and refuse bad checkpoints before training.

Every run is the real trainer (Llama 3 ``debugmodel_tiny``, AdamW + WSD, fp32, deterministic)
launched as a subprocess (torchrun for several ranks), reading metrics.jsonl. A few reference
runs are shared between tests (and between pytest-xdist workers, through a file lock).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from forked_cli import run_command
from launching import launch_train_runs, run_output
from titan.ckpt import load_dcp_model, load_hf
from titan.models.llama3 import LLAMA3_FLAVORS, Llama3Model, Llama3StateDictAdapter
from titan.train.data import ByteTokenizer

# One worker runs the module: its tests read the same shared launches (two_rank_runs and
# four_rank_runs), which a second worker would wait for.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("checkpoint_e2e")]

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL, GLOBAL_BATCH, SEQ = 16, 4, 4, 32
# Resharded runs reduce in another order: fp32 tolerance on losses (observed <= ~2e-6).
LOSS_RTOL = 2e-5

COMMON = [
    "--config", "llama3_debug_synthetic",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", str(SEQ),
    "--training.steps", str(STEPS),
    "--optimizer.lr", "1e-2",
    "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
    "--dataset.synthetic_documents", "2000",
    "--checkpoint.enable",
    "--checkpoint.interval", str(INTERVAL),
]


def dp(shard: int) -> list[str]:
    """Flags of a pure FSDP layout with the global batch kept at GLOBAL_BATCH."""
    return ["--parallelism.data_parallel_shard_degree", str(shard),
            "--training.local_batch_size", str(GLOBAL_BATCH // shard)]


ONE = dp(1)
FSDP2 = dp(2)
FSDP4 = dp(4)
FSDP2_TP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
             "--training.local_batch_size", str(GLOBAL_BATCH // 2)]
PP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
       "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", str(GLOBAL_BATCH)]


# ---------------------------------------------------------------------------- running titan


def run_flags(dump: Path, *flags: str) -> list[str]:
    """`titan train` flags of one run: the common ones, its dump folder, then ``flags``."""
    return [*COMMON, "--job.dump_folder", str(dump), *flags]


def command(ranks: int, dump: Path, flags: tuple[str, ...], script: str | None = None) -> list[str]:
    """`titan train` (or a test entry script wrapping it), under torchrun when ranks > 1."""
    entry = [script] if script else ["-m", "titan.recipes.cli"]
    if ranks == 1:
        launcher = [sys.executable, *entry]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", *entry]
    return [*launcher, "train", *run_flags(dump, *flags)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def titan(ranks: int, dump: Path, *flags: str, ok: bool = True, script: str | None = None):
    """Run to completion; by default assert it succeeded."""
    cmd = command(ranks, dump, flags, script)
    result = run_command(cmd, timeout=300, env=ENV)  # one process: forked (tests/forked_cli.py)
    if ok:
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def launch(ranks: int, dump: Path, *flags: str, script: str | None = None) -> subprocess.Popen:
    """Start a run in its own session, so the test can kill the whole tree."""
    return subprocess.Popen(command(ranks, dump, flags, script), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers. torchrun starts each worker in a session of its
    own, so killing the launcher's process group alone would orphan them."""
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def losses(dump: Path) -> dict[int, float]:
    """Loss per step; the latest line wins (a resumed run appends after the killed one)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def logged_steps(dump: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def complete_steps(dump: Path) -> list[int]:
    folder = dump / "checkpoint"
    return sorted(int(p.name[5:]) for p in folder.glob("step-*")
                  if p.name[5:].isdigit() and (p / "titan_checkpoint.json").is_file())


def seed_from(dump: Path, src: Path, step: int) -> Path:
    """A fresh dump folder whose checkpoint folder holds `src`'s step `step` only."""
    shutil.copytree(src / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


def assert_close_losses(got: dict[int, float], ref: dict[int, float], steps: range) -> float:
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps)
    assert worst <= LOSS_RTOL, f"steps {list(steps)}: {[got[s] for s in steps]} vs {[ref[s] for s in steps]}"
    return worst


# ---------------------------------------------------------------------------- shared runs


@pytest.fixture
def one_ref(build_once) -> Path:
    """Uninterrupted single-process run of the same global batch."""
    return build_once("ckpt_one", lambda d: titan(1, d, *ONE))


# The killed run holds after this step (a checkpoint at step 4 is complete, step 8's not begun)
# until the test SIGKILLs it: the kill lands mid-run whatever the machine's speed or load.
HOLD_AFTER_STEP = 6
HOLDING_ENTRY = '''
"""`titan train`, except that every rank stops after step {step} and waits to be SIGKILLed."""
import os, sys, threading
import titan.ckpt.manager as manager
from titan.recipes.cli import main

real_maybe_save = manager.CheckpointManager.maybe_save

def maybe_save_then_hold(self, step, **kwargs):
    saved = real_maybe_save(self, step, **kwargs)
    if step == {step}:
        self.wait()  # any background save is published first
        if os.environ.get("RANK", "0") == "0":
            open(os.path.join(self.folder, os.pardir, "held"), "w").close()
        threading.Event().wait()  # until killed
    return saved

manager.CheckpointManager.maybe_save = maybe_save_then_hold
if __name__ == "__main__":
    sys.exit(main())
'''


def kill_after_first_checkpoint(dump: Path) -> None:
    """A 2-rank run SIGKILLed once it holds after step HOLD_AFTER_STEP; what it had saved and
    logged by then goes to killed_at.json."""
    dump.mkdir(parents=True)
    script = dump / "hold_after_step.py"
    script.write_text(HOLDING_ENTRY.format(step=HOLD_AFTER_STEP))
    proc = launch(2, dump, *FSDP2, script=str(script))
    held = dump / "held"
    deadline = time.monotonic() + 240  # a guard against a hang, not part of the verdict
    while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    (dump / "killed_at.json").write_text(json.dumps({"complete": complete_steps(dump), "logged": logged_steps(dump)}))


CRASHING_ENTRY = '''
"""`titan train`, except that rank 1 is SIGKILLed right after writing its shard of step {step}."""
import os, signal, sys
import titan.ckpt.manager as manager
from titan.recipes.cli import main

real = manager._make_writer

def make_writer(path):
    writer = real(path)
    if path.endswith("step-{step}.tmp") and os.environ.get("RANK") == "1":
        write = writer.write_data
        def write_then_die(plan, planner):
            write(plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        writer.write_data = write_then_die
    return writer

manager._make_writer = make_writer
if __name__ == "__main__":
    sys.exit(main())
'''
CRASH_IN_SAVE_OF_STEP = 8


def crash_in_a_save(dump: Path) -> None:
    """A 2-rank run whose rank 1 dies right after writing its shard of step 8; its exit
    status and what the checkpoint folder held afterwards go to crashed_at.json."""
    dump.mkdir(parents=True)
    script = dump / "crash_in_save.py"
    script.write_text(CRASHING_ENTRY.format(step=CRASH_IN_SAVE_OF_STEP))
    crashed = titan(2, dump, *FSDP2, script=str(script), ok=False)
    partial = dump / "checkpoint" / f"step-{CRASH_IN_SAVE_OF_STEP}.tmp"
    (dump / "crashed_at.json").write_text(json.dumps({
        "returncode": crashed.returncode, "complete": complete_steps(dump),
        "partial_written": partial.is_dir() and any(partial.iterdir()),
        "published": (dump / "checkpoint" / f"step-{CRASH_IN_SAVE_OF_STEP}").exists()}))


ASYNC_RETAINING = ["--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2"]


def save_in_the_background(dump: Path) -> None:
    """A 2-rank run saving asynchronously and keeping the latest 2 steps; its checkpoint
    folder's listing and step 12's manifest go to async_saved.json."""
    titan(2, dump, *FSDP2, *ASYNC_RETAINING)
    folder = dump / "checkpoint"
    (dump / "async_saved.json").write_text(json.dumps({
        "complete": complete_steps(dump), "listing": sorted(p.name for p in folder.iterdir()),
        "manifest_12": json.loads((folder / "step-12" / "titan_checkpoint.json").read_text())}))


@pytest.fixture
def two_rank_runs(build_once, one_ref) -> Path:
    """Every 2-rank run the tests read. Starting torchrun and importing torch cost ~10 s of CPU
    per launch, as much as a run: the runs that must end on their own launch (killed, crashed,
    saving in the background) go first, then one launch (tests/train_runs_worker.py) holds the
    uninterrupted reference and every resumption:

    - ``fsdp2``: uninterrupted, steps 4, 8, 12 in full, 16 model-only;
    - ``killed``: SIGKILLed after step 6, then resumed, exporting its last step as HF;
    - ``crashed``: rank 1 killed inside step 8's save, then resumed;
    - ``async``: background saves keeping 2 steps, then resumed from its step 12;
    - ``pp``: ``one_ref``'s step 8 resumed under PP 2.

    ``launch.log`` holds the shared launch's output (``launching.run_output``)."""

    def build(folder: Path) -> None:
        kill_after_first_checkpoint(folder / "killed")
        crash_in_a_save(folder / "crashed")
        save_in_the_background(folder / "async")
        seed_from(folder / "pp", one_ref, 8)
        runs = [("fsdp2", run_flags(folder / "fsdp2", *FSDP2)),
                ("killed", run_flags(folder / "killed", *FSDP2, "--checkpoint.last_save_in_hf")),
                ("crashed", run_flags(folder / "crashed", *FSDP2)),
                ("async", run_flags(folder / "async", *FSDP2, *ASYNC_RETAINING, "--checkpoint.load_step", "12")),
                ("pp", run_flags(folder / "pp", *PP2))]
        launch_train_runs(2, runs, folder / "launch.log")

    return build_once("ckpt_two_ranks", build)


@pytest.fixture
def fsdp2_ref(two_rank_runs) -> Path:
    """Uninterrupted 2-rank FSDP run: steps 4, 8, 12 in full, 16 model-only."""
    return two_rank_runs / "fsdp2"


@pytest.fixture
def killed_and_resumed(two_rank_runs) -> Path:
    """A 2-rank run SIGKILLed after its first checkpoint, then relaunched; the relaunch exports
    its last step as Hugging Face safetensors."""
    return two_rank_runs / "killed"


@pytest.fixture
def four_rank_runs(build_once, fsdp2_ref) -> Path:
    """The 4-rank resumptions, in one launch: ``tp`` (FSDP 2 x TP 2 from the FSDP 2 run's step
    8) and ``four`` (FSDP 4 from step 12 of ``one``: one process accumulating 2 microbatches,
    itself resumed from the FSDP 2 run's step 8)."""

    def build(folder: Path) -> None:
        seed_from(folder / "tp", fsdp2_ref, 8)
        one = seed_from(folder / "one", fsdp2_ref, 8)
        titan(1, one, *ACCUMULATING)
        seed_from(folder / "four", one, 12)
        launch_train_runs(4, [("tp", run_flags(folder / "tp", *FSDP2_TP2)),
                              ("four", run_flags(folder / "four", *FSDP4))], folder / "launch.log")

    return build_once("ckpt_four_ranks", build)


# ---------------------------------------------------------------------------- 1. kill and resume


def test_sigkill_then_resume_is_bitwise_identical(killed_and_resumed, fsdp2_ref):
    dump = killed_and_resumed
    killed = json.loads((dump / "killed_at.json").read_text())
    resumed_from = killed["complete"][-1]
    assert resumed_from < STEPS and STEPS not in killed["logged"], killed  # really mid-run
    assert f"resumed from step {resumed_from}" in run_output(dump.parent / "launch.log", "killed")

    # metrics.jsonl: the killed run's lines, then the resumed run's steps appended once each.
    n_killed = len(killed["logged"])
    assert logged_steps(dump)[:n_killed] == killed["logged"]
    assert logged_steps(dump)[n_killed:] == list(range(resumed_from + 1, STEPS + 1))

    got, ref = losses(dump), losses(fsdp2_ref)
    tail = range(resumed_from + 1, STEPS + 1)
    assert [got[s] for s in tail] == [ref[s] for s in tail]  # bitwise
    print(f"killed after step {killed['logged'][-1]} (checkpoint {resumed_from}); "
          f"{len(tail)} resumed losses bitwise equal")

    # The final weights too: the resumed run's HF export == the uninterrupted run's DCP save.
    final = dump / "checkpoint" / f"step-{STEPS}"
    exported = load_hf(str(final), adapter_for(final))
    reference = load_dcp_model(str(fsdp2_ref / "checkpoint"))
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)


# ---------------------------------------------------------------------------- 2. resharding


def test_reshard_fsdp2_to_fsdp2_x_tp2(fsdp2_ref, four_rank_runs):
    worst = assert_close_losses(losses(four_rank_runs / "tp"), losses(fsdp2_ref), range(9, STEPS + 1))
    print(f"FSDP2 -> FSDP2xTP2: max rel loss diff {worst:.1e}")


def test_reshard_no_pp_to_pp2_and_back(one_ref, two_rank_runs, tmp_path):
    ref = losses(one_ref)
    pp = two_rank_runs / "pp"  # one_ref's step 8 resumed under PP 2
    worst = assert_close_losses(losses(pp), ref, range(9, STEPS + 1))
    back = seed_from(tmp_path / "back", pp, 12)  # a step written by the pipeline layout
    titan(1, back, *ONE)
    worst = max(worst, assert_close_losses(losses(back), ref, range(13, STEPS + 1)))
    print(f"1 -> PP2 -> 1: max rel loss diff {worst:.1e}")


ACCUMULATING = ["--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", str(GLOBAL_BATCH // 2),
                "--training.global_batch_size", str(GLOBAL_BATCH)]


def test_reshard_across_data_parallel_degrees(fsdp2_ref, four_rank_runs, tmp_path):
    """FSDP 2 -> one process accumulating 2 microbatches -> FSDP 4, data loader included: its
    position is global (windows of the one global stream), so every resumed step trains on
    the global batch the uninterrupted run trained on."""
    ref = losses(fsdp2_ref)
    one = seed_from(tmp_path / "one", fsdp2_ref, 8)

    # Another seq_len cuts the stream into other windows: refused before training, naming the flag.
    failed = titan(1, one, *ONE, "--training.seq_len", str(SEQ // 2), ok=False)
    assert failed.returncode != 0
    assert "cannot restore 'dataloader'" in failed.stderr, failed.stderr[-3000:]
    assert "seq_len=32, this run has seq_len=16" in failed.stderr and "--training.seq_len" in failed.stderr
    assert not (one / "metrics.jsonl").exists()

    # The same global batch, split otherwise (ACCUMULATING, run by four_rank_runs on its own
    # copy of step 8): resumes without --checkpoint.exclude_from_loading.
    worst = assert_close_losses(losses(four_rank_runs / "one"), ref, range(9, STEPS + 1))
    worst = max(worst, assert_close_losses(losses(four_rank_runs / "four"), ref, range(13, STEPS + 1)))
    print(f"FSDP2 -> 1 (2 microbatches) -> FSDP4, loader resumed: max rel loss diff {worst:.1e}")


# ---------------------------------------------------------------------------- 3. crash in a save


def test_crash_during_save_keeps_previous_step(two_rank_runs, fsdp2_ref):
    dump = two_rank_runs / "crashed"
    crashed = json.loads((dump / "crashed_at.json").read_text())
    assert crashed["returncode"] != 0
    assert crashed["complete"] == [4]
    assert crashed["partial_written"] and not crashed["published"]  # step 8 left half-written

    log = run_output(two_rank_runs / "launch.log", "crashed")
    assert "resumed from step 4" in log and "ignoring half-written steps [8]" in log
    got, ref = losses(dump), losses(fsdp2_ref)
    assert [got[s] for s in range(5, STEPS + 1)] == [ref[s] for s in range(5, STEPS + 1)]
    assert not (dump / "checkpoint" / "step-8.tmp").exists()  # replaced by the real step 8


# ---------------------------------------------------------------------------- 4 + 6. async, retention


def test_async_saves_drain_and_keep_latest_k(two_rank_runs, fsdp2_ref):
    dump = two_rank_runs / "async"
    saved = json.loads((dump / "async_saved.json").read_text())  # after the first run
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    ref = losses(fsdp2_ref)
    # Background saves do not perturb training (bitwise): the first run's lines.
    assert {r["step"]: r["loss"] for r in rows[:STEPS]} == ref
    assert saved["complete"] == [12, 16]  # exactly k, the newest
    assert saved["listing"] == ["step-12", "step-16"]  # no leftovers
    assert not saved["manifest_12"]["model_only"] and saved["manifest_12"]["world_size"] == 2
    # The async-saved step holds the state of step 12 (staged before training went on): the
    # run resumed from it (--checkpoint.load_step 12) trains on like the uninterrupted one.
    assert "resumed from step 12" in run_output(two_rank_runs / "launch.log", "async")
    got = losses(dump)
    assert [r["step"] for r in rows[STEPS:]] == list(range(13, STEPS + 1))
    assert [got[s] for s in range(13, STEPS + 1)] == [ref[s] for s in range(13, STEPS + 1)]


# ---------------------------------------------------------------------------- 5. Hugging Face


def adapter_for(folder: Path) -> Llama3StateDictAdapter:
    config = json.loads((folder / "config.json").read_text())
    return Llama3StateDictAdapter(Llama3StateDictAdapter.args_from_hf_config(config))


def convert_hf():
    """tools/convert_hf.py as a module (in process: no interpreter start)."""
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_hf(str(folder))  # no adapter: HF names as stored


def test_hf_export_loads_in_transformers_and_round_trips(killed_and_resumed, fsdp2_ref, tmp_path):
    transformers = pytest.importorskip("transformers")
    export = killed_and_resumed / "checkpoint" / f"step-{STEPS}"
    assert (export / "model.safetensors.index.json").is_file()
    # It states the model's context (the flavor's), not the length this run trained at.
    context = LLAMA3_FLAVORS["debugmodel_tiny"].max_seq_len
    exported = json.loads((export / "config.json").read_text())
    assert context > SEQ and exported["max_position_embeddings"] == context
    # ... and the run's tokenizer's special tokens (the byte tokenizer's), not Llama 3's.
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (ByteTokenizer.bos_id, ByteTokenizer.eos_id)

    # transformers loads the export; its logits equal titan's for the uninterrupted run's
    # weights (a DCP checkpoint, no adapter involved on the titan side).
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    weights = load_dcp_model(str(fsdp2_ref / "checkpoint"))
    args = adapter_for(export).args
    titan_model = Llama3Model(args)
    titan_model.load_state_dict(weights, strict=False)  # the RoPE cache is a buffer
    titan_model.eval()
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = titan_model(tokens).float(), hf_model(tokens).logits.float()
    diff = float((ours - theirs).abs().max())
    assert diff <= 1e-5, diff

    # tools/convert_hf.py, both directions, with the real adapter named by family.
    tool = convert_hf()
    dcp_dir, back = tmp_path / "dcp", tmp_path / "hf"
    tool.main(["from-hf", str(export), str(dcp_dir), "--model", "llama3"])
    tool.main(["to-hf", str(dcp_dir), str(back), "--model", "llama3"])
    original, again = safetensors_of(export), safetensors_of(back)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)  # HF -> titan -> HF: bitwise
    assert json.loads((back / "config.json").read_text()) == json.loads((export / "config.json").read_text())
    # DCP -> HF from the trainer's own checkpoint folder (its config.json travels with it)
    # matches what the trainer exported.
    direct = tmp_path / "direct"
    tool.main(["to-hf", str(fsdp2_ref / "checkpoint"), str(direct), "--model", "llama3"])
    assert all(torch.equal(original[k], v) for k, v in safetensors_of(direct).items())
    print(f"HF export vs titan logits: max abs diff {diff:.1e}")


def test_training_starts_from_hf_weights(killed_and_resumed, tmp_path):
    transformers = pytest.importorskip("transformers")
    from titan.train.data import DatasetConfig, TokenizerConfig, build_dataloader

    export = killed_and_resumed / "checkpoint" / f"step-{STEPS}"
    titan(1, tmp_path, *ONE, "--training.steps", "1", "--checkpoint.initial_load_in_hf",
          "--checkpoint.initial_load_path", str(export))
    # The first batch the run trained on, and the exported model's loss on it.
    loader = build_dataloader(DatasetConfig(name="synthetic", synthetic_documents=2000), TokenizerConfig().build(),
                              dp_rank=0, dp_world_size=1, local_batch_size=GLOBAL_BATCH, seq_len=SEQ, seed=0)
    batch = next(iter(loader))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    with torch.no_grad():
        logits = hf_model(batch["input_ids"]).logits.float()
    expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    got = losses(tmp_path)[1]
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)

    # The same weights under a config.json of another RoPE base: same shapes, another model.
    other = tmp_path / "other_rope"
    shutil.copytree(export, other)
    config = json.loads((other / "config.json").read_text())
    theta = config["rope_theta"]
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = theta / 50
    (other / "config.json").write_text(json.dumps(config))
    refused = titan(1, tmp_path / "refused", *ONE, "--training.steps", "1", "--checkpoint.initial_load_in_hf",
                    "--checkpoint.initial_load_path", str(other), ok=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"rope_theta: checkpoint {theta / 50!r}, this run {theta!r}" in refused.stderr
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- 7. errors


def test_bad_checkpoints_fail_before_training(one_ref, tmp_path):
    ckpt = str(one_ref / "checkpoint")

    other_size = titan(1, tmp_path / "a", *ONE, "--model.flavor", "debugmodel",
                       "--checkpoint.folder", ckpt, ok=False)
    assert other_size.returncode == 1
    assert "has shape" in other_size.stderr and "another model family or size" in other_size.stderr
    assert "Traceback" not in other_size.stderr  # one clear line, not a stack

    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    (not_ckpt / "notes.txt").write_text("hello")
    result = titan(1, tmp_path / "b", *ONE, "--checkpoint.initial_load_path", str(not_ckpt), ok=False)
    assert result.returncode == 1 and "is not a DCP checkpoint" in result.stderr

    missing = titan(1, tmp_path / "c", *ONE, "--checkpoint.folder", ckpt, "--checkpoint.load_step", "7",
                    ok=False)
    assert missing.returncode == 1
    assert "--checkpoint.load_step 7: no such step" in missing.stderr
    assert "Complete steps: [4, 8, 12, 16]" in missing.stderr
    for name in "abc":
        assert not (tmp_path / name / "metrics.jsonl").exists()
    assert complete_steps(one_ref) == [4, 8, 12, 16]  # nothing was written into it


# ---------------------------------------------------------------------------- 1b. automatic restart

# Loaded by every Python process of the job (PYTHONPATH): in the first attempt's rank 1 only,
# `titan train` SIGKILLs itself right after step KILL_AFTER_STEP (checkpoint step 4 is complete,
# step 8 not begun), as a crashed host or an OOM kill would.
KILL_AFTER_STEP = 6
KILLING_SITECUSTOMIZE = '''
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import titan.ckpt.manager as manager

    real_maybe_save = manager.CheckpointManager.maybe_save

    def maybe_save_then_die(self, step, **kwargs):
        saved = real_maybe_save(self, step, **kwargs)
        if step == {step}:
            self.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    manager.CheckpointManager.maybe_save = maybe_save_then_die
'''


def test_max_restarts_resumes_a_killed_rank_to_the_uninterrupted_weights(fsdp2_ref, tmp_path):
    """`tools/run_train.sh --max-restarts 1`: rank 1 is SIGKILLed mid-run; torchrun stops the
    other rank and starts the job again, which resumes from the last complete checkpoint by
    itself and ends with the uninterrupted run's weights, bitwise."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILLING_SITECUSTOMIZE.format(step=KILL_AFTER_STEP))
    dump = tmp_path / "run"
    env = {**ENV, "NPROC": "2", "PYTHON": sys.executable, "LOG_RANK": "0,1",
           "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [str(ROOT / "tools" / "run_train.sh"), "--max-restarts", "1", *COMMON, "--job.dump_folder", str(dump),
           *FSDP2]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "restart 1 of at most 1" in output and "continuing from step 4" in output, output[-6000:]

    # The first attempt logged up to the kill, the restart from step 5 on; the final weights
    # equal the uninterrupted run's.
    assert logged_steps(dump) == [*range(1, KILL_AFTER_STEP + 1), *range(5, STEPS + 1)]
    got, ref = losses(dump), losses(fsdp2_ref)
    assert [got[s] for s in range(5, STEPS + 1)] == [ref[s] for s in range(5, STEPS + 1)]
    final = load_dcp_model(str(dump / "checkpoint"))
    reference = load_dcp_model(str(fsdp2_ref / "checkpoint"))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference)
