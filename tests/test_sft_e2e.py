"""`titan sft` end to end: the `sft_debug` recipe learns its task (loss falls, greedy answers on
held-out prompts become right), resumes exactly like pretraining, and runs data parallel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked_cli import run_command, run_script_ranks
from titan.ckpt import load_dcp_model

TITAN = [sys.executable, "-m", "titan.recipes.cli"]


def run_sft(dump: Path, *flags: str, ranks: int = 1) -> subprocess.CompletedProcess:
    """`titan sft --config sft_debug` with `flags`; asserts it succeeded."""
    launcher = TITAN if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli"]
    cmd = [*launcher, "sft", "--config", "sft_debug", "--job.dump_folder", str(dump),
           "--metrics.no_enable_progress_bar", *flags]
    result = run_command(cmd, timeout=900, env={**os.environ} if ranks == 1 else {**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]



@torch.no_grad()
def greedy_complete(model: torch.nn.Module, prompt_ids: list[int], *, max_new_tokens: int, eos_id: int) -> list[int]:
    """Greedy continuation of one prompt, written out here (no KV cache, one full forward per
    token): the test's own decoder, independent of the RL generators. Stops at ``eos_id``."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(model(ids)[0, -1].argmax())
        if next_id == eos_id:
            break
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


def held_out_accuracy(
    weights: dict[str, torch.Tensor] | None, n: int = 32, **shape: int
) -> tuple[float, float]:
    """(exact-match rate, per-character rate) of greedy answers on held-out prompts of the
    recipe's task; `weights=None` scores the untrained model of the recipe's seed; `shape`
    overrides model fields as the run's `--model.*` flags did."""
    from titan.models.llama3 import build_llama3
    from titan.train.data.sft import encode_prompt, synthetic_eval_pairs

    from titan.recipes.recipes import recipe

    cfg = recipe("sft_debug")
    tokenizer = cfg.tokenizer.build()
    vocab = 320  # the byte tokenizer padded to a multiple of 64, as the trainer builds it
    model = build_llama3(cfg.model.flavor, vocab_size=vocab, max_seq_len=cfg.training.seq_len, **shape)
    if weights is None:
        model.init_weights(seed=cfg.debug.seed)
    else:
        model.load_state_dict(weights)
    model.eval()
    exact = chars = total = 0
    for prompt, answer in synthetic_eval_pairs(cfg.sft_data)[:n]:
        ids = greedy_complete(model, encode_prompt(prompt, tokenizer), max_new_tokens=len(answer) + 4,
                              eos_id=tokenizer.eos_id)
        got = tokenizer.decode(ids)
        exact += got == answer
        chars += sum(a == b for a, b in zip(got, answer, strict=False))
        total += len(answer)
    return exact / n, chars / total


@pytest.mark.slow
def test_sft_debug_learns_its_task(tmp_path):
    # The recipe's task, data and schedule on a half-width, 4-layer model: it learns the task in
    # 200 steps (~20 s) where the recipe's debugmodel needs minutes on a 2-core CI machine.
    shape = {"dim": 128, "n_layers": 4}
    steps = 200
    run_sft(tmp_path, "--training.steps", str(steps), "--metrics.log_freq", "10", "--checkpoint.enable",
            "--checkpoint.interval", str(steps), "--checkpoint.export_dtype", "float32",
            "--model.dim", str(shape["dim"]), "--model.n_layers", str(shape["n_layers"]), "--optimizer.lr", "3e-3")
    rows = records(tmp_path)
    assert rows[0]["loss"] - rows[-1]["loss"] > 1.0, [r["loss"] for r in rows]
    assert {"epoch", "dropped_examples"} <= rows[-1].keys()
    before = held_out_accuracy(None, **shape)
    after = held_out_accuracy(load_dcp_model(str(tmp_path / "checkpoint")), **shape)
    print(f"held-out greedy exact/char accuracy: before {before}, after {after}")
    assert after[0] >= 0.2 and after[1] >= before[1] + 0.4, (before, after)


@pytest.mark.slow
def test_sft_resumes_exactly_and_matches_under_fsdp(tmp_path):
    """8 steps straight vs 4 steps + resume to 8 (losses bitwise); FSDP 2 from scratch equals
    one process (the data and the document masks are layout-independent)."""
    flags = ["--model.flavor", "debugmodel_tiny", "--training.local_batch_size", "4", "--training.seq_len", "32",
             "--metrics.log_freq", "1", "--training.steps", "8", "--checkpoint.enable",
             "--checkpoint.interval", "4", "--checkpoint.no_last_save_model_only", "--debug.deterministic"]
    straight, resumed, fsdp = tmp_path / "straight", tmp_path / "resumed", tmp_path / "fsdp"
    run_sft(straight, *flags)
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    log = run_sft(resumed, *flags)
    assert "resumed from step 4" in log.stderr + log.stdout
    want = {r["step"]: r["loss"] for r in records(straight)}
    got = {r["step"]: r["loss"] for r in records(resumed)}
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == want[s] for s in got), (got, want)

    run_sft(fsdp, *flags, "--parallelism.data_parallel_shard_degree", "2",
            "--training.local_batch_size", "2", ranks=2)
    sharded = {r["step"]: r["loss"] for r in records(fsdp)}
    assert all(abs(sharded[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (sharded, want)


def test_sft_validation_scores_the_held_out_examples_loss(tmp_path):
    """`titan sft --validation.enable` scores --sft_data.eval_path (its --sft_data.eval_split):
    the loss over the held-out completions' tokens (it once scored the pretraining default, a
    synthetic text corpus).
    Checked against a hand loop over the held-out pairs, one by one, with the saved weights;
    and the flags that would be ignored are refused."""
    from titan.models.llama3 import build_llama3
    from titan.train.data.sft import encode_prompt_completion

    from titan.recipes.recipes import recipe

    def write(name: str, pairs: list[tuple[str, str]]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
        return str(path)

    train = write("train.jsonl", [(f"q{i}: ", "a" * (i % 5 + 1)) for i in range(40)])
    held_out = [("what is two? ", "two"), ("say hi: ", "hi there"), ("x: ", "y")]
    # The held-out rows are the `test_sft` split of a downloaded Hub dataset's folder, beside a
    # `train_sft` split of other rows: only the named split may be scored.
    (tmp_path / "hub" / "data").mkdir(parents=True)
    write("hub/data/train_sft-00000-of-00001.jsonl", [("decoy: ", "not scored at all")] * 4)
    write("hub/data/test_sft-00000-of-00001.jsonl", held_out)
    data = ["--sft_data.format", "prompt_completion", "--sft_data.path", train, "--sft_data.eval_path",
            str(tmp_path / "hub"), "--sft_data.eval_split", "test_sft", "--model.flavor", "debugmodel_tiny"]
    run_sft(tmp_path / "run", *data, "--validation.enable", "--validation.freq", "3", "--training.steps", "3",
            "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.export_dtype", "float32")
    scored = [r for r in records(tmp_path / "run") if "validation_loss" in r]
    assert [r["step"] for r in scored] == [3]

    cfg = recipe("sft_debug")
    tokenizer = cfg.tokenizer.build()
    model = build_llama3("debugmodel_tiny", vocab_size=320, max_seq_len=cfg.training.seq_len)
    model.load_state_dict(load_dcp_model(str(tmp_path / "run" / "checkpoint")))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for prompt, completion in held_out:
            example = encode_prompt_completion(prompt, completion, tokenizer)
            ids = torch.as_tensor(example.ids)
            logits = model(ids[None, :-1])[0]
            targets = torch.as_tensor(example.targets[1:])
            total += float(torch.nn.functional.cross_entropy(logits[targets], ids[1:][targets], reduction="sum"))
            tokens += int(targets.sum())
    assert scored[0]["validation_tokens"] == tokens == sum(len(c) + 1 for _, c in held_out)  # + each EOS
    assert scored[0]["validation_loss"] == pytest.approx(total / tokens, rel=1e-5)

    without_eval_path = data[:4]
    for flags, message in [
        ([*without_eval_path, "--validation.enable"], "set --sft_data.eval_path"),
        (data, "is scored by --validation.enable"),
        (["--validation.enable", "--validation.dataset.name", "stdlib"], "--validation.dataset.* is titan train's"),
    ]:
        args = [*TITAN, "sft", "--config", "sft_debug", "--job.dump_folder", str(tmp_path / "bad"), *flags]
        result = run_command(args, timeout=300)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr[-2000:])


CLOCK_WORKER = """
import datetime
import torch.distributed as dist
import titan.train.data.chat as chat

dist.init_process_group("gloo")
rank = dist.get_rank()
# Rank 1 started two seconds later, on the next day.
chat._TEMPLATE_CLOCK = datetime.datetime(2026, 12, 6, 23, 59, 59) + datetime.timedelta(seconds=2 * rank)
shared = chat.share_template_clock()
print("CLOCK", rank, shared.isoformat(), chat._strftime_now("%d %b %Y"))
dist.barrier()  # no rank tears the group down while another is still in it
dist.destroy_process_group()
"""


def test_every_rank_renders_chat_templates_with_rank_0s_date(tmp_path):
    """Ranks pack the same global rows from their own rendering of the examples: a Llama 3.1
    template's date (strftime_now) is rank 0's on every rank, also across midnight."""
    script = tmp_path / "clock_worker.py"
    script.write_text(CLOCK_WORKER)
    # Under the test's limit: a hung rank fails with what every rank printed.
    result = run_script_ranks(script, [], 2, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("CLOCK"))
    assert lines == [f"CLOCK {rank} 2026-12-06T23:59:59 06 Dec 2026" for rank in (0, 1)], result.stdout[-3000:]
