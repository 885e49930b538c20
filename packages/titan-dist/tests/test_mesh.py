"""A real 2-rank gloo mesh: axis views, batch rank, reductions, mesh-wide grad clipping."""

import pytest
import titan_dist_testlib as lib
import titan_dist_workers as workers
import torch

# The module-scoped launches below are per worker: every test reading them goes to one worker
# (--dist loadgroup), so they run once, not once per worker.
pytestmark = pytest.mark.xdist_group("mesh_spawn")


def clipped_by_hand(full: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """(total norm, clipped gradients) from the definition: the 2-norm of every full gradient
    as one vector, and each gradient scaled by max_norm / norm when the norm exceeds max_norm."""
    norm = sum(float((g.double() ** 2).sum()) for g in full) ** 0.5
    coef = min(1.0, max_norm / norm)
    return norm, [g * coef for g in full]


def check_clipping(results: list[dict], max_norm: float) -> None:
    """Every rank reports the hand-computed norm and holds the hand-clipped gradients."""
    norm, expected = clipped_by_hand(results[0]["full"], max_norm)
    assert norm > 2 * max_norm  # clipping acts
    for r in results:
        lib.assert_close_rel(r["norm"], norm)
        for got, want in zip(r["clipped"], expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[dict, dict]]:
    """Each rank's (tp 2 mesh results, dp 2 clipping results), from one spawn of 2 ranks."""
    return lib.run_ranks(2, workers.mesh_and_clipping)


@pytest.mark.slow
def test_two_rank_mesh_reductions_and_clipping(two_ranks):
    results = [tp for tp, _ in two_ranks]
    for rank, r in enumerate(results):
        assert r["names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert r["sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2,
                              "dp": 1, "dp_shard_cp": 1, "dp_cp": 1, "fsdp": 1}
        assert r["dp_rank"] == r["mesh_dp_rank"] == 0
        assert r["mean"] == 0.5 and r["max"] == rank  # dp_cp has size 1: own value
        lib.assert_close_rel(r["norm"], r["expected_norm"])
    # tp 2: a Shard(0), a Replicate, a plain and a Partial gradient, clipped to 1.0.
    check_clipping(results, max_norm=1.0)


@pytest.mark.slow
def test_clipping_on_a_dp2_mesh_matches_the_hand_computed_value(two_ranks):
    """dp_shard 2 with 5 gradient rows split 3 + 2: the norm counts each row once."""
    results = [dp for _, dp in two_ranks]
    assert [r["dp_size"] for r in results] == [2, 2]
    assert [r["local_rows"] for r in results] == [3, 2]  # the gradient really is sharded
    check_clipping(results, max_norm=results[0]["max_norm"])


def test_a_native_crash_runs_the_ranks_again_once_with_a_warning(tmp_path):
    """A rank killed by SIGABRT without a Python error (a native crash) is run again from
    scratch once, and the test report carries a warning; a second crash fails the launch."""
    with pytest.warns(UserWarning, match="SIGABRT; running it again from scratch"):
        assert lib.run_ranks(2, workers.abort_once, str(tmp_path)) == [0, 1]
    assert (tmp_path / "aborted").exists()
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match="SIGABRT"):
        lib.run_ranks(2, workers.always_abort)
