"""`titan dpo` end to end, from the command line: every parallel layout trains like one process.

A pair's two sequences lie in one row, so they are scored wherever the row goes: sharded
parameters (FSDP), a sequence split over context-parallel ranks (the per-document sums are
summed across them, with their gradient), a vocabulary split over tensor-parallel ranks, and
pipeline stages (the last one scores each pipeline microbatch's rows). Each layout also scores
its own reference pass. All must log the one-process run's losses and reward statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launching import RUNS_WORKER, launch_runs, run_output

STEPS = 4
COMMON = [
    "--config", "dpo_debug",
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.global_batch_size", "4",
    "--dpo_data.synthetic_examples", "128",
    "--dpo.rpo_alpha", "0.2",  # the NLL term's own normalization too
    "--dpo_data.synthetic_eval_examples", "10",  # held-out pairs scored at steps 2 and 4
    "--validation.enable", "--validation.freq", "2", "--validation.steps", "-1",
    "--optimizer.lr", "3e-3",
    "--lr_scheduler.warmup_steps", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", "4"],
}
ONE_PROCESS = {
    "one": ["--training.local_batch_size", "4"],
    # two microbatches of 2 rows per step: the pairs' normalizer spans them
    "accumulate2": ["--training.local_batch_size", "2"],
}
# KTO on the same loop: its reference point z0 (the twins' mean log-ratio) is reduced over the
# data-parallel ranks inside the loss; the recipe's warm-up keeps it positive from step 2.
KTO_COMMON = [
    "--config", "kto_debug",
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.global_batch_size", "4",
    "--kto_data.synthetic_eval_examples", "5",  # 10 held-out examples, scored at steps 2 and 4
    "--kto.undesirable_weight", "1.5",
    "--validation.enable", "--validation.freq", "2", "--validation.steps", "-1",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
]
# A reward model on the same loop: a score head, each sequence's reward at its last token (under
# context parallel on one rank only), the centering term on.
REWARD_COMMON = [
    "--config", "reward_debug",
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.global_batch_size", "4",
    "--reward_data.synthetic_examples", "128",
    "--reward.center_rewards_coefficient", "0.05",
    "--reward_data.synthetic_eval_examples", "10",
    "--validation.enable", "--validation.freq", "2", "--validation.steps", "-1",
    "--optimizer.lr", "3e-3",
    "--lr_scheduler.warmup_steps", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
]
# BCO on KTO's loop: its baseline (the running mean of the examples' log-ratios) is summed over
# the data-parallel ranks before each update and checkpointed.
BCO_COMMON = [*KTO_COMMON, "--kto.loss_type", "bco"]
REWARD_COMPARED = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies")
KTO_COMPARED = ("loss", "kl", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
COMPARED = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margins", "logps_chosen", "logps_rejected")
HELD_OUT = ("validation_loss", "validation_rewards_margins", "validation_logps_chosen")


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _assert_every_layout_logs(want: list[dict], command: str, one_folder: Path, two_folder: Path, *,
                              counts: tuple[str, ...], keys: tuple[str, ...], held_out: tuple[str, ...],
                              abs_tol: float = 1e-6) -> dict[str, Path]:
    """Every two-rank layout of ``command`` and its accumulation run log ``want``'s steps, its
    ``counts`` exactly and its ``keys`` (with ``held_out`` on validation steps) to rel 2e-5;
    returns {run name: folder}."""
    runs = {f"{command}_{layout}": two_folder / f"{command}_{layout}" for layout in LAYOUTS}
    runs[f"{command}_accumulate2"] = one_folder / f"{command}_accumulate2"
    for layout, folder in runs.items():
        got = _records(folder)
        assert [r["step"] for r in got] == [r["step"] for r in want], layout
        for g, w in zip(got, want, strict=True):
            assert [g[c] for c in counts] == [w[c] for c in counts], layout
            for key in keys + (held_out if "validation_loss" in w else ()):
                assert g[key] == pytest.approx(w[key], rel=2e-5, abs=abs_tol), (layout, g["step"], key)
    return runs


@pytest.fixture(scope="module")
def runs(build_once):
    """The one-process run and every two-rank layout, each launch once per session."""

    def launch(ranks: int, layouts: dict[str, list[str]], folder: Path) -> None:
        runs = [[f"{method}_{name}", [*common, *flags, "--job.dump_folder", str(folder / f"{method}_{name}")], command]
                for method, command, common in (("dpo", "dpo", COMMON), ("kto", "kto", KTO_COMMON),
                                                ("bco", "kto", BCO_COMMON), ("reward", "reward", REWARD_COMMON))
                for name, flags in layouts.items()]
        launch_runs(ranks, RUNS_WORKER, runs, folder / "launch.log")

    def one(folder: Path) -> None:
        launch(1, ONE_PROCESS, folder)

    def two(folder: Path) -> None:
        launch(2, LAYOUTS, folder)

    return build_once("dpo_one_process", one), build_once("dpo_two_ranks", two)


@pytest.mark.slow
@pytest.mark.xdist_group("dpo_two_ranks")
def test_every_layout_trains_like_one_process(runs):
    one_folder, two_folder = runs
    want = _records(one_folder / "dpo_one")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    # Step 1: log 2 (the policy is the reference) plus 0.2 x the chosen tokens' mean NLL (a
    # synthetic pair's answers are equally long: half the step's label tokens are chosen).
    first = want[0]
    chosen_nll = -first["logps_chosen"] * first["pairs"] / (first["tokens_seen"] / 2)
    assert first["loss"] == pytest.approx(math.log(2) + 0.2 * chosen_nll, rel=1e-5)
    assert want[-1]["rewards_margins"] > 0 and want[-1]["loss"] < want[0]["loss"]
    assert [r["validation_pairs"] for r in want if "validation_loss" in r] == [10, 10]
    runs = _assert_every_layout_logs(want, "dpo", one_folder, two_folder, counts=("pairs",), keys=COMPARED,
                                     held_out=HELD_OUT)
    for layout in runs:
        launch = (one_folder if layout == "dpo_accumulate2" else two_folder) / "launch.log"
        assert "reference log-probs of" in run_output(launch, layout)
        assert "reward accuracy" in run_output(launch, layout)


@pytest.mark.slow
def test_a_transformers_llama_starts_dpo_with_transformers_log_probs(tmp_path):
    """Start from a Hugging Face Llama: step 1's log-probs of its pairs (packed, document-masked,
    the policy equal to the reference) are what transformers computes for each sequence alone."""
    import os

    import torch
    from forked_cli import run_titan
    from titan.rl.preference_data import (
        PreferenceDataConfig,
        build_preference_dataloader,
        build_preference_source,
    )
    from titan.train.data import TokenizerConfig

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                                      rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(str(src))
    dump = tmp_path / "run"
    result = run_titan(["dpo", "--config", "dpo_debug", "--model.flavor", "hf", "--checkpoint.initial_load_in_hf",
                        "--checkpoint.initial_load_path", src, "--training.steps", "1", "--training.seq_len", "64",
                        "--training.local_batch_size", "2", "--dpo_data.synthetic_examples", "32",
                        "--metrics.no_enable_progress_bar", "--job.dump_folder", dump],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    first = _records(dump)[0]

    tokenizer = TokenizerConfig(kind="byte").build()
    data = PreferenceDataConfig(synthetic_task="sort", synthetic_examples=32)
    batch = next(build_preference_dataloader(data, tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=2,
                                             seq_len=64, seed=0))
    pairs = sorted({int(i) for i in batch["pair_index"].unique() if i >= 0})
    model = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    source = build_preference_source(data, tokenizer)
    sums = []
    for index in pairs:
        for side in source.example(index).sides:
            ids = torch.as_tensor(side.ids)[None]
            with torch.no_grad():
                logp = model(ids[:, :-1]).logits.float().log_softmax(-1)[0].gather(-1, ids[0, 1:, None])[:, 0]
            sums.append(float(logp[torch.as_tensor(side.targets[1:])].sum()))
    assert first["pairs"] == len(pairs)
    assert first["logps_chosen"] == pytest.approx(sum(sums[0::2]) / len(pairs), rel=1e-5)
    assert first["logps_rejected"] == pytest.approx(sum(sums[1::2]) / len(pairs), rel=1e-5)
    assert first["rewards_margins"] == pytest.approx(0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("dpo_two_ranks")
def test_kto_trains_like_one_process_in_every_layout(runs):
    one_folder, two_folder = runs
    want = _records(one_folder / "kto_one")
    first = want[0]
    # Step 1: every log-ratio and z0 are 0, so each loss is 1/2 x its weight
    weighted = (first["count_chosen"] + 1.5 * first["count_rejected"]) / first["pairs"]
    assert first["loss"] == pytest.approx(0.5 * weighted, rel=1e-6) and first["kl"] == 0
    assert all(r["kl"] > 0 for r in want[1:])  # the reference point is in play from step 2
    assert [r["validation_pairs"] for r in want if "validation_loss" in r] == [10, 10]
    # kl is a mean of differences of two ~40-nat float32 sums (a log-prob and its reference):
    # their rounding (~4e-6) shows in it, not relative to its size
    _assert_every_layout_logs(want, "kto", one_folder, two_folder, counts=("count_chosen", "count_rejected"),
                              keys=KTO_COMPARED, held_out=("validation_loss", "validation_kl"), abs_tol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("dpo_two_ranks")
def test_bco_trains_like_one_process_in_every_layout_around_its_running_baseline(runs):
    """`titan kto --kto.loss_type bco`: step 1 costs log 2 x the weights (the policy is the
    reference, the baseline 0); every step's delta is, by hand from the logged rewards, beta x
    the mean log-ratio of every example trained so far, this step's included; validation reads
    it without moving it; every layout logs the one-process run's."""
    one_folder, two_folder = runs
    want = _records(one_folder / "bco_one")
    first = want[0]
    weighted = (first["count_chosen"] + 1.5 * first["count_rejected"]) / first["pairs"]
    assert first["loss"] == pytest.approx(math.log(2) * weighted, rel=1e-6) and first["delta"] == 0
    rewards = count = 0.0
    for record in want:  # the implicit rewards are beta x log-ratio: their running mean is delta
        rewards += record["rewards_chosen"] * record["count_chosen"] + record["rewards_rejected"] * record["count_rejected"]
        count += record["count_chosen"] + record["count_rejected"]
        assert record["delta"] == pytest.approx(rewards / count, rel=1e-5, abs=1e-9), record["step"]
        if "validation_loss" in record:
            assert record["validation_delta"] == pytest.approx(record["delta"], rel=1e-12)
    assert want[-1]["delta"] != 0 and "kl" not in want[-1]
    _assert_every_layout_logs(want, "bco", one_folder, two_folder,
                              counts=("count_chosen", "count_rejected"),
                              keys=("loss", "delta", "rewards_chosen", "rewards_rejected", "logps_chosen"),
                              held_out=("validation_loss", "validation_delta"), abs_tol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("dpo_two_ranks")
def test_reward_model_trains_like_one_process_in_every_layout(runs):
    one_folder, two_folder = runs
    want = _records(one_folder / "reward_one")
    assert want[-1]["rewards_margins"] > want[0]["rewards_margins"] and want[-1]["loss"] < want[0]["loss"]
    assert [r["validation_pairs"] for r in want if "validation_loss" in r] == [10, 10]
    _assert_every_layout_logs(want, "reward", one_folder, two_folder, counts=("pairs",), keys=REWARD_COMPARED,
                              held_out=("validation_loss", "validation_rewards_margins"))
