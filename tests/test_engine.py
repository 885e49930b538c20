"""`TrainingEngine` under a loop that is neither pretraining nor SFT: a test-only loop with a
custom loss reading an extra batch key (per-token weights), run under FSDP, TP (with SP and
loss parallel), PP and CP from scratch, equal to one process; and on one process equal to a
hand-written computation of the same loss, and (with unit weights) to the pretraining step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launching import launch_runs

WORKER = Path(__file__).with_name("engine_worker.py")
RTOL = 1e-5

LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_sp": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.local_batch_size", "4"]),
    "cp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
}


def run_loops(build_once, group: str, ranks: int, layouts: dict[str, list[str]]) -> Path:
    """Every loop of `layouts` (name -> flags) in one launch of `ranks` processes, once per
    session; the folder holds one output folder per name."""

    def build(folder: Path) -> None:
        runs = [[str(folder / name), flags] for name, flags in layouts.items()]
        launch_runs(ranks, WORKER, runs, folder / "launch.log", torchrun=False)

    return build_once(group, build)


def results(folder: Path) -> tuple[dict, dict]:
    """(result.json, weights.pt) that rank 0 wrote."""
    return json.loads((folder / "result.json").read_text()), torch.load(folder / "weights.pt", weights_only=True)


@pytest.fixture(scope="module")
def one_process(build_once):
    return results(run_loops(build_once, "engine_ranks1", 1, {"one": []}) / "one")


@pytest.fixture(scope="module")
def two_ranks(build_once):
    """layout -> its results, every layout of LAYOUTS in one launch of 2 ranks."""
    assert {ranks for ranks, _ in LAYOUTS.values()} == {2}
    folder = run_loops(build_once, "engine_ranks2", 2, {name: flags for name, (_, flags) in LAYOUTS.items()})
    return lambda layout: results(folder / layout)


def max_rel(got, ref) -> float:
    return max(abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True))


@pytest.mark.slow
@pytest.mark.xdist_group("engine_loops")  # the tests reading these launches on one worker (conftest.py)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_custom_loss_loop_matches_one_process(layout, one_process, two_ranks):
    ref, ref_weights = one_process
    got, weights = two_ranks(layout)
    assert got["step"] == ref["step"] == 3
    assert max_rel(got["loss"], ref["loss"]) <= RTOL, (got["loss"], ref["loss"])
    assert max_rel(got["grad_norm"], ref["grad_norm"]) <= RTOL, (got["grad_norm"], ref["grad_norm"])
    assert weights["titan"].keys() == ref_weights["titan"].keys()
    for key, value in ref_weights["titan"].items():
        torch.testing.assert_close(weights["titan"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.xdist_group("engine_loops")
def test_full_state_dict_is_the_whole_model_in_both_namings(one_process):
    """Every parameter, full shape; HF names through the family adapter, cast to the dtype."""
    from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

    _, weights = one_process
    titan, hf = weights["titan"], weights["hf"]
    model = build_llama3("debugmodel_tiny", vocab_size=256, max_seq_len=32)
    assert {k: tuple(v.shape) for k, v in titan.items()} == {k: tuple(p.shape) for k, p in model.named_parameters()}
    expected = Llama3StateDictAdapter(model.args).to_hf(titan)
    assert hf.keys() == expected.keys()
    for key, value in expected.items():
        assert hf[key].dtype == torch.bfloat16
        torch.testing.assert_close(hf[key], value.to(torch.bfloat16), rtol=0, atol=0)


def test_one_process_equals_hand_computation_and_pretraining_step(tmp_path):
    """First step on one process: the engine's normalized loss is the hand-computed weighted
    mean, and with unit weights the loop equals the pretraining step (the Trainer's loss)."""
    import importlib.util

    import torch.nn.functional as F
    from titan.models.llama3 import build_llama3
    from titan.train.engine import TrainingEngine
    from titan.train.loss import cross_entropy_sum

    spec = importlib.util.spec_from_file_location("engine_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    import tyro
    from titan.train.config import TrainerConfig

    from titan.recipes.families import model_spec
    from titan.recipes.recipes import recipe

    cfg = tyro.cli(TrainerConfig, default=recipe("llama3_debug_synthetic"), args=[
        "--model.flavor", "debugmodel_tiny", "--training.seq_len", str(worker.SEQ), "--debug.seed", "3",
        "--job.dump_folder", str(tmp_path)], use_underscores=True)
    engine = TrainingEngine.from_config(cfg, model_spec=model_spec("llama3"), vocab_size=worker.VOCAB)
    try:
        batch = worker.global_batches()[0]
        reference = build_llama3("debugmodel_tiny", vocab_size=worker.VOCAB, max_seq_len=worker.SEQ)
        reference.init_weights(seed=3)
        with torch.no_grad():
            logits = reference(batch["input_ids"])
        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        total = float(batch["weights"].sum())
        expected = float((per_token * batch["weights"].flatten()).sum()) / total
        got = engine.forward_backward(batch, worker.weighted_cross_entropy, global_token_count=total)
        assert float(got) == pytest.approx(expected, rel=1e-6)
        engine.zero_grad()
        unit = {**batch, "weights": torch.ones_like(batch["weights"])}
        as_pretraining = engine.forward_backward(
            unit, lambda out, b: cross_entropy_sum(out, b["labels"]), global_token_count=unit["labels"].numel())
        custom = engine.forward_backward(unit, worker.weighted_cross_entropy, global_token_count=unit["labels"].numel())
        assert float(custom) == pytest.approx(float(as_pretraining), rel=1e-6)
        assert float(as_pretraining) == pytest.approx(float(per_token.mean()), rel=1e-6)
    finally:
        engine.close()


def test_auxiliary_loss_is_weighted_by_labelled_tokens():
    """A model part's `aux_loss()` (e.g. an MoE router's) joins the loop's loss, weighted by the
    microbatch's labelled tokens: after the division by the global token count it is a
    token-weighted mean over microbatches and ranks. Parts without one add nothing."""
    from titan.train.engine import TrainingEngine

    class WithAux(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def aux_loss(self):
            return self.value

    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "labels": torch.tensor([[1, 2, -100, 3, 4, -100]])}
    aux = TrainingEngine._auxiliary_loss([WithAux(torch.tensor(0.5)), WithAux(None), torch.nn.Linear(1, 1)], batch)
    assert float(aux) == 0.5 * 4
    assert TrainingEngine._auxiliary_loss([torch.nn.Linear(1, 1)], batch) == 0.0
