"""tools/bench/ scripts run end to end at tiny sizes and print their ratio lines (so they do not
rot). In process, like tests/test_checkpoint_e2e.py runs tools/convert_hf.py: no interpreter
start. The numbers themselves are not checked; tools/bench/README.md says how to measure."""

from __future__ import annotations

import importlib.util
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
    ):
        assert line in out, out
