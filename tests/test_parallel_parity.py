"""The issue-3 parity matrix through the whole stack: `titan train` under every parallel layout
trains exactly like one process.

Each layout is one run of the real `titan train` (Llama 3 ``debugmodel_tiny``, AdamW, the
packed synthetic loader, global-token loss normalization, active grad clipping, metrics.jsonl)
for ``STEPS`` steps from one seed checkpoint. Every logged loss and every final weight must
match a single-process run within fp32 tolerance. Runs of the same world size share one launch
(``train_runs_worker.py``: one process group, the runs one after another), because starting
torchrun costs more than the run itself.

All layouts see the same global batch of ``GLOBAL_BATCH`` sequences per step: the loader packs
one global stream and each data-parallel rank takes its rows of each global batch, so the
reference is one single-process run whatever the data-parallel degree.

The whole matrix runs by default; ``TITAN_PARITY_QUICK=1`` keeps one layout per technique.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from launching import launch_train_runs
from titan.ckpt import load_dcp_model

STEPS = 5
GLOBAL_BATCH = 8
# fp32 end to end. Every logged loss and grad norm: <= 1e-5 relative. The grad norm is the
# sharp check of gradient scaling: AdamW's update is invariant to a gradient's scale and the
# clipping below rescales anyway, so a wrong scale barely shows in losses or weights.
LOSS_RTOL = GRAD_NORM_RTOL = 1e-5
# Weights: every entry within rtol 1e-5 + atol 1e-6 (the atol for entries near zero). AdamW
# divides each gradient entry by its own RMS plus eps: with the default eps 1e-8, an entry whose
# gradient is ~0 by cancellation turns its reassociation error (~1e-10) into a visible update
# (~1e-5), in every layout. eps 1e-5 keeps such noise below the tolerance while staying ~1%
# of a typical gradient entry (~1e-3), so the comparison can be strict.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6

COMMON = [
    "--config", "llama3_debug_synthetic",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.steps", str(STEPS),
    # Below the natural grad norm (~0.8), so clipping is active and its mesh-wide norm matters.
    "--training.max_norm", "0.5",
    "--optimizer.lr", "1e-2",
    "--optimizer.eps", "1e-5",  # see the weight tolerance above
    "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
    "--dataset.synthetic_documents", "2000",
]


def _layout(ranks: int, *flags: str, dp: int = 1, accum: int = 1, quick: bool = False):
    """(ranks, flags, in the quick subset); each data-parallel rank gets GLOBAL_BATCH / dp rows
    per step, in `accum` gradient-accumulation microbatches."""
    return ranks, [*flags, "--training.local_batch_size", str(GLOBAL_BATCH // dp // accum)], quick


def _dp(shard: int = 1, replicate: int = 1) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.data_parallel_replicate_degree", str(replicate)]


def _pp(schedule: str, *, stages_per_rank: int = 1) -> list[str]:
    # 4 layers: one layer per stage gives multi-stage schedules 2 stages per rank.
    layers = ["--parallelism.pipeline_parallel_layers_per_stage", "1"] if stages_per_rank == 2 else []
    return ["--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", schedule, *layers]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
NO_SP = ["--parallelism.no_enable_sequence_parallel", "--parallelism.no_enable_loss_parallel"]
CP = ["--parallelism.context_parallel_degree"]

LAYOUTS: dict[str, tuple[int, list[str], bool]] = {
    "grad_accum2": _layout(1, accum=2, quick=True),
    "fsdp2": _layout(2, *_dp(shard=2), dp=2, quick=True),
    "fsdp2_grad_accum2": _layout(2, *_dp(shard=2), dp=2, accum=2),
    "fsdp4": _layout(4, *_dp(shard=4), dp=4),
    "fsdp2_reshard_always": _layout(2, *_dp(shard=2), "--parallelism.fsdp_reshard_after_forward", "always", dp=2),
    "fsdp2_reshard_never": _layout(2, *_dp(shard=2), "--parallelism.fsdp_reshard_after_forward", "never", dp=2),
    "hsdp2x2": _layout(4, *_dp(shard=2, replicate=2), dp=4, quick=True),
    "ddp2": _layout(2, *_dp(replicate=2), dp=2, quick=True),
    # Accumulation under replicas: the all-reduce waits for the last microbatch (HSDP still
    # reduce-scatters every one), then reduces the sum once.
    "ddp2_grad_accum2": _layout(2, *_dp(replicate=2), dp=2, accum=2),
    "hsdp2x2_grad_accum2": _layout(4, *_dp(shard=2, replicate=2), dp=4, accum=2),
    "tp2": _layout(2, *_dp(), *TP2, *NO_SP, quick=True),
    "tp2_sp": _layout(2, *_dp(), *TP2, quick=True),  # SP and loss parallel are on by default
    # Cross-entropy 48 positions at a time (256 per microbatch, so the last chunk is short):
    # on full logits, and vocab-parallel on TP-sharded ones.
    "chunked_loss": _layout(1, "--training.loss_chunk_tokens", "48", quick=True),
    "tp2_sp_chunked_loss": _layout(2, *_dp(), *TP2, "--training.loss_chunk_tokens", "48", quick=True),
    "fsdp2_tp2": _layout(4, *_dp(shard=2), *TP2, dp=2),
    "pp2_gpipe": _layout(2, *_dp(), *_pp("GPipe")),
    "pp2_1f1b": _layout(2, *_dp(), *_pp("1F1B"), quick=True),
    # torchtitan's uneven split: the last stage (output and loss) a block lighter, 3 + 1 blocks.
    "pp2_1f1b_lighter_last_stage": _layout(2, *_dp(), *_pp("1F1B"),
                                           "--parallelism.pipeline_parallel_last_stage_less_layers", "1"),
    "pp2_interleaved1f1b": _layout(2, *_dp(), *_pp("Interleaved1F1B", stages_per_rank=2), quick=True),
    "pp2_loopedbfs": _layout(2, *_dp(), *_pp("LoopedBFS", stages_per_rank=2)),
    "pp2_interleavedzb": _layout(2, *_dp(), *_pp("InterleavedZeroBubble", stages_per_rank=2)),
    "pp2_zbvzerobubble": _layout(2, *_dp(), *_pp("ZBVZeroBubble", stages_per_rank=2)),
    "pp2_dualpipev": _layout(2, *_dp(), *_pp("DualPipeV", stages_per_rank=2)),
    "pp2_fsdp2": _layout(4, *_dp(shard=2), *_pp("1F1B"), dp=2),
    # The split backward (input, then weight gradients) under FSDP, and under replicas alone
    # (replicated through FSDP2 with a shard group of one: composable DDP mis-synced the
    # interleaved microbatches, 0.3% off under 1F1B, 24% under ZBVZeroBubble).
    "pp2_fsdp2_zbv": _layout(4, *_dp(shard=2), *_pp("ZBVZeroBubble", stages_per_rank=2), dp=2),
    "pp2_ddp2_zbv": _layout(4, *_dp(replicate=2), *_pp("ZBVZeroBubble", stages_per_rank=2), dp=2),
    "cp2": _layout(2, *_dp(), *CP, "2", quick=True),
    "cp4": _layout(4, *_dp(), *CP, "4"),
    "fsdp2_cp2": _layout(4, *_dp(shard=2), *CP, "2", dp=2),
    "tp2_cp2": _layout(4, *_dp(), *TP2, *CP, "2"),
    "pp2_cp2": _layout(4, *_dp(), *_pp("1F1B"), *CP, "2"),
    "ac_full": _layout(1, "--activation_checkpoint.mode", "full", quick=True),
    "ac_selective": _layout(1, "--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_op"),
    # Inductor on CPU: ~20-30 s for the first compile on a cold cache, ~7 s once cached.
    "compile": _layout(1, "--compile.enable"),
}
QUICK = os.environ.get("TITAN_PARITY_QUICK") == "1"


def metrics(dump: Path) -> dict[str, list[float]]:
    """Per-step loss and grad norm from metrics.jsonl (rank 0 logs the global values)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return {key: [r[key] for r in rows] for key in ("loss", "grad_norm")}


def final_weights(dump: Path) -> dict[str, torch.Tensor]:
    return load_dcp_model(str(dump / "checkpoint"))


def save_last_step(*flags: str) -> list[str]:
    """Flags that save the last step's fp32 weights (for the weight comparison)."""
    return ["--checkpoint.enable", "--checkpoint.interval", str(STEPS),
            "--checkpoint.export_dtype", "float32", *flags]


@pytest.fixture(scope="module")
def reference(build_once):
    """The seed checkpoint and the single-process run every layout is compared with; built
    once per session, shared by the pytest-xdist workers."""
    def build(folder: Path) -> None:
        seed_run = ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                    "--training.local_batch_size", str(GLOBAL_BATCH), "--job.dump_folder", str(folder / "seed")]
        ref_run = save_last_step("--checkpoint.initial_load_path", str(folder / "seed" / "checkpoint"),
                                 "--training.local_batch_size", str(GLOBAL_BATCH),
                                 "--job.dump_folder", str(folder / "ref"))
        launch_train_runs(1, [("seed", [*COMMON, *seed_run]), ("ref", [*COMMON, *ref_run])], folder / "launch.log")

    folder = build_once("parity_reference", build)
    seed = folder / "seed" / "checkpoint"
    ref = metrics(folder / "ref")
    # A meaningful reference: clipping acts on every step, and the model learns.
    assert min(ref["grad_norm"]) > 0.5 and ref["loss"][-1] < ref["loss"][0] - 0.3, ref
    return seed, ref, final_weights(folder / "ref")


FROM_SCRATCH = ("fsdp2", "tp2_sp", "pp2_1f1b")
BF16 = _layout(2, *_dp(shard=2), "--training.mixed_precision_param", "bfloat16", dp=2)
SEED_ANY_LAYOUT = (4, [*_dp(shard=2), *TP2, "--training.local_batch_size", "4"])


def group_of(ranks: int, flags: list[str]) -> str:
    """Runs of one world size share a launch; the pipeline schedules of 2 ranks get their own
    (each launch stays ~1 min, and the two pytest-xdist workers can run two at once)."""
    pipeline = ranks == 2 and "--parallelism.pipeline_parallel_degree" in flags
    return f"ranks{ranks}" + ("_pp" if pipeline else "")


def on_the_launching_worker(ranks: int, flags: list[str]) -> pytest.MarkDecorator:
    """The tests that read one launch's runs go to one pytest-xdist worker (conftest.py); the
    one-process runs (the compile layout among them) join every other one-process compile of
    the suite, so the first compile fills the inductor cache for the rest."""
    return pytest.mark.xdist_group("inductor_one_process" if ranks == 1 else f"parity_{group_of(ranks, flags)}")


def planned_runs(seed: Path) -> dict[str, tuple[int, dict[str, list[str]]]]:
    """Every run the tests below read: group -> (ranks, run name -> flags)."""
    groups: dict[str, tuple[int, dict[str, list[str]]]] = {}

    def add(name: str, ranks: int, flags: list[str]) -> None:
        groups.setdefault(group_of(ranks, flags), (ranks, {}))[1][name] = [*COMMON, *flags]

    for name, (ranks, flags, quick) in LAYOUTS.items():
        if quick or not QUICK:
            add(name, ranks, save_last_step("--checkpoint.initial_load_path", str(seed), *flags))
    for name in FROM_SCRATCH:
        ranks, flags, _ = LAYOUTS[name]
        add(f"from_scratch_{name}", ranks, save_last_step(*flags))
    add("bf16", BF16[0], ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), *BF16[1]])
    add("seed_fsdp2_tp2", SEED_ANY_LAYOUT[0],
        ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", *SEED_ANY_LAYOUT[1]])
    return groups


@pytest.fixture(scope="module")
def trained(reference, train_group):
    """run name -> its dump folder, launching its group on first use (one launch per group
    for the whole session, whichever worker asks first)."""
    groups = planned_runs(reference[0])

    def dump_of(name: str) -> Path:
        group = next(g for g, (_, runs) in groups.items() if name in runs)
        ranks, runs = groups[group]
        return train_group(f"parity_{group}", ranks, runs) / name

    return dump_of


def max_rel(got: list[float], ref: list[float]) -> float:
    return max(abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [pytest.param(name, marks=[on_the_launching_worker(ranks, flags),
                               *([pytest.mark.skip("TITAN_PARITY_QUICK=1")] if QUICK and not quick else [])])
     for name, (ranks, flags, quick) in LAYOUTS.items()],
)
def test_layout_matches_one_process(layout, reference, trained):
    _, ref_metrics, ref_weights = reference
    dump = trained(layout)

    got = metrics(dump)
    loss_rel = max_rel(got["loss"], ref_metrics["loss"])
    norm_rel = max_rel(got["grad_norm"], ref_metrics["grad_norm"])
    weights = final_weights(dump)
    assert weights.keys() == ref_weights.keys(), layout
    weight_abs = max(float((weights[k] - ref).abs().max()) for k, ref in ref_weights.items())
    print(f"{layout}: max rel diff loss {loss_rel:.1e}, grad norm {norm_rel:.1e}; "
          f"weights max abs diff {weight_abs:.1e}")

    assert loss_rel <= LOSS_RTOL, f"{layout}: losses {got['loss']} vs one process {ref_metrics['loss']}"
    assert norm_rel <= GRAD_NORM_RTOL, (
        f"{layout}: grad norms {got['grad_norm']} vs one process {ref_metrics['grad_norm']}")
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda m, key=key: f"{layout}: {key}: {m}")


@pytest.mark.slow
@on_the_launching_worker(*BF16[:2])
def test_bf16_compute_tracks_fp32(reference, trained):
    """FSDP 2 with bf16 parameters in compute and fp32 master weights and reductions: the
    losses follow the fp32 single-process run to bf16 precision (~3 significant digits),
    not bitwise; a broken cast or reduction would be off by far more."""
    _, ref_metrics, _ = reference
    got = metrics(trained("bf16"))
    assert max_rel(got["loss"], ref_metrics["loss"]) <= 1e-2, (got["loss"], ref_metrics["loss"])
    assert max_rel(got["loss"], ref_metrics["loss"]) > 0, "bf16 compute should not be bitwise fp32"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=on_the_launching_worker(*LAYOUTS[name][:2]))
                                    for name in FROM_SCRATCH])
def test_layout_from_scratch_matches_one_process(layout, reference, trained):
    """No seed checkpoint: every rank initializes its own shards from `--debug.seed`, as a user's
    first multi-rank run does. Initialization is layout-independent, so the run equals the
    single process (whose seed checkpoint holds the same `--debug.seed 0` weights)."""
    _, ref_metrics, ref_weights = reference
    dump = trained(f"from_scratch_{layout}")
    got = metrics(dump)
    assert max_rel(got["loss"], ref_metrics["loss"]) <= LOSS_RTOL, (layout, got["loss"], ref_metrics["loss"])
    assert max_rel(got["grad_norm"], ref_metrics["grad_norm"]) <= GRAD_NORM_RTOL, layout
    weights = final_weights(dump)
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda m, key=key: f"{layout}: {key}: {m}")


@pytest.mark.slow
@on_the_launching_worker(*SEED_ANY_LAYOUT)
def test_seed_checkpoint_of_any_layout_equals_one_process(reference, trained):
    """A seed checkpoint written by FSDP 2 x TP 2 holds bitwise the single process's initial
    weights, and its shards are not copies of each other (the bug where every rank drew its
    shard from the same generator state)."""
    seed, _, _ = reference
    got, want = final_weights(trained("seed_fsdp2_tp2")), load_dcp_model(str(seed))
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    embedding = got["tok_embeddings.weight"]
    half = embedding.shape[0] // 2
    assert not torch.equal(embedding[:half], embedding[half : 2 * half])
