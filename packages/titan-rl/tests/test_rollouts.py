"""Rollouts become engine batches: rows, labels, masks and advantages laid out by hand."""

from __future__ import annotations

import pytest
import torch
from titan.rl.generate.base import Completion
from titan.rl.rollouts import (
    Rollout,
    adapted_kl_coef,
    build_batch,
    mean_token_kl,
    rollout_rows,
    rollout_stats,
    split_rows,
)

PAD = 0


def completion(prompt, tokens, finish="stop"):
    return Completion(prompt_ids=prompt, token_ids=tokens, logprobs=[-0.1 * (i + 1) for i in range(len(tokens))],
                      finish_reason=finish)


def rollout():
    """Two prompts x two completions; the second group's rewards are equal (no signal)."""
    groups = [
        [completion([1, 2, 3], [7, 8]), completion([1, 2, 3], [9, 9, 9], finish="length")],
        [completion([4, 5], [6]), completion([4, 5], [6, 6])],
    ]
    return Rollout(index=0, version=3, groups=groups, rewards=[[1.0, 0.0], [0.5, 0.5]])


def test_batch_layout_by_hand():
    rows = rollout_rows(rollout())
    assert len(rows) == 2  # the zero-variance group is dropped
    batch = build_batch(rows[:1], seq_len=6, pad_id=PAD)
    # Sequence 1 2 3 7 8: inputs drop the last token; labels are the completion tokens only.
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, PAD, PAD]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, -100, -100]]
    assert batch["positions"].tolist() == [[0, 1, 2, 3, 0, 1]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, -1, -1]]
    torch.testing.assert_close(batch["old_logprobs"], torch.tensor([[0.0, 0.0, -0.1, -0.2, 0.0, 0.0]]))
    # Advantage of reward 1 in group (1, 0): (1 - 0.5) / 0.5 = 1, on each completion token.
    torch.testing.assert_close(batch["advantages"], torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]), atol=1e-5, rtol=0)
    assert batch["loss_mask"].tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]
    assert batch["sequence_lengths"].tolist() == [[0.0, 0.0, 2.0, 2.0, 0.0, 0.0]]
    assert "ref_logprobs" not in batch


def test_truncated_completions_are_masked_when_asked():
    kept = rollout_rows(rollout(), mask_truncated=True)
    assert [r.train for r in kept] == [True, False]
    batch = build_batch(kept, seq_len=6, pad_id=PAD)
    assert batch["loss_mask"][1].sum() == 0
    assert batch["labels"][1].tolist() == [-100, -100, 9, 9, 9, -100]  # still scored for logprob checks
    assert len(rollout_rows(rollout(), drop_zero_variance=False)) == 4


def test_dr_grpo_advantages_and_stats():
    rows = rollout_rows(rollout(), normalize_std=False, drop_zero_variance=False)
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5, 0.0, 0.0])
    stats = rollout_stats(rollout())
    assert stats["reward_mean"] == pytest.approx(0.5)
    assert stats["reward_std"] == pytest.approx(((0.25 + 0.25 + 0 + 0) / 4) ** 0.5)
    assert stats["response_length_mean"] == pytest.approx((2 + 3 + 1 + 2) / 4)
    assert stats["truncated_fraction"] == pytest.approx(0.25)
    assert stats["zero_variance_fraction"] == pytest.approx(0.5)


def test_rloo_rows_and_refilled_rollout_stats():
    rows = rollout_rows(rollout(), normalize_std=False, drop_zero_variance=False, estimator="rloo")
    # G = 2: each completion against the other one: 1 - 0, 0 - 1; 0.5 - 0.5.
    assert [r.advantage for r in rows] == pytest.approx([1.0, -1.0, 0.0, 0.0])
    refilled = rollout()
    refilled.generated_rewards = [[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]]  # what was generated
    refilled.refill_rounds = 1
    stats = rollout_stats(refilled)
    assert stats["reward_mean"] == pytest.approx(2.0 / 6) and stats["zero_variance_fraction"] == pytest.approx(2 / 3)
    assert stats["refill_rounds"] == 1 and stats["groups"] == 2


def test_reference_logprobs_travel_with_the_rows():
    r = rollout()
    r.ref_logprobs = [[[-1.0, -2.0], [-3.0, -3.0, -3.0]], [[-4.0], [-5.0, -5.0]]]
    batch = build_batch(rollout_rows(r), seq_len=6, pad_id=PAD)
    assert batch["ref_logprobs"][0].tolist() == [0.0, 0.0, -1.0, -2.0, 0.0, 0.0]


def test_too_long_for_the_sequence_is_refused():
    rows = rollout_rows(rollout())
    with pytest.raises(ValueError, match="--training.seq_len 3"):
        build_batch(rows, seq_len=3, pad_id=PAD)


def test_rows_are_dealt_to_data_parallel_ranks_in_equal_microbatch_counts():
    rows = rollout_rows(rollout(), drop_zero_variance=False) + rollout_rows(rollout(), drop_zero_variance=False)[:1]
    assert len(rows) == 5
    rank0 = split_rows(rows, dp_rank=0, dp_world_size=2, microbatch_size=2)
    rank1 = split_rows(rows, dp_rank=1, dp_world_size=2, microbatch_size=2)
    assert [len(mb) for mb in rank0] == [2, 2] and [len(mb) for mb in rank1] == [2, 2]
    assert [r for mb in rank0 for r in mb] == rows[:4]
    assert rank1[0][0] is rows[4]
    fillers = [r for mb in rank1 for r in mb][1:]
    assert all(not r.train and not r.token_ids for r in fillers)
    batch = build_batch(rank1[1], seq_len=6, pad_id=PAD)
    assert batch["loss_mask"].sum() == 0 and (batch["labels"] == -100).all()


def test_a_rollout_whose_groups_were_all_dropped_has_no_rows():
    """Dynamic sampling can drop every group of a (share of a) rollout: nothing to train on,
    not a crash (it raised "rewards must be [prompts, group]")."""
    empty = Rollout(index=3, version=1, groups=[], rewards=[], generated_rewards=[[1.0, 1.0]])
    assert rollout_rows(empty) == []


def test_each_reward_term_and_the_lengths_have_their_stats():
    """reward_<label>_mean / _std over every generated completion (refills included, as
    reward_mean), by hand; response lengths' min and max."""
    scored = rollout()
    scored.reward_terms = [{"exact_match": [1.0, 0.0], "format": [1.0, 1.0]},
                           {"exact_match": [0.0, 0.0], "format": [1.0, 0.0]}]
    stats = rollout_stats(scored)
    assert stats["reward_exact_match_mean"] == pytest.approx(0.25)
    assert stats["reward_exact_match_std"] == pytest.approx(((0.75**2 + 3 * 0.25**2) / 4) ** 0.5)  # population
    assert stats["reward_format_mean"] == pytest.approx(0.75)
    assert (stats["response_length_min"], stats["response_length_max"]) == (1.0, 3.0)
    scored.generated_reward_terms = [*scored.reward_terms, {"exact_match": [1.0, 1.0], "format": [0.0, 0.0]}]
    assert rollout_stats(scored)["reward_exact_match_mean"] == pytest.approx(3 / 6)
    assert "reward_exact_match_mean" not in rollout_stats(rollout())  # no terms recorded: none logged


def with_reference(r: Rollout, shift: float) -> Rollout:
    """``r`` with reference log-probs ``shift`` below the generator's on every token (k1 KL
    ``shift`` per token)."""
    r.ref_logprobs = [[[lp - shift for lp in c.logprobs] for c in group] for group in r.groups]
    return r


def test_kl_in_reward_lowers_each_reward_by_its_summed_kl_by_hand():
    """k1 KL 0.25 per token, coefficient 0.4: completions of 2, 3 | 1, 2 tokens lose 0.2, 0.3 |
    0.1, 0.2 of their reward; the equal-reward group is still dropped (judged on rewards),
    and the kept group's centred rewards are (1 - 0.2) - (0 - 0.3) = 1.1 apart (dr_grpo: no std)."""
    rows = rollout_rows(with_reference(rollout(), 0.25), normalize_std=False, kl_in_reward_coef=0.4)
    assert [r.advantage for r in rows] == pytest.approx([0.55, -0.55])
    kept = rollout_rows(with_reference(rollout(), 0.25), normalize_std=False, kl_in_reward_coef=0.4,
                        drop_zero_variance=False)
    assert [r.advantage for r in kept][2:] == pytest.approx([0.05, -0.05])  # 0.5 - 0.1 vs 0.5 - 0.2


def test_adaptive_kl_coefficient_follows_the_measured_kl_by_hand():
    """The measured KL is each completion's per-token mean (k1 0.25 on every token here; k2
    0.5 x 0.25^2), averaged over the 4 completions; nothing before the reference is taken. The
    coefficient moves by the clipped relative error x completions / horizon: KL 0.25 against a
    target of 0.2 is 25% too high, clipped to 20%; against 0.24, 4.17%; against 1, -20%."""
    assert mean_token_kl(rollout(), "k1") == (0.0, 0)
    assert mean_token_kl(with_reference(rollout(), 0.25), "k1") == pytest.approx((0.25, 4))
    assert mean_token_kl(with_reference(rollout(), 0.25), "k2")[0] == pytest.approx(0.5 * 0.25**2)
    assert adapted_kl_coef(0.1, 0.25, target=0.2, horizon=100, completions=4) == pytest.approx(0.1 * (1 + 0.2 * 0.04))
    assert adapted_kl_coef(0.1, 0.25, target=0.24, horizon=100, completions=4) == pytest.approx(
        0.1 * (1 + (0.25 / 0.24 - 1) * 0.04))
    assert adapted_kl_coef(0.1, 0.25, target=1.0, horizon=100, completions=4) == pytest.approx(0.1 * (1 - 0.2 * 0.04))


def test_reinforce_pp_rows_carry_per_token_advantages_into_the_batch():
    """reinforce_plus_plus with KL in the reward (k1 0.25 x 0.4 = 0.1 per token) and no
    dropping: each token's return, whitened over the rollout's 8 tokens, is the batch's
    advantage at that token; the baseline variant gives one value per completion."""
    r = with_reference(rollout(), 0.25)
    rows = rollout_rows(r, estimator="reinforce_plus_plus", kl_in_reward_coef=0.4, drop_zero_variance=False)
    returns = [[0.8, 0.9], [-0.3, -0.2, -0.1], [0.4], [0.3, 0.4]]  # score at the end, -0.1 per token after
    flat = torch.tensor([v for c in returns for v in c], dtype=torch.float64)
    want = (flat - flat.mean()) / (flat.std(unbiased=False) + 1e-6)
    got = torch.tensor([v for row in rows for v in row.token_advantages], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [row.advantage for row in rows] == pytest.approx([float(want[0]), float(want[2]), float(want[5]),
                                                             float(want[6])], abs=1e-6)
    batch = build_batch(rows[:1], seq_len=6, pad_id=PAD)
    torch.testing.assert_close(batch["advantages"][0, 2:4], want[:2].float(), rtol=1e-5, atol=1e-6)
    baseline = rollout_rows(rollout(), estimator="reinforce_plus_plus_baseline", drop_zero_variance=False)
    centred = torch.tensor([0.5] * 2 + [-0.5] * 3 + [0.0] * 3, dtype=torch.float64)  # reward - group mean, per token
    values = (centred - centred.mean()) / (centred.std(unbiased=False) + 1e-6)
    assert [row.advantage for row in baseline] == pytest.approx([float(values[0]), float(values[2]), float(values[5]),
                                                                 float(values[6])], abs=1e-6)
    assert all(row.token_advantages is None for row in baseline)


def test_packed_rows_lay_each_completion_out_as_its_own_document_by_hand():
    """--rl.padding_free: 1 2 3 | 7 8 (4 positions) and 4 5 | 6 (2 positions) share a row of 8:
    each keeps its labels, log-probs and advantage, positions restart per completion, the
    padding is a document of its own. Best-fit decreasing of the 4, 5, 2 and 3-position
    completions fills a row with 5 + 3, a second with 4 + 2."""
    from titan.rl.rollouts import build_packed_batch, pack_rows, padding_fraction, padding_row

    rows = rollout_rows(rollout(), drop_zero_variance=False)  # positions: 4, 5, 2, 3
    batch = build_packed_batch([[rows[0], rows[2]]], seq_len=8, pad_id=PAD)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 4, 5, PAD, PAD]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, -100, 6, -100, -100]]
    assert batch["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, -1, -1]]
    torch.testing.assert_close(batch["old_logprobs"], torch.tensor([[0.0, 0.0, -0.1, -0.2, 0.0, -0.1, 0.0, 0.0]]))
    assert batch["advantages"][0].tolist() == pytest.approx([0, 0, rows[0].advantage, rows[0].advantage, 0,
                                                             rows[2].advantage, 0, 0], abs=1e-6)
    assert batch["sequence_lengths"].tolist() == [[0.0, 0.0, 2.0, 2.0, 0.0, 1.0, 0.0, 0.0]]
    # 6 of 8 positions belong to completions; a filler row's prompt (no label) fills none.
    filler = build_packed_batch([[padding_row([4, 5, 6])]], seq_len=8, pad_id=PAD)
    assert padding_fraction([batch]) == pytest.approx(0.25)
    assert padding_fraction([batch, filler]) == pytest.approx(1 - 6 / 16)
    packed = pack_rows(rows, seq_len=8)
    assert [[len(r.prompt_ids) + len(r.token_ids) - 1 for r in row] for row in packed] == [[5, 3], [4, 2]]
    with pytest.raises(ValueError, match="does not fit --training.seq_len 4"):
        pack_rows(rows, seq_len=4)
