"""tools/bench/ scripts run end to end at tiny sizes and print their ratio lines (so they do not
rot). In process, like tests/test_checkpoint_e2e.py runs tools/convert_hf.py: no interpreter
start. The numbers themselves are not checked; tools/bench/README.md says how to measure."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench"


@pytest.fixture(autouse=True)
def bench_on_path(monkeypatch):
    """Scripts import their shared helpers as siblings, as when run from the command line."""
    monkeypatch.syspath_prepend(str(BENCH))


def load(name: str):
    """tools/bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_model_prints_ratio(capsys):
    pytest.importorskip("transformers")
    rates = load("bench_model").main(
        "--flavor debugmodel_tiny --seq-len 16 --batch-size 2 --rounds 2 --iters 1 --warmup 1".split()
    )
    out = capsys.readouterr().out
    assert "logits agree" in out and "ratio titan/hf tokens/s:" in out
    assert set(rates) == {"titan", "hf"} and all(len(r) == 2 for r in rates.values())


@pytest.mark.slow
def test_bench_data_prints_ratios(capsys):
    pytest.importorskip("datasets")
    load("bench_data").main(
        "--seq-len 16 --batch-size 2 --batches 3 --rounds 2 --dp 1,2 --max-docs 200 "
        "--bpe-vocab 300".split()
    )
    out = capsys.readouterr().out
    for line in (
        "ratio stdlib/byte titan/naive batches/s:",
        "ratio stdlib/byte rank-0 dp2/dp1 batches/s:",
        "ratio jsonl/bpe titan/naive batches/s:",
        "ratio jsonl/bpe rank-0 dp2/dp1 batches/s:",
        "ratio jsonl/bpe streamed/loaded batches/s:",
    ):
        assert line in out, out


def test_bench_train_runs_every_side_and_reports_ratios(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("torchao.float8")
    out_json = tmp_path / "bench.json"
    results = load("bench_train").main(
        f"--flavor debugmodel_tiny --seq-len 16 --batch-size 2 --rounds 2 --iters 1 --warmup 1 "
        f"--float8 rowwise --json {out_json}".split()
    )
    assert set(results["sides"]) == {"titan", "hand", "hf", "titan_float8", "hand_float8"}
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(results))
    ratios = {r["ratio"]: r for r in results["ratios"]}
    # Ratios come from the timings (not constants): recompute one from the sides' medians.
    sides = results["sides"]
    assert ratios["titan/hand"]["value"] == pytest.approx(sides["titan"]["tokens_per_s"] / sides["hand"]["tokens_per_s"])
    assert ratios["titan/hand"]["target"] == 1.00 and ratios["titan/hand"]["met"] in (True, False)
    assert all(side["tokens_per_s"] > 0 and side["saved_activations_mib"] > 0 for side in sides.values())
    # The eager sides' step peaks are counted (more than the activations they save: the
    # gradients and temporaries live too); the memory ratio is theirs.
    for name in ("titan", "hand", "hf"):
        assert sides[name]["step_peak_mib"] > sides[name]["saved_activations_mib"], name
    assert sides["titan_float8"]["step_peak_mib"] is None
    assert results["step_peak_titan_over_hand"]["value"] == pytest.approx(
        sides["titan"]["step_peak_mib"] / sides["hand"]["step_peak_mib"])
    out = capsys.readouterr().out
    assert "| titan/hf |" in out and "ratio titan_float8/titan tokens/s:" in out


def test_bench_cp_attention_prints_a_ratio_per_cp_degree(capsys):
    results = load("bench_cp_attention").main("--seq-len 64 --cp 2 4 --heads 4 --kv-heads 2 --head-dim 8 --rounds 2".split())
    out = capsys.readouterr().out
    for cp in (2, 4):
        assert f"ratio whole rows/titan (cp {cp}) seconds" in out, out
        assert {name: len(s) for name, s in results[cp].items()} == {"titan": 2, "whole rows": 2}


def test_bench_accumulation_checks_both_sides_and_prints_a_ratio(capsys, monkeypatch):
    import sys

    module = load("bench_accumulation")
    monkeypatch.setitem(sys.modules, "bench_accumulation", module)  # the spawned ranks unpickle its worker
    seconds = module.main("--flavor debugmodel_tiny --seq-len 16 --rounds 2".split())
    out = capsys.readouterr().out
    assert "ratio every microbatch/deferred seconds" in out, out
    assert {name: len(s) for name, s in seconds.items()} == {"deferred": 2, "every microbatch": 2}


def test_bench_rl_packing_checks_both_sides_and_prints_a_ratio(capsys):
    seconds = load("bench_rl_packing").main(
        "--flavor debugmodel_tiny --seq-len 64 --completions 16 --max-prompt 16 --max-completion 24 --rounds 2".split())
    out = capsys.readouterr().out
    assert "gradients agree" in out and "ratio padded/packed seconds" in out, out
    assert {name: len(s) for name, s in seconds.items()} == {"padded": 2, "packed": 2}


def test_bench_dpo_packing_checks_both_sides_and_prints_a_ratio(capsys):
    seconds = load("bench_dpo_packing").main(
        "--flavor debugmodel_tiny --seq-len 96 --pairs 12 --max-len 8 --batch-size 4 --rounds 2".split())
    out = capsys.readouterr().out
    assert "gradients agree" in out and "ratio unpacked/packed seconds" in out, out
    assert {name: len(s) for name, s in seconds.items()} == {"one pair per row": 2, "packed": 2}


def test_bench_gkd_times_every_side_and_prints_ratios_to_sft(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(str(tmp_path / "t"))
    times = load("bench_gkd").main(["--teacher", str(tmp_path / "t"), "--rounds", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "ratio gkd lmbda 0 / sft step time" in out and "ratio gkd lmbda 1 / sft step time" in out, out
    assert {side: len(t) for side, t in times.items()} == {"sft": 2, "gkd lmbda 0": 2, "gkd lmbda 1": 2}


def test_bench_gkd_tp_memory_prints_both_peaks_and_their_ratio(capsys):
    """The vocab-parallel divergence keeps less than gathering both models' logits (TP 2: at
    most its own columns of each, plus per-token sums), measured on 2 gloo ranks."""
    peaks = load("bench_gkd_tp_memory").main(["--tokens", "64", "--vocab", "4096", "--chunk-tokens", "32"])
    out = capsys.readouterr().out
    assert "ratio vocab-parallel / gathered peak memory" in out, out
    assert 0 < peaks["vocab-parallel"] < peaks["gathered"], peaks
