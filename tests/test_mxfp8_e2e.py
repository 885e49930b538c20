"""`titan train --quantize.linear.mx.recipe_name ... --quantize.grouped_mm.mx.fqns ...` end to end
on CPU (torchao 0.18's MXFP8 training, in its emulated recipe: the MXFP8 GEMMs need an SM100
GPU). Each run is checked for the technique having run (the conversion's log line; a loss
trajectory that differs from high precision), for tracking bf16, and for its checkpoint.
"""

import json
from pathlib import Path

import pytest
import torch
from launching import run_output

pytest.importorskip("torchao.prototype.moe_training.config")

pytestmark = pytest.mark.xdist_group("mxfp8")  # one worker reads the launches below
SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "5", "--metrics.no_enable_progress_bar", "--training.mixed_precision_param",
         "bfloat16"]
DENSE = ["--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", *SMALL, "--training.steps", "40"]
MOE = ["--config", "qwen3_moe_debug", *SMALL, "--training.steps", "20"]
LINEARS = ["--quantize.linear.mx.recipe_name", "mxfp8_emulated_rceil"]
EXPERTS = ["--quantize.grouped_mm.mx.fqns", "experts", "--quantize.grouped_mm.mx.recipe_name", "mxfp8_emulated_rceil"]
CHECKPOINTED = [*DENSE, *LINEARS, "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "20"]
RUNS = {"dense_bf16": DENSE, "dense_mx": [*DENSE, *LINEARS], "moe_bf16": MOE, "moe_mx": [*MOE, *LINEARS, *EXPERTS],
        "checkpointed": CHECKPOINTED}


def _losses(dump: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _run(train_group, group: str, runs: dict[str, list[str]], name: str) -> tuple[list[float], str]:
    folder = train_group(group, 1, runs)
    return _losses(folder / name), run_output(folder / "launch.log", name)


@pytest.mark.slow
@pytest.mark.parametrize("model, converted", [
    ("dense", "mxfp8_emulated_rceil linears: converted 28 of 29 linears"),
    ("moe", "mxfp8_emulated_rceil linears + mxfp8_emulated_rceil experts: converted 16 of 21 linears and 4 "
            "grouped-experts modules"),
])
def test_mxfp8_tracks_bf16(train_group, model, converted):
    bf16, bf16_log = _run(train_group, "mxfp8", RUNS, f"{model}_bf16")
    mx, log = _run(train_group, "mxfp8", RUNS, f"{model}_mx")
    assert "linears" not in bf16_log and converted in log and "emulated" in log
    # The matmuls really ran in MXFP8: the trajectory is not bf16's ...
    assert mx != bf16
    # ... and learns what bf16 learns: within 2% of its final loss (the float8 target).
    assert mx[-1] < 0.8 * mx[0]
    assert mx[-1] == pytest.approx(bf16[-1], rel=0.02)


@pytest.mark.slow
def test_mxfp8_checkpoint_is_high_precision_and_loads_without_the_conversion(train_group):
    from torch.distributed.checkpoint import FileSystemReader

    trained, _ = _run(train_group, "mxfp8", RUNS, "checkpointed")
    step = train_group("mxfp8", 1, RUNS) / "checkpointed" / "checkpoint" / "step-20"
    metadata = FileSystemReader(str(step)).read_metadata()
    dtypes = {name: meta.properties.dtype for name, meta in metadata.state_dict_metadata.items()
              if name.endswith(".weight")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes
    load = [*DENSE, "--training.steps", "1", "--checkpoint.initial_load_path", str(step)]
    loaded = {"plain": load, "converted": [*load, *LINEARS]}
    (plain, plain_log), (converted, _) = (_run(train_group, "mxfp8_loaded", loaded, name) for name in loaded)
    assert "linears" not in plain_log
    assert plain[0] < 0.8 * trained[0]  # the trained weights, not a fresh initialization
    assert converted[0] == pytest.approx(plain[0], rel=0.01)  # same weights, MXFP8 rounding apart
