"""Runs that cannot fit are refused before anything is built (issue 23): the dry run's
estimator against the device's memory, checked against measured peaks."""

from __future__ import annotations

import json
import re

import pytest
from forked_cli import run_titan
from titan.dist.dry_run import format_bytes

import titan.recipes.memory_check as memory_check
from titan.recipes.cli import parse_train_args
from titan.recipes.memory_check import (
    MemoryCheckError,
    check_memory,
    estimate_peak_bytes,
    fitting_flags,
)

ESTIMATE = re.compile(r"memory estimate: ([\d.]+) (GiB|MiB) peak per rank")
UNITS = {"GiB": 2**30, "MiB": 2**20}


@pytest.mark.parametrize("flags", [["--training.seq_len", "100000", "--training.local_batch_size", "64"],
                                   ["--training.local_batch_size", "100000"]], ids=["seq_len", "local_batch"])
def test_a_run_that_cannot_fit_exits_2_before_building_anything(tmp_path, flags):
    """Measured before the check: both started, grew to the machine's 24 GiB and were killed
    by the OOM killer minutes later (exit 137, no message). Sized past any machine's RAM
    (~800 GiB and ~1.6 TiB of activations), so the verdict does not depend on the machine."""
    done = run_titan(["train", "--config", "llama3_debug", *flags, "--job.dump_folder", str(tmp_path / "run")],
                     timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert re.search(r"this run needs about [\d.]+ (GiB|TiB) per rank \(params .* activations", line), line
    assert "--training.local_batch_size" in line and "--debug.skip_memory_check" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_a_context_longer_than_the_flavor_s_is_warned_with_the_rope_consequence(tmp_path):
    done = run_titan(["train", "--config", "llama3_debug", "--training.seq_len", "100000",
                      "--job.dump_folder", str(tmp_path)], timeout=300)
    assert done.returncode == 2  # and refused: 8 x 100000 tokens need ~100 GiB
    assert "--training.seq_len 100000 exceeds llama3 debugmodel's context length (2048): RoPE" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("batch,seq_len", [(4, 1024), (8, 1024), (4, 2048)])
def test_the_estimate_is_within_25_percent_of_the_measured_peak(tmp_path, batch, seq_len):
    """Activations dominate these shapes (0.5-1 GiB of them against ~0.3 GiB of process);
    the measured peak is the process's maximum resident memory after one step. Measured
    here: the estimate reads 0.86x-0.95x of the peak."""
    done = run_titan(["train", "--config", "llama3_debug", "--training.local_batch_size", str(batch),
                      "--training.seq_len", str(seq_len), "--training.steps", "1", "--metrics.log_freq", "1",
                      "--metrics.no_enable_progress_bar", "--job.dump_folder", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    number, unit = ESTIMATE.search(done.stderr).groups()
    estimate = float(number) * UNITS[unit]
    measured = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["memory_peak_gib"] * 2**30
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate / 2**30, measured / 2**30)


def _config(*flags: str):
    return parse_train_args(["--config", "llama3_debug", *flags])


def test_the_refusal_names_flags_that_fit_and_the_skip_flag_runs_anyway(monkeypatch):
    config = _config("--training.local_batch_size", "16", "--training.seq_len", "1024")
    _, estimate = estimate_peak_bytes(config, 1)
    smaller, _ = estimate_peak_bytes(_config("--training.local_batch_size", "4", "--training.seq_len", "1024"), 1)
    limit = (smaller + estimate_peak_bytes(_config("--training.local_batch_size", "8",
                                                    "--training.seq_len", "1024"), 1)[0]) // 2
    monkeypatch.setattr(memory_check, "device_memory", lambda: (limit, "test RAM"))
    with pytest.raises(MemoryCheckError, match=r"more than the [\d.]+ \w+ of test RAM: it fits with "
                                               r"--training.local_batch_size 4"):
        check_memory(config)
    # The suggested batch does fit, the next larger one does not.
    assert "--training.local_batch_size 4" in fitting_flags(config, 1, limit)
    skipped = check_memory(_config("--training.local_batch_size", "16", "--training.seq_len", "1024",
                                   "--debug.skip_memory_check"))
    assert skipped is not None and not skipped.fits and skipped.estimate.total_bytes == estimate.total_bytes


def test_a_run_that_fits_passes_and_full_checkpointing_counts_the_recomputed_block(monkeypatch):
    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**40, "test RAM"))
    plain = check_memory(_config())
    full = check_memory(_config("--activation_checkpoint.mode", "full"))
    assert plain.fits and full.fits
    # Every block's backward holds its activations' gradients; full AC also rebuilds the block.
    assert full.estimate.recompute_bytes > plain.estimate.recompute_bytes > 0
    assert full.estimate.activation_bytes < plain.estimate.activation_bytes


def test_an_rl_run_counts_the_model_copies_rank_0_holds(monkeypatch):
    """titan rl keeps whole model copies beside the trainer's shards: the native generator
    (float32) and, with KL on, the KL reference, each the model's parameters in float32 (by
    hand from its parameter count); PPO's critic is a second model sharded as the policy, with
    its gradients and optimizer states."""
    from titan.models.llama3 import build_llama3

    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**40, "test RAM"))

    def rl_estimate(*flags: str):
        return check_memory(parse_train_args(["--config", "grpo_debug", *flags], command="rl")).estimate

    config = parse_train_args(["--config", "grpo_debug"], command="rl")
    vocab = config.model.resolve_vocab_size(config.tokenizer.build().vocab_size)  # rounded up as the trainer does
    params = sum(p.numel() for p in build_llama3("debugmodel_tiny", vocab_size=vocab, max_seq_len=32).parameters())
    plain = rl_estimate("--rl.kl_coef", "0")
    kl = rl_estimate("--rl.kl_coef", "0.05")
    gae = rl_estimate("--rl.kl_coef", "0.05", "--rl.advantage_estimator", "gae")
    assert plain.copy_bytes == params * 4 and "generator" in plain.copies
    assert kl.copy_bytes - plain.copy_bytes == params * 4 and "KL reference" in kl.copies
    assert gae.copy_bytes - kl.copy_bytes == kl.state_bytes and "critic" in gae.components()


def test_a_reward_model_s_estimate_has_its_score_head_not_the_vocabulary(monkeypatch):
    """titan reward's model ends in a one-column score head: its loss reads one score per
    position, not a vocabulary of logits (the estimate counted the language model's head)."""
    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**40, "test RAM"))
    reward = check_memory(parse_train_args(["--config", "reward_debug"], command="reward")).estimate
    dpo = check_memory(parse_train_args(["--config", "dpo_debug"], command="dpo")).estimate  # the same shapes, an LM head
    vocab = parse_train_args(["--config", "dpo_debug"], command="dpo").tokenizer.build().vocab_size
    assert reward.loss_bytes * 100 < dpo.loss_bytes and reward.params < dpo.params - vocab * 64


def test_a_critic_from_a_smaller_reward_model_is_counted_at_its_size(tmp_path, monkeypatch):
    """--rl.critic_model's config.json is the critic's architecture: a one-layer reward model
    beside the four-layer policy counts its own parameters' share of the states."""
    import json

    from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**40, "test RAM"))
    config = parse_train_args(["--config", "grpo_debug"], command="rl")
    vocab = config.model.resolve_vocab_size(config.tokenizer.build().vocab_size)
    small = build_llama3("debugmodel_tiny", vocab_size=vocab, max_seq_len=32, n_layers=1, num_labels=1)
    (tmp_path / "config.json").write_text(json.dumps(Llama3StateDictAdapter(small.args).hf_config()))
    policy = sum(p.numel() for p in build_llama3("debugmodel_tiny", vocab_size=vocab, max_seq_len=32).parameters())

    def estimate(*flags: str):
        return check_memory(parse_train_args(["--config", "grpo_debug", "--rl.advantage_estimator", "gae", *flags],
                                             command="rl")).estimate

    same, smaller = estimate(), estimate("--rl.critic_model", str(tmp_path))
    ratio = sum(p.numel() for p in small.parameters()) / policy
    assert smaller.copy_bytes - same.copy_bytes == int(same.state_bytes * ratio) - same.state_bytes


def _rl_config(*flags: str):
    return parse_train_args(["--config", "grpo_debug", *flags], command="rl")


def _as_rank(monkeypatch, rank: int, world_size: int, limit: int) -> None:
    """This process as ``rank`` of a ``world_size``-rank launch on a device of ``limit`` bytes
    (the process's own memory left out, so that the figures are the estimate's alone)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(memory_check, "device_memory", lambda: (limit, "test RAM"))
    monkeypatch.setattr(memory_check, "_process_bytes", lambda: 0)


def test_a_generator_rank_checks_its_generating_copy_not_the_trainer_s_estimate(monkeypatch):
    """A disaggregated run's generator rank holds its generating copy alone: a device between
    that copy and the trainer's estimate refuses the trainer rank and passes the generator
    rank; below the copy, the generator rank is refused with its own figures (the model's
    parameters in float32, by hand)."""
    from titan.models.llama3 import build_llama3

    flags = ("--rl.generator_ranks", "1")
    config = _rl_config(*flags)
    vocab = config.model.resolve_vocab_size(config.tokenizer.build().vocab_size)
    copy = 4 * sum(p.numel() for p in build_llama3("debugmodel_tiny", vocab_size=vocab, max_seq_len=32).parameters())
    _as_rank(monkeypatch, 0, 3, 2**40)
    trainer = check_memory(config).estimate.total_bytes
    assert trainer > 2 * copy
    _as_rank(monkeypatch, 2, 3, copy)
    assert check_memory(config) is None  # fits exactly
    _as_rank(monkeypatch, 0, 3, copy)
    with pytest.raises(MemoryCheckError, match="per rank"):
        check_memory(config)
    _as_rank(monkeypatch, 2, 3, copy - 1)
    with pytest.raises(MemoryCheckError, match=re.escape(
            f"generator rank 2 (--rl.generator_ranks 1) needs about {format_bytes(copy)} (a native float32 model "
            f"copy {format_bytes(copy)}), more than the {format_bytes(copy - 1)} of test RAM")):
        check_memory(config)
    assert check_memory(_rl_config(*flags, "--debug.skip_memory_check")) is None


def test_a_generator_rank_that_cannot_fit_names_the_generator_flags_that_would(monkeypatch):
    """Llama 3 8B's generator ranks (6.98e9 parameters with the recipe's small vocabulary,
    counted by hand on the meta device): a native float32 copy (27.9 GB) does not fit 20 GiB,
    vLLM in bfloat16 (14.0 GB plus its KV cache) does; vLLM's bfloat16 engine does not fit 10
    GiB on one rank, sharded over the 2 generator ranks it does, and one rank's weights leave
    the KV cache what the device has beyond them."""
    import torch
    from titan.models.llama3 import build_llama3

    flags = ("--model.flavor", "8B", "--rl.generator_ranks", "2")
    config = _rl_config(*flags)
    with torch.device("meta"):
        model = build_llama3("8B", vocab_size=config.model.resolve_vocab_size(config.tokenizer.build().vocab_size))
    params = sum(p.numel() for p in model.parameters())
    assert 6.9e9 < params < 7.0e9
    _as_rank(monkeypatch, 3, 4, 20 * 2**30)
    with pytest.raises(MemoryCheckError, match=r"a native float32 model copy .* it fits with --generator.kind vllm "
                                               r"--generator.dtype bfloat16; --debug.skip_memory_check"):
        check_memory(_rl_config(*flags))
    limit = 10 * 2**30
    _as_rank(monkeypatch, 2, 4, limit)
    kv_room = (limit - params * 2 // 2) >> 20 << 20  # one rank's share of 2 ranks' bfloat16 weights
    assert kv_room > 256 << 20
    vllm = (*flags, "--generator.kind", "vllm", "--generator.dtype", "bfloat16")
    with pytest.raises(MemoryCheckError, match=r"vLLM's bfloat16 weights and its 256.00 MiB KV cache .* it fits with "
                                               r"--generator.tensor_parallel_size 2; --debug"):
        check_memory(_rl_config(*vllm))
    assert check_memory(_rl_config(*vllm, "--generator.tensor_parallel_size", "2")) is None
    with pytest.raises(MemoryCheckError, match=r"it fits with --generator.kv_cache_memory_bytes "
                                               f"{kv_room}; --debug"):
        check_memory(_rl_config(*vllm, "--generator.tensor_parallel_size", "2",
                                "--generator.kv_cache_memory_bytes", str(kv_room + (1 << 20))))
