"""tools/bench/bench_generate.py keeps running (tiny sizes; the numbers are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "tools" / "bench" / "bench_generate.py"


@pytest.mark.slow
def test_bench_generate_runs_at_tiny_size():
    cmd = [sys.executable, str(SCRIPT), "--flavor", "debugmodel_tiny", "--vocab-size", "128", "--prompts", "3",
           "--prompt-len", "6", "--new-tokens", "4", "--rounds", "2", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ratio native/uncached tokens/s" in done.stdout
    assert "ratio sync/load_state_dict seconds" in done.stdout
