"""`titan train --quantize.linear.float8.recipe ...` end to end on CPU (torchao 0.18).

torchao's float8 matmul on CPU is a reference kernel, so these run `debugmodel_tiny` (dim 64)
at batch 4 x seq 32, as the float8 note measured. Each run is checked for the technique
having run (the conversion's log line; a loss trajectory that differs from high precision),
for tracking high precision, and for its parallel layouts and checkpoints.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from launching import run_output

pytest.importorskip("torchao.float8")

TINY = ["--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5",
        "--metrics.no_enable_progress_bar"]
CONVERTED = "converted 28 of 29 linears"  # debugmodel_tiny: 4 blocks x 7 linears; the output stays


# One worker runs every float8 test (they read the same launches, tests/conftest.py).
pytestmark = pytest.mark.xdist_group("float8")
TRACK = ["--training.steps", "40", "--training.mixed_precision_param", "bfloat16"]
# torch's float8 GEMM on CPU is a reference kernel (~140x a bf16 step of this model: 1.2-2 s
# a step here), so every run but one emulates it (the same float8 casts and scales, sharded
# as the layout shards them; high-precision products); one one-process run uses the kernel,
# and one test pairs it with its emulated twin.
EMULATE = ["--quantize.linear.float8.emulate"]
LAYOUT_STEPS = ["--training.steps", "5"]
# Each layout and the recipe it runs (emulated); the same global batch of 4 sequences as one
# process.
LAYOUTS = {
    "tp2": (["--parallelism.tensor_parallel_degree", "2"], "rowwise"),
    # tensorwise under TP + SP gathers the block inputs in float8 (torchao's float8 styles).
    "tp2_tensorwise": (["--parallelism.tensor_parallel_degree", "2"], "tensorwise"),
    "fsdp2_float8_all_gather": (["--training.local_batch_size", "2",
                                 "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                                 "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"], "tensorwise"),
}
CHECKPOINTED = ["--quantize.linear.float8.recipe", "tensorwise", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                "--training.steps", "20", "--training.local_batch_size", "2", "--checkpoint.enable",
                "--checkpoint.interval", "20", "--quantize.linear.float8.emulate"]  # what is saved, not the GEMM


def _recipe(name: str) -> list[str]:
    return ["--quantize.linear.float8.recipe", name]


def _losses(dump: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _runs(train_group, group: str, ranks: int, runs: dict[str, list[str]]) -> Callable[[str], tuple[list[float], str]]:
    """The runs of `group` (one launch per session); name -> (losses per step, its log)."""
    folder = train_group(group, ranks, {name: [*TINY, *flags] for name, flags in runs.items()})
    return lambda name: (_losses(folder / name), run_output(folder / "launch.log", name))


def _one_process(train_group) -> Callable[[str], tuple[list[float], str]]:
    """The one-process references of the layouts ("<recipe>_emulated"), and one run of the
    float8 kernel ("tensorwise")."""
    runs = {f"{recipe}_emulated": [*LAYOUT_STEPS, *_recipe(recipe), *EMULATE] for _, recipe in LAYOUTS.values()}
    return _runs(train_group, "float8_one_process", 1,
                 {**runs, "tensorwise": [*LAYOUT_STEPS, *_recipe("tensorwise")]})


def _two_ranks_folder(train_group) -> Path:
    """Every 2-rank float8 run of this file, in one launch: the folder of their dump folders."""
    runs = {name: [*LAYOUT_STEPS, *_recipe(recipe), *EMULATE, *layout] for name, (layout, recipe) in LAYOUTS.items()}
    return train_group("float8_two_ranks", 2, {name: [*TINY, *flags] for name, flags in
                                               {**runs, "checkpointed": CHECKPOINTED}.items()})


def _two_ranks(train_group) -> Callable[[str], tuple[list[float], str]]:
    folder = _two_ranks_folder(train_group)
    return lambda name: (_losses(folder / name), run_output(folder / "launch.log", name))


def _max_relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_float8_tensorwise_and_rowwise_track_bf16_over_40_steps(train_group):
    run = _runs(train_group, "float8_track", 1,
                {"bf16": TRACK, **{r: [*TRACK, *_recipe(r), *EMULATE] for r in ("tensorwise", "rowwise")}})
    bf16, bf16_log = run("bf16")
    assert "linears" not in bf16_log  # no conversion
    for recipe in ("tensorwise", "rowwise"):
        float8, log = run(recipe)
        assert f"float8 {recipe}: {CONVERTED}" in log
        # The matmuls really ran in float8: the trajectory is not bf16's ...
        assert float8 != bf16
        # ... and still learns what bf16 learns: within 2% of its loss after 40 steps (the
        # issue's target; measured here +0.03% tensorwise, -0.03% rowwise).
        assert float8[-1] < 0.5 * float8[0]
        assert float8[-1] == pytest.approx(bf16[-1], rel=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float8_under_tensor_parallel_and_fsdp_matches_one_process(train_group, layout):
    single, _ = _one_process(train_group)(f"{LAYOUTS[layout][1]}_emulated")
    parallel, log = _two_ranks(train_group)(layout)
    assert CONVERTED in log and "matmuls emulated" in log
    if layout == "tp2_tensorwise":  # what crosses the wire: tests/test_techniques_ran.py
        assert ("float8 tensor parallel: 28 linears with torchao's float8 styles, "
                "8 block inputs all-gathered in float8") in log
    else:
        assert "float8 tensor parallel" not in log
    # The two layouts differ only in the order partial sums are reduced (TP's row-parallel
    # outputs, FSDP's gradient reduce-scatter). A last-bit difference can move an element
    # across an e4m3 rounding boundary (a 2^-4 relative step on that element), which the loss
    # averages over thousands of elements: measured 3e-4 (TP) and 1e-3 (FSDP) over 40 steps of
    # the kernel, 1.4e-6 and 4e-5 over these 5 emulated ones (tensorwise TP, whose scales
    # reduce the amax over the ranks: 1.8e-6); a layout that dropped the
    # conversion or mis-scaled a shard moves the loss by far more.
    assert _max_relative_gap(parallel, single) < 0.01


@pytest.mark.slow
def test_emulated_float8_follows_the_float8_kernel(train_group):
    runs = _one_process(train_group)
    (kernel, kernel_log), (emulated, log) = runs("tensorwise"), runs("tensorwise_emulated")
    assert f"float8 tensorwise: {CONVERTED}" in log and "matmuls emulated" in log
    assert "emulated" not in kernel_log
    # The same float8 casts and scales; only the GEMM's fp32 summation order differs, by ulps
    # per matmul. Over 5 steps that stays orders of magnitude below the float8-vs-bf16 gap
    # (measured: equal to 4 decimals after 6 steps). That the emulated products do take the
    # float8 casts, and that the flag reaches torchao, is checked per linear in
    # packages/titan-train/tests/test_quantize.py.
    assert _max_relative_gap(emulated, kernel) < 1e-3


@pytest.mark.slow
def test_float8_checkpoint_is_high_precision_and_loads_without_the_conversion(train_group):
    from torch.distributed.checkpoint import FileSystemReader

    trained, _ = _two_ranks(train_group)("checkpointed")
    step = _two_ranks_folder(train_group) / "checkpointed" / "checkpoint" / "step-20"
    metadata = FileSystemReader(str(step)).read_metadata()
    dtypes = {name: meta.properties.dtype for name, meta in metadata.state_dict_metadata.items()
              if name.endswith(".weight")}
    assert dtypes and set(dtypes.values()) == {__import__("torch").float32}, dtypes
    # The trained weights load into an unconverted model, and into a converted one.
    load = ["--training.steps", "1", "--checkpoint.initial_load_path", str(step)]
    loaded = _runs(train_group, "float8_loaded", 1, {"plain": load, "converted": [*load, *_recipe("tensorwise")]})
    (plain, plain_log), (converted, _) = loaded("plain"), loaded("converted")
    assert "linears" not in plain_log  # no conversion
    # The trained weights, not a fresh initialization (whose first loss is trained[0], 6.24;
    # 20 steps bring it to ~4.4).
    assert plain[0] < 0.8 * trained[0]
    assert converted[0] == pytest.approx(plain[0], rel=0.01)  # same weights, float8 rounding apart


def test_deepseek_v3_conversion_keeps_mla_low_rank_projections_routers_and_experts_high_precision():
    """DeepSeek-V3's float8 filter, counted: of debugmodel_tiny's 27 linears (3 blocks of MLA's
    wq_a, wq_b, wkv_a, wkv_b, wo; block 0's dense SwiGLU; blocks 1-2's routers and shared
    experts; the output), the TP-replicated low-rank projections, the routers and the output
    stay in high precision, and so do the grouped experts."""
    import torch
    from titan.models.deepseek_v3 import build_deepseek_v3
    from titan.train.quantize import QuantizeConfig, apply_quantization

    with torch.device("meta"):
        model = build_deepseek_v3("debugmodel_tiny", vocab_size=320, max_seq_len=32)
    config = QuantizeConfig()
    config.linear.float8.recipe = "rowwise"
    report = apply_quantization(model, config)
    kept = sorted(report.skipped)
    low_rank = [f"layers.{i}.attention.{name}" for i in range(3) for name in ("wkv_a", "wq_a")]
    routers = [f"layers.{i}.feed_forward.router.gate" for i in (1, 2)]
    assert kept == sorted([*low_rank, *routers, "output"])
    assert len(report.converted) == 27 - len(kept) == 18
    assert "layers.0.attention.wkv_b" in report.converted and "layers.1.feed_forward.shared_experts.w2" in report.converted
    assert report.high_precision_experts == 2
