"""`titan train --compile.enable` with the inductor backend on CPU: same losses as eager."""

import json
import subprocess
import sys

import pytest

FLAGS = ["--config", "llama3_debug_synthetic", "--training.steps", "3", "--training.seq_len", "32",
         "--metrics.log_freq", "1"]


def _losses(folder, *extra: str) -> list[float]:
    subprocess.run([sys.executable, "-m", "titan.recipes.cli", "train", *FLAGS, "--job.dump_folder", str(folder),
                    *extra], check=True, capture_output=True, timeout=300)
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_inductor_compile_matches_eager(tmp_path):
    # ~35 s on a cold inductor cache (one graph per block kind, reused by every block), ~10 s warm.
    compiled = _losses(tmp_path / "compiled", "--compile.enable")
    eager = _losses(tmp_path / "eager")
    assert len(compiled) == len(eager) == 3
    assert compiled == pytest.approx(eager, rel=1e-4)
