"""Expert parallelism trains exactly like one process: losses, every gradient (experts
included), expert loads and weights, under EP alone, with activation checkpointing, EP x
FSDP, EP x HSDP, EP with CP, EP with TP on the dense part (with and without sequence
parallel) and EP inside pipeline stages; uneven routing; checkpoints reshard between EP
layouts; the dry run counts sharded experts.

One spawn per world size: starting processes costs more than training the tiny model.
"""

import os
import subprocess
import sys
import textwrap

import moe_workers as moe
import pytest
import titan_dist_testlib as lib
import torch
from torch.distributed.tensor import Shard

REF = moe.reference_run()

# The module-scoped launches below are per worker: every test reading them goes to one worker
# (--dist loadgroup), so they run once, not once per worker.
pytestmark = pytest.mark.xdist_group("expert_parallel_spawns")

TWO_RANKS = [
    {"parallelism": {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2},
     "ac": {"mode": "full"}},
    {"parallelism": {"data_parallel_shard_degree": 1, "context_parallel_degree": 2,
                     "expert_parallel_degree": 2}},
]
FOUR_RANKS = [
    {"parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2,
                     "expert_parallel_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2,
                     "expert_parallel_degree": 2, "enable_sequence_parallel": False,
                     "enable_loss_parallel": False}},
    {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                     "expert_parallel_degree": 2}},
    {"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2,
                     "expert_parallel_degree": 2}},
    {"parallelism": {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}},  # saves
]
# The checkpoint written by the last 4-rank layout (EP 2 x FSDP 2) is read back under EP 2
# on 2 ranks (expert FSDP 1) and by one process (EP 1).
LOAD_LAYOUT = {"parallelism": {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ep_ckpt"))


@pytest.fixture(scope="module")
def four_ranks(ckpt_dir) -> list:
    return lib.run_ranks(4, moe.train_cases, FOUR_RANKS, ckpt_dir)


@pytest.fixture(scope="module")
def two_ranks(four_ranks, ckpt_dir) -> list:
    return lib.run_ranks(2, moe.two_rank_checks, TWO_RANKS, LOAD_LAYOUT, ckpt_dir)


def _check_training(results: list, cases: list) -> None:
    """Every rank of every layout matches the single-process reference at every step."""
    for i, case in enumerate(cases):
        label = str(case)
        pp = case["parallelism"].get("pipeline_parallel_degree", 1) > 1
        held: set = set()  # pipeline stages hold some parameters each
        for rank, rank_results in enumerate(results):
            r = rank_results[i]
            lib.assert_close_rel(r["losses"], REF["losses"], what=f"{label} losses")
            assert len(r["loads"]) == (0 if pp else len(REF["loads"])), label
            for step, (got, want) in enumerate(zip(r["loads"], REF["loads"], strict=False)):
                assert torch.equal(got, want), f"{label} step {step} loads {got} != {want}"
            for step, (got, want) in enumerate(zip(r["grads"], REF["grads"], strict=True)):
                assert got.keys() <= want.keys() and (pp or got.keys() == want.keys()), label
                held |= got.keys()
                for name in got:
                    lib.assert_close_rel(got[name], want[name],
                                         what=f"{label} rank {rank} step {step} grad {name}")
            for name in r["state"]:
                lib.assert_close_rel(r["state"][name], REF["state"][name], what=f"{label} {name}")
            # The technique ran: experts split over "ep" and FSDP-sharded over the rest of
            # dp_shard x cp, global shapes kept.
            layout = r["layout"]
            assert "ep" in layout["mesh"] and layout["global"] == (moe.N_EXPERTS, 16, lib.DIM)
            p = case["parallelism"]
            dp_shard_cp = p["data_parallel_shard_degree"] * p.get("context_parallel_degree", 1)
            assert torch.Size(layout["local"]).numel() * dp_shard_cp == 4 * 16 * lib.DIM, layout
        assert held == REF["grads"][0].keys(), label


def test_reference_routing_is_uneven():
    """The reference is a real MoE test: experts get different loads."""
    loads = REF["loads"][0]
    assert loads.shape == (moe.MOE_LAYERS, moe.N_EXPERTS)
    assert (loads.sum(1) == lib.BATCH * lib.SEQ * moe.TOP_K).all()
    assert len(set(loads.flatten().tolist())) > 1


@pytest.mark.slow
def test_two_ranks_ep_equals_one_process(two_ranks):
    _check_training([trained for _, trained, _ in two_ranks], TWO_RANKS)


@pytest.mark.slow
def test_four_ranks_ep_with_fsdp_hsdp_and_tp(four_ranks):
    _check_training(four_ranks, FOUR_RANKS)


@pytest.mark.slow
def test_uneven_routing_with_empty_experts_and_splits(two_ranks):
    """Hand-picked counts with an expert nobody routes to and zero-size all-to-all splits:
    outputs and input gradients equal the full module's; each rank's expert gradient is the
    sum of every rank's gradient for its own experts, divided by the EP degree (the expert
    FSDP average over the remaining ranks then completes the mean; checked end to end above)."""
    uneven = [u for u, _, _ in two_ranks]
    for rank, u in enumerate(uneven):
        assert u["local_rows"] == 2 and u["global_shape"] == (moe.N_EXPERTS, 16, lib.DIM)
        assert u["placements"] == [str(Shard(0))]
        assert u["y"].shape[0] == sum(moe.UNEVEN_COUNTS[rank]) + moe.PADDING_ROWS[rank]
        assert not u["y"][sum(moe.UNEVEN_COUNTS[rank]):].any()  # padding rows give zeros
        torch.testing.assert_close(u["y"], u["y_ref"])
        assert torch.equal(u["y"], u["again"])  # deterministic
        torch.testing.assert_close(u["x_grad"], u["x_grad_ref"])
        for name, local in u["local_grads"].items():
            want = u["ref_grads"][name][2 * rank:2 * rank + 2] / 2
            torch.testing.assert_close(local, want, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    assert uneven[0]["local_grads"]["w1"][1].abs().sum() == 0  # expert 1 saw no token


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_reshards_between_ep_layouts(two_ranks, four_ranks, ckpt_dir):
    """EP 2 x FSDP 2 (4 ranks) saved with DCP loads under EP 2 on 2 ranks and in one process
    (EP 1) with the same values: DTensors keep the global expert shapes."""
    import torch.distributed.checkpoint as dcp

    saved = four_ranks[0][-1]["state"]
    for rank_loaded in (loaded for _, _, loaded in two_ranks):
        assert rank_loaded.keys() == saved.keys()
        for name in saved:
            torch.testing.assert_close(rank_loaded[name], saved[name])
    plain = moe.make_moe_model(seed=7).state_dict()
    dcp.load(plain, checkpoint_id=ckpt_dir)  # no process group: one process reads it all
    for name in saved:
        torch.testing.assert_close(plain[name], saved[name])


DRY_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import moe_workers as moe
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
    from titan.dist.dry_run import dry_run

    def run(**degrees):
        return dry_run(moe.MoETransformer, ParallelismConfig(**degrees), world_size=16,
                       activation_checkpoint=ActivationCheckpointConfig(), compile=CompileConfig(),
                       local_batch_size=2, seq_len=16, global_batch_size=-1, print_fn=None)

    est = run(expert_parallel_degree=4)
    print("EP4", est[0].params)
    print("EP1", run()[0].params)
    print("PP2", [e.params for e in run(expert_parallel_degree=4, pipeline_parallel_degree=2)])
    try:
        run(expert_parallel_degree=3)
    except ValueError as err:
        print("ERR", str(err).replace(chr(10), " "))
""")


def _rank0_rows(rows: int, shards: int) -> int:
    """Rows of a dim-0 FSDP shard on rank 0 (torch.chunk: ceil(rows / shards))."""
    return min(rows, -(-rows // shards))


@pytest.mark.slow
def test_dry_run_counts_experts_sharded():
    """16 fake ranks, EP 4 x expert FSDP 4: rank 0 holds 1/16 of every expert weight (one
    expert each, sharded along dim 1) plus its FSDP chunk of each dense weight; EP 1 would
    leave it one whole expert (4 experts chunked over 16 ranks)."""
    out = subprocess.run([sys.executable, "-c", DRY_RUN.format(tests=os.path.dirname(__file__))],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    model = moe.MoETransformer()
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    dense = sum(_rank0_rows(p.shape[0], 16) * p[0].numel()
                for n, p in model.named_parameters() if n not in experts)
    expert_total = sum(p.numel() for p in experts.values())
    assert int(lines["EP4"]) == dense + expert_total // 16
    assert int(lines["EP1"]) == dense + expert_total // moe.N_EXPERTS
    assert all(n > 0 for n in eval(lines["PP2"]))
    for degree in ("expert_parallel_degree=3", "data_parallel_shard_degree=16",
                   "context_parallel_degree=1", "tensor_parallel_degree=1"):
        assert degree in lines["ERR"], lines["ERR"]
