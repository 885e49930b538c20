"""The parity matrix: every parallel configuration trains exactly like one process.

Each spawned process group runs several configurations in turn, because starting the
processes costs more than training the tiny model.
"""

import pytest
import titan_dist_testlib as lib
import titan_dist_workers as workers

REF = lib.reference_run()


def _check(results, cases):
    ref_losses, ref_state = REF
    for i, case in enumerate(cases):
        label = str(case)
        states = {}
        for rank_results in results:
            r = rank_results[i]
            lib.assert_close_rel(r["losses"], ref_losses, what=f"{label} losses")
            states.update(r["state"])
        assert states.keys() == ref_state.keys(), label
        for k in ref_state:
            lib.assert_close_rel(states[k], ref_state[k], what=f"{label} {k}")


TWO_RANKS = [
    {"parallelism": {"data_parallel_shard_degree": 2}},
    {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}},
    {"parallelism": {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 1,
                     "enable_sequence_parallel": False, "enable_loss_parallel": False}},
    {"parallelism": {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 1}},
    {"parallelism": {"context_parallel_degree": 2, "data_parallel_shard_degree": 1}},
]


@pytest.mark.slow
def test_two_ranks_fsdp_ddp_tp_sp_cp():
    _check(lib.run_ranks(2, workers.train_cases, TWO_RANKS), TWO_RANKS)


PP_SCHEDULES = [
    {"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 1,
                     "pipeline_parallel_schedule": name}}
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                 "ZBVZeroBubble", "DualPipeV")
]


@pytest.mark.slow
def test_two_ranks_every_pipeline_schedule():
    _check(lib.run_ranks(2, workers.train_cases, PP_SCHEDULES), PP_SCHEDULES)


FOUR_RANKS = [
    {"parallelism": {"data_parallel_shard_degree": 4}},
    {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 2, "context_parallel_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 1, "context_parallel_degree": 4}},
    {"parallelism": {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                     "pipeline_parallel_schedule": "Interleaved1F1B"}},
    {"parallelism": {"data_parallel_shard_degree": 4}, "ac": {"mode": "full"}},
    {"parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
     "ac": {"mode": "selective", "selective_op": True},
     "compile": {"enable": True, "backend": "aot_eager"}},
]


@pytest.mark.slow
def test_four_ranks_fsdp_hsdp_2d_cp_pp_ac_compile():
    _check(lib.run_ranks(4, workers.train_cases, FOUR_RANKS), FOUR_RANKS)


TP_COMPOSITIONS = [
    {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1,
                     "tensor_parallel_degree": 2}},
    {"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 1,
                     "tensor_parallel_degree": 2}},
]


@pytest.mark.slow
def test_four_ranks_ddp_x_tp_and_pp_x_tp():
    _check(lib.run_ranks(4, workers.train_cases, TP_COMPOSITIONS), TP_COMPOSITIONS)
