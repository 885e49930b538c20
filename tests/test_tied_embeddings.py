"""Tied input/output embeddings (Llama 3.2 1B/3B style) across packages: the model, its
Hugging Face export/import through titan.ckpt, distributed checkpoints, and the trainer under
FSDP 2 and TP 2 against one process (the end-to-end part is marked slow).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from forked_cli import run_titan
from launching import launch_train_runs
from safetensors import safe_open
from titan.ckpt import load_hf, save_hf
from titan.ckpt.stateful import ModelWrapper
from titan.models.common.init import fill_seeded_
from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

TIED, UNTIED = "debugmodel_tiny_tied", "debugmodel_tiny"
SEED = 0


def tied_model(**overrides) -> torch.nn.Module:
    """The tiny tied flavor, built on meta and materialized like the trainer does."""
    with torch.device("meta"):
        model = build_llama3(TIED, vocab_size=128, max_seq_len=64, **overrides)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------- the model


def test_tied_model_holds_one_matrix_through_meta_init_and_casts():
    model = tied_model()
    assert model.output.weight is model.tok_embeddings.weight  # to_empty did not untie it
    assert [n for n, _ in model.named_parameters()].count("output.weight") == 0
    model.to(torch.float64)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.sharding_plan().tied_parameters == (("tok_embeddings.weight", "output.weight"),)


def test_tied_matrix_counts_once_but_its_output_matmul_still_costs_flops():
    with torch.device("meta"):
        tied, untied = build_llama3(TIED), build_llama3(UNTIED)
    vocab, dim = tied.args.vocab_size, tied.args.dim
    assert untied.num_params() - tied.num_params() == vocab * dim
    assert tied.num_params(exclude_embedding=True) == untied.num_params(exclude_embedding=True) - vocab * dim
    assert tied.flops_per_token(64) == untied.flops_per_token(64)


def test_tied_matrix_is_drawn_once_with_the_output_init():
    model = tied_model()
    expected = torch.empty_like(model.output.weight)
    # The output's init (truncated normal, std dim**-0.5), under the shared parameter's name.
    std = model.args.dim**-0.5
    fill_seeded_(expected, lambda t, g: torch.nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g),
                 seed=SEED, name="tok_embeddings.weight")
    assert torch.equal(model.tok_embeddings.weight, expected)
    # Initial logits stay O(1): the loss starts near log(vocab), not far above it.
    with torch.no_grad():
        logits = model(tokens())
    assert 0.5 < logits.std().item() < 2.0


def test_a_broken_tie_is_refused_at_init():
    model = tied_model()
    model.output.weight = torch.nn.Parameter(model.output.weight.detach().clone())
    with pytest.raises(RuntimeError, match="no longer tok_embeddings.weight"):
        model.init_weights(seed=SEED)


# ---------------------------------------------------------------------------- checkpoints


def test_hf_export_writes_the_hub_layout_and_imports_back_tied(tmp_path):
    model = tied_model()
    adapter = Llama3StateDictAdapter(model.args)
    save_hf(model.state_dict(), str(tmp_path), adapter)
    with safe_open(str(tmp_path / "model-00001-of-00001.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = load_hf(str(tmp_path), adapter)
    assert loaded["output.weight"] is loaded["tok_embeddings.weight"]
    fresh = tied_model()
    with torch.no_grad():
        fresh.tok_embeddings.weight.zero_()
    fresh.load_state_dict(loaded, strict=True)
    assert fresh.output.weight is fresh.tok_embeddings.weight
    torch.testing.assert_close(fresh(tokens()), model(tokens()), rtol=0, atol=0)


def test_hf_export_without_adapter_writes_both_names(tmp_path):
    # Two names for one storage: safetensors refuses shared tensors, the export copies them.
    state = tied_model().state_dict()
    save_hf(state, str(tmp_path))
    loaded = load_hf(str(tmp_path))
    assert torch.equal(loaded["output.weight"], loaded["tok_embeddings.weight"])


def test_hf_export_matches_transformers_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tied_model()
    save_hf(model.state_dict(), str(tmp_path), Llama3StateDictAdapter(model.args), dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        diff = (hf(tokens()).logits - model.eval()(tokens())).abs().max()
    assert diff <= 1e-5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip_keeps_the_tie(tmp_path):
    model = tied_model()
    dcp.save({"model": ModelWrapper(model).state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = tied_model()
    with torch.no_grad():
        fresh.tok_embeddings.weight.zero_()
    state = {"model": ModelWrapper(fresh).state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    ModelWrapper(fresh).load_state_dict(state["model"])
    assert fresh.output.weight is fresh.tok_embeddings.weight
    assert torch.equal(fresh.output.weight, model.output.weight)


# ---------------------------------------------------------------------------- the trainer

STEPS, GLOBAL_BATCH = 6, 4
COMMON = [
    "--config", "llama3_debug_synthetic",
    "--model.flavor", TIED,
    "--training.seq_len", "32",
    "--training.steps", str(STEPS),
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--optimizer.lr", "1e-2",
    "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
    "--dataset.synthetic_documents", "500",
    "--checkpoint.enable",
    "--checkpoint.interval", "3",
    "--checkpoint.last_save_in_hf",
]
ONE = ["--training.local_batch_size", str(GLOBAL_BATCH)]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", str(GLOBAL_BATCH // 2)]
TP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
       "--training.local_batch_size", str(GLOBAL_BATCH)]


def run_flags(dump: Path, *flags: str) -> list[str]:
    """`titan train` flags of one run: the common ones, its dump folder, then ``flags``."""
    return [*COMMON, "--job.dump_folder", str(dump), *flags]


def titan(dump: Path, *flags: str) -> None:
    """One-process `titan train` (forked with titan imported: tests/forked_cli.py); assert it
    succeeded."""
    args = ["train", *run_flags(dump, *flags)]
    result = run_titan(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, f"titan {' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def assert_close_losses(got: dict[int, float], ref: dict[int, float], steps: range) -> None:
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps)
    assert worst <= 2e-5, f"{[got[s] for s in steps]} vs {[ref[s] for s in steps]}"


def exported(dump: Path) -> dict[str, torch.Tensor]:
    folder = dump / "checkpoint" / f"step-{STEPS}"
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return load_hf(str(folder), Llama3StateDictAdapter(Llama3StateDictAdapter.args_from_hf_config(config)))


@pytest.mark.slow
def test_trainer_fsdp2_and_tp2_resharded_match_one_process(tmp_path):
    """One process, FSDP 2 from scratch, then TP 2 starting from FSDP 2's whole step-3
    checkpoint (weights, optimizer state, counters and data position: a reshard of the tied
    matrix and its optimizer state): same losses, same exported weights. Both 2-rank runs in
    one launch (tests/train_runs_worker.py)."""
    one, fsdp, tp = tmp_path / "one", tmp_path / "fsdp2", tmp_path / "tp2"
    titan(one, *ONE)
    from_step_3 = ["--checkpoint.initial_load_path", str(fsdp / "checkpoint" / "step-3"),
                   "--checkpoint.no_initial_load_model_only"]
    launch_train_runs(2, [("fsdp2", run_flags(fsdp, *FSDP2)), ("tp2", run_flags(tp, *TP2, *from_step_3))],
                      tmp_path / "launch.log")
    ref = losses(one)
    assert ref[STEPS] < ref[1]  # it trained
    assert_close_losses(losses(fsdp), ref, range(1, STEPS + 1))
    assert sorted(losses(tp)) == list(range(4, STEPS + 1))  # it went on from step 3
    assert_close_losses(losses(tp), ref, range(4, STEPS + 1))
    ref_weights = exported(one)
    for dump in (fsdp, tp):
        weights = exported(dump)
        assert weights["output.weight"] is weights["tok_embeddings.weight"]
        for key, value in ref_weights.items():
            # Adam divides by each entry's own gradient RMS, so reduction-order noise in a
            # near-zero gradient moves a few weights by ~1e-6; an untied or half-trained matrix
            # would be off by the learning rate (1e-2) per step.
            torch.testing.assert_close(weights[key], value, rtol=1e-3, atol=5e-5,
                                       msg=lambda m, k=key, d=dump: f"{d.name} {k}: {m}")
