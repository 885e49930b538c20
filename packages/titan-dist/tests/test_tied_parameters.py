"""Tied parameters (one Parameter used by two modules) under FSDP2, TP and PP."""

from __future__ import annotations

import pytest
import tied_workers as workers
import titan_dist_testlib as lib
import torch
from titan.dist import ParallelismConfig
from titan.dist.fsdp import fsdp_units, splits_a_tie
from titan.dist.pipeline import check_pipeline_ties

TIE = workers.TIE


def test_a_unit_holding_half_a_tie_is_left_to_the_root():
    model = workers.make_tied_model()
    units = fsdp_units(model)
    assert model.tok_embeddings not in units and model.output not in units
    assert len(units) == lib.LAYERS  # the blocks stay units of their own
    assert splits_a_tie("output", (TIE,)) and not splits_a_tie("layers.0", (TIE,))
    assert not splits_a_tie("", (TIE,))  # hypothetical unit holding the whole tie


def test_pipeline_refuses_a_tie_across_stages_before_any_work():
    model = workers.make_tied_model()
    check_pipeline_ties(model, 1)  # nothing to split
    check_pipeline_ties(lib.make_model(), 2)  # untied
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree 2.*tok_embeddings\.weight and "
                       r"output\.weight.*first stage, last stage.*degree 1.*tie_word_embeddings"):
        check_pipeline_ties(model, 2)


def test_build_pipeline_refuses_the_tie():
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelDims
    from titan.dist.pipeline import build_pipeline

    # Raises before touching the mesh: no process group is needed to see the refusal.
    cfg = ParallelismConfig(pipeline_parallel_degree=2, data_parallel_shard_degree=1)
    dims = ParallelDims.from_config(cfg, 2)
    with pytest.raises(ValueError, match="stages cannot share a parameter"):
        build_pipeline(workers.make_tied_model(), dims, parallelism=cfg,
                       activation_checkpoint=ActivationCheckpointConfig(), compile=CompileConfig(),
                       loss_fn=lib.loss_fn, local_batch_size=4, device=torch.device("cpu"))


CASES = [
    {"data_parallel_shard_degree": 2},
    {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 1},
    {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 1,
     "enable_sequence_parallel": False, "enable_loss_parallel": False},
]


@pytest.mark.slow
def test_fsdp_and_tp_train_a_tied_model_like_one_process():
    ref = workers.reference_run()
    results = lib.run_ranks(2, workers.tied_cases, CASES)
    for i, case in enumerate(CASES):
        for rank_results in results:
            r = rank_results[i]
            assert r["tied"] and r["tied_after"], case  # one Parameter, before and after steps
            assert r["n_params"] == len(list(workers.make_tied_model().parameters())), case
            if "tensor_parallel_degree" in case:
                assert r["dtensor"], case  # the shared matrix really is vocab-sharded
            else:
                assert r["units"] == ["Block"] * lib.LAYERS, case
            lib.assert_close_rel(r["losses"], ref["losses"], what=f"{case} losses")
            for key, value in ref["state"].items():
                lib.assert_close_rel(r["state"][key], value, what=f"{case} {key}")
