"""`titan train --compile.enable` with the inductor backend on CPU: same losses as eager, and
the blocks really were compiled (matching losses alone would also pass with compile off)."""

import json
import subprocess
import sys

import pytest

FLAGS = ["--config", "llama3_debug_synthetic", "--training.steps", "3", "--training.seq_len", "32",
         "--metrics.log_freq", "1"]
# `titan train` exactly as the console script runs it, then what dynamo and inductor counted
# in that process, written to the file named by the first argument.
RUN_AND_COUNT = """
import json, sys
from titan.recipes.cli import main
code = main(sys.argv[2:])
from torch._dynamo.utils import counters
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "dynamo": dict(counters["stats"]), "inductor": dict(counters["inductor"])}, f)
sys.exit(code)
"""


def _run(folder, *extra: str) -> tuple[list[float], dict]:
    """Losses of one `titan train` run and its compile counters."""
    counts = folder.parent / f"{folder.name}_counters.json"
    result = subprocess.run([sys.executable, "-c", RUN_AND_COUNT, str(counts), "train", *FLAGS,
                             "--job.dump_folder", str(folder), *extra],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return losses, json.loads(counts.read_text())


@pytest.mark.slow
def test_inductor_compile_matches_eager(tmp_path):
    # ~35 s on a cold inductor cache (one graph per block kind, reused by every block), ~10 s warm.
    compiled, compiled_counts = _run(tmp_path / "compiled", "--compile.enable")
    eager, eager_counts = _run(tmp_path / "eager")
    # The technique ran: dynamo captured the block graph and inductor built (or loaded) its code;
    # the eager run is the control, with nothing compiled.
    assert compiled_counts["dynamo"].get("unique_graphs", 0) >= 1, (
        f"dynamo captured no graph: {compiled_counts}")
    inductor = compiled_counts["inductor"]
    assert inductor.get("fxgraph_cache_miss", 0) + inductor.get("fxgraph_cache_hit", 0) >= 1, (
        f"inductor compiled no graph: {compiled_counts}")
    assert eager_counts["dynamo"].get("unique_graphs", 0) == 0, eager_counts
    assert len(compiled) == len(eager) == 3
    assert compiled == pytest.approx(eager, rel=1e-4)
