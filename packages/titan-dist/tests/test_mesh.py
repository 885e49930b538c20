"""A real 2-rank gloo mesh: axis views, batch rank, reductions, mesh-wide grad clipping."""

import pytest
import titan_dist_testlib as lib
import titan_dist_workers as workers
import torch


@pytest.mark.slow
def test_two_rank_mesh_reductions_and_clipping():
    results = lib.run_ranks(2, workers.mesh_and_reductions)
    for rank, r in enumerate(results):
        assert r["names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert r["sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2,
                              "dp": 1, "dp_shard_cp": 1, "dp_cp": 1, "fsdp": 1}
        assert r["dp_rank"] == r["mesh_dp_rank"] == 0
        assert r["mean"] == 0.5 and r["max"] == rank  # dp_cp has size 1: own value
        lib.assert_close_rel(r["norm"], r["expected_norm"])
    torch.testing.assert_close(results[0]["clipped0"], results[1]["clipped0"])
