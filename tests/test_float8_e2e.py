"""`titan train --quantize.linear.float8.recipe ...` end to end on CPU (torchao 0.18).

torchao's float8 matmul on CPU is a reference kernel, so these run `debugmodel_tiny` (dim 64)
at batch 4 x seq 32, as the float8 note measured. Each run is checked for the technique
having run (the conversion's log line; a loss trajectory that differs from high precision),
for tracking high precision, and for its parallel layouts and checkpoints.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torchao.float8")

TINY = ["--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5"]
CONVERTED = "converted 28 of 29 linears"  # debugmodel_tiny: 4 blocks x 7 linears; the output stays


def _train(folder, *flags: str, ranks: int = 1) -> tuple[list[float], str]:
    """Losses per step of one `titan train` run, and its log."""
    launcher = [sys.executable, "-m", "titan.recipes.cli"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli"]
    result = subprocess.run([*launcher, "train", *TINY, "--job.dump_folder", str(folder), *flags],
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return losses, log


def _max_relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_float8_tensorwise_and_rowwise_track_bf16_over_40_steps(tmp_path):
    steps = ["--training.steps", "40", "--training.mixed_precision_param", "bfloat16"]
    bf16, bf16_log = _train(tmp_path / "bf16", *steps)
    assert "linears" not in bf16_log  # no conversion
    for recipe in ("tensorwise", "rowwise"):
        float8, log = _train(tmp_path / recipe, *steps, "--quantize.linear.float8.recipe", recipe)
        assert f"float8 {recipe}: {CONVERTED}" in log
        # The matmuls really ran in float8: the trajectory is not bf16's ...
        assert float8 != bf16
        # ... and still learns what bf16 learns: within 2% of its loss after 40 steps (the
        # issue's target; measured here +0.03% tensorwise, -0.03% rowwise).
        assert float8[-1] < 0.5 * float8[0]
        assert float8[-1] == pytest.approx(bf16[-1], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("layout, recipe", [
    (["--parallelism.tensor_parallel_degree", "2"], "rowwise"),
    (["--training.local_batch_size", "2", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
      "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"], "tensorwise"),
], ids=["tp2", "fsdp2_float8_all_gather"])
def test_float8_under_tensor_parallel_and_fsdp_matches_one_process(tmp_path, layout, recipe):
    # The same global batch of 4 sequences on one process and on two ranks.
    flags = ["--training.steps", "10", "--quantize.linear.float8.recipe", recipe]
    single, _ = _train(tmp_path / "single", *flags)
    parallel, log = _train(tmp_path / "parallel", *flags, *layout, ranks=2)
    assert CONVERTED in log
    # The two layouts differ only in the order partial sums are reduced (TP's row-parallel
    # outputs, FSDP's gradient reduce-scatter). A last-bit difference can move an element
    # across an e4m3 rounding boundary (a 2^-4 relative step on that element), which the loss
    # averages over thousands of elements: measured 3e-4 (TP) and 1e-3 (FSDP) over 40 steps;
    # a layout that dropped the conversion or mis-scaled a shard moves the loss by far more.
    assert _max_relative_gap(parallel, single) < 0.01


@pytest.mark.slow
def test_float8_checkpoint_is_high_precision_and_loads_without_the_conversion(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    float8 = ["--quantize.linear.float8.recipe", "tensorwise",
              "--quantize.linear.float8.enable_fsdp_float8_all_gather"]
    trained, _ = _train(tmp_path / "float8", "--training.steps", "20", "--training.local_batch_size", "2",
                        "--checkpoint.enable", "--checkpoint.interval", "20", *float8, ranks=2)
    step = tmp_path / "float8" / "checkpoint" / "step-20"
    metadata = FileSystemReader(str(step)).read_metadata()
    dtypes = {name: meta.properties.dtype for name, meta in metadata.state_dict_metadata.items()
              if name.endswith(".weight")}
    assert dtypes and set(dtypes.values()) == {__import__("torch").float32}, dtypes
    # The trained weights load into an unconverted model, and into a converted one.
    load = ["--training.steps", "1", "--checkpoint.initial_load_path", str(step)]
    plain, plain_log = _train(tmp_path / "plain", *load)
    converted, _ = _train(tmp_path / "converted", *load, "--quantize.linear.float8.recipe", "tensorwise")
    assert "linears" not in plain_log  # no conversion
    # The trained weights, not a fresh initialization (whose first loss is trained[0], 6.24;
    # 20 steps bring it to ~4.4).
    assert plain[0] < 0.8 * trained[0]
    assert converted[0] == pytest.approx(plain[0], rel=0.01)  # same weights, float8 rounding apart
