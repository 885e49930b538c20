"""Pure-function pieces: pipeline splitting and its errors, CP sharding, TP flag errors."""

import contextlib

import pytest
import titan_dist_testlib as lib
import torch
from titan.dist import ParallelismConfig
from titan.dist.context_parallel import _unshuffle, shard_positions, shard_sequence
from titan.dist.pipeline import (
    even_stage_sizes,
    num_stages_for,
    split_stage,
    stage_ids_of_rank,
    stage_layer_keys,
)
from titan.dist.tensor_parallel import _check_async

KEYS = [str(i) for i in range(4)]


def test_stage_counts_and_rank_assignment():
    cfg = ParallelismConfig(pipeline_parallel_degree=2)
    assert num_stages_for(4, 2, cfg) == 2
    cfg = ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble")
    assert num_stages_for(4, 2, cfg) == 4
    assert stage_ids_of_rank(0, 2, 4, "ZBVZeroBubble") == [0, 3]
    assert stage_ids_of_rank(1, 2, 4, "Interleaved1F1B") == [1, 3]


def test_even_and_explicit_splits():
    assert stage_layer_keys(KEYS + ["4"], 2, ParallelismConfig()) == [["0", "1", "2"], ["3", "4"]]
    cfg = ParallelismConfig(pipeline_parallel_split_points=["layers.1"])
    assert stage_layer_keys(KEYS, 2, cfg) == [["0"], ["1", "2", "3"]]


@pytest.mark.parametrize("kwargs, n_layers, needle", [
    ({"pipeline_parallel_layers_per_stage": 3}, 4, "must divide the model's 4 layers"),
    ({"pipeline_parallel_layers_per_stage": 1, "pipeline_parallel_schedule": "1F1B"}, 4,
     "one stage per rank"),
    ({"pipeline_parallel_layers_per_stage": 2, "pipeline_parallel_schedule": "DualPipeV"}, 4,
     "exactly 2 stages per rank"),
    ({"pipeline_parallel_split_points": ["layers.1", "layers.2"]}, 4, "do not divide evenly"),
])
def test_stage_errors(kwargs, n_layers, needle):
    with pytest.raises(ValueError, match=needle):
        num_stages_for(n_layers, 2, ParallelismConfig(pipeline_parallel_degree=2, **kwargs))


def test_split_point_must_exist():
    with pytest.raises(ValueError, match="not a block"):
        stage_layer_keys(KEYS, 2, ParallelismConfig(pipeline_parallel_split_points=["layers.9"]))


def test_split_stage_runs_the_unchanged_forward():
    model = lib.make_model()
    first = split_stage(model, ["0", "1"], first=True, last=False)
    last = split_stage(model, ["2", "3"], first=False, last=True)
    assert first.output is None and last.tok_embeddings is None and list(last.layers) == ["2", "3"]
    x = lib.make_batches(1)[0][0]
    torch.testing.assert_close(last(first(x)), model(x))


def test_head_tail_sharding_round_trips():
    seq = torch.arange(16)[None]
    shards = [shard_sequence(seq, r, 2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    gathered = torch.cat([s[None, None] for s in shards], dim=-1).transpose(-1, -1)
    assert _unshuffle(gathered.view(1, 1, 16), 2).flatten().tolist() == list(range(16))
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_degree = 8"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


def test_async_tp_needs_cuda():
    class CpuMesh:
        device_type = "cpu"

    with pytest.raises(ValueError, match="enable_async_tensor_parallel needs CUDA"):
        _check_async(ParallelismConfig(enable_async_tensor_parallel=True), CpuMesh())


def test_cpu_offload_on_a_cpu_mesh_is_refused_before_sharding():
    from titan.dist.fsdp import apply_fsdp

    class CpuMesh:
        device_type = "cpu"

    with pytest.raises(ValueError, match="fsdp_cpu_offload .* Drop the flag"):
        apply_fsdp(lib.make_model(), CpuMesh(), ParallelismConfig(fsdp_cpu_offload=True))


def test_a_lost_peer_is_told_apart_from_other_errors():
    from titan.dist.comm import is_peer_lost

    gloo = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32476: Connection reset by peer. This is "
            "typically caused by a remote worker hanging")
    assert is_peer_lost(RuntimeError(gloo))
    assert not is_peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_lost(ValueError(gloo))


def test_a_lost_peer_is_reported_in_one_line_naming_its_cause(monkeypatch):
    import titan.dist.comm as comm

    monkeypatch.setattr(comm, "flight_recorder_dump", lambda: {})
    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is\ntypically..."
    error = comm.PeerLostError.from_error(RuntimeError(gloo), rank=3)
    assert str(error) == ("rank 3 lost a peer in a collective ([gloo/transport/tcp/pair.cc:553] Connection closed by "
                          "peer [127.0.0.1]:1234. This is): another rank left the run; its own error, printed above, "
                          "is the cause")
    assert comm.PeerLostError.from_error(RuntimeError("Timed out waiting 5000ms for recv"), rank=3) is None


def test_a_rank_leaving_after_its_own_error_skips_the_barrier(monkeypatch):
    """`destroy_distributed` waits for every rank, except when this rank closes after an
    error of its own (a peer may wait in a collective it will never join)."""
    import titan.dist.env as env

    calls = []
    monkeypatch.setattr(env.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(env.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(env.dist, "destroy_process_group", lambda: calls.append("destroy"))
    for failed in (False, True):
        monkeypatch.setattr(env, "_started_default_group", True)
        with env.leaving_after_failure() if failed else contextlib.nullcontext():
            env.destroy_distributed()
    assert calls == ["barrier", "destroy", "destroy"]
    assert not env._leaving_after_failure  # restored on leaving the block


def test_the_hang_watchdog_runs_where_stderr_has_no_descriptor(monkeypatch):
    """A loop run in-process under a captured stderr (a notebook, a test) still steps."""
    import io
    import sys

    from titan.dist.comm import HangWatchdog

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    watchdog = HangWatchdog(100)
    watchdog.step_started()  # falls back to the original stderr, or does nothing
    watchdog.stop()


def test_only_a_backends_collective_timeout_is_one():
    """A collective timeout makes the run skip its checkpoint drain; any other error that
    mentions a timeout (a data source, a store) must not."""
    from titan.dist.comm import CollectiveTimeoutError

    gloo = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv "
            "operation to complete")
    nccl = "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"
    for message in (gloo, nccl):
        error = CollectiveTimeoutError.from_error(RuntimeError(message), rank=0, timeout_flag="--comm.x 5",
                                                  trace_folder=None)
        assert error is not None and "rank 0 timed out" in str(error)
    for message in ("HTTP read timeout fetching shard 3", "Socket Timeout", "timed out after 30s reading the corpus"):
        assert CollectiveTimeoutError.from_error(RuntimeError(message), rank=0, timeout_flag="--comm.x 5",
                                                 trace_folder=None) is None


@pytest.mark.slow
def test_replicas_all_reduce_once_after_the_last_microbatch():
    """Inside `replicas_sync_later` a backward leaves each replica's gradients its own (DDP's
    differ across ranks, whose data differ; HSDP's stay inside FSDP: no all-reduce ran); the
    next backward outside
    all-reduces the accumulated sum once: the replicas' mean of their two-microbatch sums,
    for DDP and for HSDP."""
    import titan_dist_testlib as lib
    import titan_dist_workers as workers

    results = lib.run_ranks(2, workers.replicas_sync_later_case)
    ddp_first = [r["ddp_first"] for r in results]
    assert all(not torch.allclose(a, b) for a, b in zip(*ddp_first, strict=True))
    # FSDP2 holds HSDP's reduce-scattered shards until the all-reduce, which has not run.
    assert all(g is None for r in results for g in r["hsdp_first"])
    for name in ("ddp", "hsdp"):
        mean_of_sums = [(a + b) / 2 for a, b in zip(results[0][f"{name}_own_sum"], results[1][f"{name}_own_sum"],
                                                    strict=True)]
        for r in results:
            for got, want in zip(r[f"{name}_last"], mean_of_sums, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_layers, stages, first, last, sizes", [
    (32, 4, 1, 1, [8, 9, 8, 7]),   # 34 units: 9, 9, 8, 8; the embedding and the output a block each
    (32, 4, 0, 0, [8, 8, 8, 8]),
    (8, 2, 1, 1, [4, 4]),          # 10 units: 5, 5
    (8, 2, 0, 2, [5, 3]),          # 10 units: 5, 5; the last stage 2 blocks lighter
    (7, 3, 1, 1, [2, 3, 2]),       # 9 units: 3, 3, 3
    (80, 16, 1, 1, [5, 6, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 4]),  # 82 units: two stages of 6
    (5, 1, 3, 3, [5]),             # one stage holds everything
])
def test_the_even_split_counts_the_first_and_last_stages_extra_work(n_layers, stages, first, last, sizes):
    """Hand-computed: n_layers + first + last units dealt out evenly (the first stages one more),
    the first stage `first` blocks fewer and the last `last` fewer (torchtitan's
    pipeline_parallel_{first,last}_stage_less_layers)."""
    assert even_stage_sizes(n_layers, stages, first, last) == sizes
    cfg = ParallelismConfig(pipeline_parallel_first_stage_less_layers=first,
                            pipeline_parallel_last_stage_less_layers=last)
    keys = [str(i) for i in range(n_layers)]
    split = stage_layer_keys(keys, stages, cfg)
    assert [len(s) for s in split] == sizes and sum(split, []) == keys


def test_stage_weights_errors():
    cfg = ParallelismConfig(pipeline_parallel_first_stage_less_layers=4)  # 8 units: 4, 4; the first 0
    with pytest.raises(ValueError, match=r"gives stages of \[0, 4\] blocks; every stage needs one"):
        stage_layer_keys(KEYS, 2, cfg)
    lps = ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=3,
                            pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_last_stage_less_layers=1)
    with pytest.raises(ValueError, match="must divide the model's 4 layers plus the first and last stages' 0 \\+ 1"):
        num_stages_for(4, 2, lps)
    # 6 layers + 1 + 1 = 8 units in stages of 2: four stages of 1, 2, 2, 1 blocks
    lps = ParallelismConfig(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=2,
                            pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_first_stage_less_layers=1,
                            pipeline_parallel_last_stage_less_layers=1)
    assert num_stages_for(6, 2, lps) == 4
    assert [len(s) for s in stage_layer_keys([str(i) for i in range(6)], 4, lps)] == [1, 2, 2, 1]
    with pytest.raises(ValueError, match="less_layers -1 must be >= 0|must be >= 0, got -1"):
        ParallelismConfig(pipeline_parallel_last_stage_less_layers=-1)
    # Split points name every stage's blocks: the weights are not read there (the command line
    # refuses the two together, tests/test_cli.py).
    points = ParallelismConfig(pipeline_parallel_split_points=["layers.1"], pipeline_parallel_first_stage_less_layers=1)
    assert stage_layer_keys(KEYS, 2, points) == [["0"], ["1", "2", "3"]]


@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_replays_dropout_in_the_recomputation(preserve, monkeypatch):
    """`--activation_checkpoint.preserve_rng_state`: a checkpointed block with dropout gets the
    gradient of the uncheckpointed one only when the recomputation replays the forward's RNG
    state (otherwise it draws another mask); `apply_activation_checkpointing` passes it on."""
    import titan.dist.activation_checkpoint as ac
    from titan.dist import ActivationCheckpointConfig

    def grads(checkpointed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16))
        if checkpointed:
            ac.checkpoint_block(block, preserve_rng_state=preserve)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        block(x).square().sum().backward()
        return block[0].weight.grad

    assert torch.equal(grads(True), grads(False)) is preserve
    seen = []
    monkeypatch.setattr(ac, "checkpoint_block", lambda block, **kw: seen.append(kw["preserve_rng_state"]))
    ac.apply_activation_checkpointing(lib.make_model(), None,
                                      ActivationCheckpointConfig(mode="full", preserve_rng_state=preserve))
    assert seen and set(seen) == {preserve}
