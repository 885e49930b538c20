"""The parity matrix: every parallel configuration trains exactly like one process.

One spawned process group per world size runs every configuration of that size in turn,
because starting the processes costs more than training the tiny model; the tests read their
slice of it (the module's tests share one pytest-xdist worker, so each spawn runs once).
"""

import pytest
import titan_dist_testlib as lib
import titan_dist_workers as workers

REF = lib.reference_run()
pytestmark = pytest.mark.xdist_group("dist_parity_spawns")


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
def test_two_ranks_fsdp_ddp_tp_sp_cp(two_ranks):
    _check(two_ranks(TWO_RANKS), TWO_RANKS)


PP_SCHEDULES = [
    {"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 1,
                     "pipeline_parallel_schedule": name}}
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                 "ZBVZeroBubble", "DualPipeV")
]


@pytest.mark.slow
def test_two_ranks_every_pipeline_schedule(two_ranks):
    _check(two_ranks(PP_SCHEDULES), PP_SCHEDULES)


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
def test_four_ranks_fsdp_hsdp_2d_cp_pp_ac_compile(four_ranks):
    _check(four_ranks(FOUR_RANKS), FOUR_RANKS)


TP_COMPOSITIONS = [
    {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1,
                     "tensor_parallel_degree": 2}},
    {"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 1,
                     "tensor_parallel_degree": 2}},
]


@pytest.mark.slow
def test_four_ranks_ddp_x_tp_and_pp_x_tp(four_ranks):
    _check(four_ranks(TP_COMPOSITIONS), TP_COMPOSITIONS)


def _spawn_once(world_size: int, groups: list[list[dict]]):
    """Every case of `groups` in one spawn of `world_size` ranks; returns a function from one
    of the groups to each rank's results for its cases."""
    results = lib.run_ranks(world_size, workers.train_cases, [case for group in groups for case in group])
    starts = {id(group): sum(len(g) for g in groups[:i]) for i, group in enumerate(groups)}
    return lambda group: [r[starts[id(group)] : starts[id(group)] + len(group)] for r in results]


@pytest.fixture(scope="module")
def two_ranks():
    return _spawn_once(2, [TWO_RANKS, PP_SCHEDULES])


@pytest.fixture(scope="module")
def four_ranks():
    return _spawn_once(4, [FOUR_RANKS, TP_COMPOSITIONS])
