"""`titan train --compile.enable` with the inductor backend on CPU: same losses as eager, and
the blocks really were compiled (matching losses alone would also pass with compile off)."""

import json

import pytest
from forked_cli import run_script

# The block graph of the parity matrix's compile layout (debugmodel_tiny, 8 x 32 tokens,
# deterministic): the inductor cache of the test run (conftest.py) compiles it once for both.
FLAGS = ["--config", "llama3_debug_synthetic", "--model.flavor", "debugmodel_tiny", "--training.steps", "3",
         "--training.seq_len", "32", "--training.local_batch_size", "8", "--debug.deterministic",
         "--debug.seed", "0", "--metrics.log_freq", "1"]
# One worker runs every one-process compile of the suite, one after another, so the first one
# fills the inductor cache for the others (tests/conftest.py).
INDUCTOR = pytest.mark.xdist_group("inductor_one_process")
# `titan train` exactly as the console script runs it, then what dynamo and inductor counted
# in that process, written to the file named by the first argument. Forked from the suite's
# server that imported titan (tests/forked_cli.py: it never runs anything, so the counters
# start at zero as in a fresh interpreter).
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
    script = folder.parent / f"{folder.name}_run_and_count.py"
    script.write_text(RUN_AND_COUNT)
    result = run_script(script, [str(_counters(folder)), "train", *FLAGS, "--job.dump_folder", str(folder), *extra],
                        timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
    return _results(folder)


def _counters(folder):
    return folder.parent / f"{folder.name}_counters.json"


def _results(folder) -> tuple[list[float], dict]:
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return losses, json.loads(_counters(folder).read_text())


@pytest.fixture(scope="module")
def eager(build_once) -> tuple[list[float], dict]:
    """The eager control both compiled runs are compared with, run once per session."""
    return _results(build_once("compile_e2e_eager", lambda folder: _run(folder / "eager")) / "eager")


@pytest.mark.slow
@INDUCTOR
def test_inductor_compile_matches_eager(tmp_path, eager):
    # ~25 s on a cold inductor cache (one graph per block kind, reused by every block), ~7 s warm.
    compiled, compiled_counts = _run(tmp_path / "compiled", "--compile.enable")
    eager, eager_counts = eager
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


@pytest.mark.slow
@INDUCTOR
@pytest.mark.parametrize("name, flags", [
    ("model", ["--compile.granularity", "model"]),  # the whole model as one graph (and the loss)
    ("loss", ["--compile.components", "loss"]),  # the loss's graph only, the blocks eager
])
def test_compile_variant_matches_eager_and_captures_a_graph(tmp_path, eager, name, flags):
    compiled, counts = _run(tmp_path / name, "--compile.enable", *flags)
    eager, _ = eager
    assert counts["dynamo"].get("unique_graphs", 0) >= 1, counts
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_loss_only_compile_leaves_the_model_eager():
    from titan.dist import CompileConfig, apply_compile
    from titan.models.llama3 import build_llama3

    model = build_llama3("debugmodel_tiny", vocab_size=64, max_seq_len=8)
    apply_compile(model, None, CompileConfig(enable=True, components=["loss"]))
    assert model._compiled_call_impl is None
    assert all(block._compiled_call_impl is None for block in model.layers.values())


def test_whole_model_compile_wraps_the_model_not_its_blocks():
    from titan.dist import CompileConfig, apply_compile
    from titan.models.llama3 import build_llama3

    model = build_llama3("debugmodel_tiny", vocab_size=64, max_seq_len=16)
    apply_compile(model, None, CompileConfig(enable=True, granularity="model"))
    assert model._compiled_call_impl is not None
    assert all(block._compiled_call_impl is None for block in model.layers.values())
    blocks = build_llama3("debugmodel_tiny", vocab_size=64, max_seq_len=16)
    apply_compile(blocks, None, CompileConfig(enable=True))
    assert blocks._compiled_call_impl is None
    assert all(block._compiled_call_impl is not None for block in blocks.layers.values())


def test_whole_model_compile_is_refused_with_fsdp_or_pipeline():
    from titan.dist import CompileConfig, ParallelDims, ParallelismConfig, check_compile_options

    whole = CompileConfig(enable=True, granularity="model")
    fsdp = ParallelDims.from_config(ParallelismConfig(), world_size=2)
    pipeline = ParallelDims.from_config(ParallelismConfig(pipeline_parallel_degree=2), world_size=2)
    for dims in (fsdp, pipeline):
        with pytest.raises(ValueError, match="--compile.granularity model"):
            check_compile_options(whole, dims)
    check_compile_options(CompileConfig(enable=True), fsdp)  # per block: fine
    check_compile_options(whole, ParallelDims.from_config(ParallelismConfig(), world_size=1))
    with pytest.raises(ValueError, match="granularity='layer' is unknown"):
        CompileConfig(granularity="layer")


def test_async_tp_without_inductor_compiling_the_model_is_refused():
    """Async TP fuses TP's collectives into inductor's compiled graphs of the model: without
    them the flag would change nothing, so it is refused (as torchtitan does)."""
    from titan.dist import CompileConfig, ParallelDims, ParallelismConfig, check_compile_options

    tp = ParallelDims.from_config(ParallelismConfig(tensor_parallel_degree=2), world_size=2)
    for compile in (CompileConfig(), CompileConfig(enable=True, components=["loss"]),
                    CompileConfig(enable=True, backend="aot_eager")):
        with pytest.raises(ValueError, match="enable_async_tensor_parallel .* needs --compile.enable"):
            check_compile_options(compile, tp, async_tp=True)
    check_compile_options(CompileConfig(enable=True), tp, async_tp=True)
    check_compile_options(CompileConfig(), tp, async_tp=False)
    # Without TP there is nothing to overlap, and nothing to refuse.
    check_compile_options(CompileConfig(), ParallelDims.from_config(ParallelismConfig(), world_size=2), async_tp=True)


def test_async_tp_without_sequence_parallel_is_refused(capsys):
    """torch's micro-pipeline TP pass fuses all-gathers and reduce-scatters with matmuls;
    TP without sequence parallel all-reduces instead, so the flag would fuse nothing: refused
    before anything is built, by the dry run as by `titan train` (the same check)."""
    from titan.dist import CompileConfig, ParallelDims, ParallelismConfig, check_compile_options

    from titan.recipes.cli import main

    tp = ParallelDims.from_config(ParallelismConfig(tensor_parallel_degree=2), world_size=2)
    with pytest.raises(ValueError, match="without sequence parallel TP all-reduces"):
        check_compile_options(CompileConfig(enable=True), tp, async_tp=True, sequence_parallel=False)
    check_compile_options(CompileConfig(enable=True), tp, async_tp=True, sequence_parallel=True)
    rc = main(["dry-run", "--world_size", "2", "--config", "llama3_debug", "--parallelism.tensor_parallel_degree", "2",
               "--compile.enable", "--parallelism.enable_async_tensor_parallel",
               "--parallelism.no_enable_sequence_parallel"])
    assert rc == 2
    assert "drop --parallelism.no_enable_sequence_parallel or the async flag" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_with_a_compiled_model_are_refused(schedule, capsys):
    """The zero-bubble schedules run each backward as an input-gradient and a weight-gradient
    pass; a compiled block's backward computes both in one call (torch refuses these schedules
    for `torch.compile`d stages; through the in-place `module.compile()` a real 2-rank step
    failed on the compiled backward's donated buffers and the other rank waited out the
    collective timeout). Refused before anything is built; compiling only the loss, or the
    model under 1F1B, is fine."""
    from titan.dist import CompileConfig, ParallelDims, ParallelismConfig, check_compile_options

    from titan.recipes.cli import main

    pp = ParallelDims.from_config(ParallelismConfig(pipeline_parallel_degree=2), world_size=2)
    with pytest.raises(ValueError, match=f"{schedule} runs each backward as an input-gradient and a weight-gradient"):
        check_compile_options(CompileConfig(enable=True), pp, pipeline_schedule=schedule)
    check_compile_options(CompileConfig(enable=True, components=["loss"]), pp, pipeline_schedule=schedule)
    check_compile_options(CompileConfig(enable=True), pp, pipeline_schedule="1F1B")
    check_compile_options(CompileConfig(), pp, pipeline_schedule=schedule)
    rc = main(["dry-run", "--world_size", "2", "--config", "llama3_debug", "--parallelism.pipeline_parallel_degree", "2",
               "--parallelism.pipeline_parallel_schedule", schedule, "--compile.enable"])
    assert rc == 2
    assert "with --compile.enable pick 1F1B" in capsys.readouterr().err
