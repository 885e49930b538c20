"""The "replicate" and "head_norm" tensor-parallel styles (routers, low-rank projections,
per-head q/k norms) give the single-device loss and gradients under TP 2."""

from __future__ import annotations

import pytest
import style_workers as sw
import titan_dist_testlib as lib
import torch


@pytest.mark.slow
def test_replicate_and_head_norm_styles_match_one_device():
    reference = sw.grads(sw.make_block())
    for got in lib.run_ranks(2, sw.tp_grads):
        assert got.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_score_style_matches_one_device(sequence_parallel):
    # A reward model's one-column head cannot be split: every rank reads the whole sequence
    # (gathered from its shards under SP) and returns every position's score.
    reference = sw.score_grads(sw.make_score_model())
    for got in lib.run_ranks(2, sw.tp_score_grads, sequence_parallel):
        assert got["scores"].shape == reference["scores"].shape == (2, 5, 1)
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
