"""The completion log (`--rl.log_completions`, `--rl.num_completions_to_print`): one record per
completion with the advantage computed by hand, what trained and what did not, the log line."""

from __future__ import annotations

import json

import pytest
from titan.rl.completion_log import append_completions, completion_records, format_completion
from titan.rl.config import RLSection
from titan.rl.generate.base import Completion
from titan.rl.rollouts import Rollout


def _completion(tokens: int, finish: str = "stop") -> Completion:
    return Completion(prompt_ids=[1, 2], token_ids=list(range(tokens)), logprobs=[0.0] * tokens, finish_reason=finish)


ROLLOUT = Rollout(
    index=3, version=5,
    groups=[[_completion(2), _completion(4, "length")], [_completion(1), _completion(1)]],
    rewards=[[1.0, 0.0], [1.0, 1.0]], texts=[["4", "44"], ["7", "7"]],
    prompts=["2+2=", "3+4="], answers=["4", None],
)


def test_records_hold_each_completion_with_its_hand_computed_advantage(tmp_path):
    """Group 0 (rewards 1, 0: mean 0.5, population std 0.5) gives advantages +-1 (to the
    1e-6 the std is padded by); group 1 has no variance, so it does not train when such
    groups are dropped; a truncated completion does not train under --rl.mask_truncated."""
    records = completion_records(ROLLOUT, step=12, rl=RLSection(mask_truncated=True))
    assert [(r["group"], r["completion"], r["reward"], r["trained"], r["tokens"], r["finish_reason"]) for r in records] == [
        (0, "4", 1.0, True, 2, "stop"), (0, "44", 0.0, False, 4, "length"),
        (1, "7", 1.0, False, 1, "stop"), (1, "7", 1.0, False, 1, "stop")]
    assert [r["advantage"] for r in records] == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0])
    assert {(r["step"], r["rollout"], r["policy_version"]) for r in records} == {(12, 3, 5)}
    assert [(r["prompt"], r["answer"]) for r in records] == [("2+2=", "4")] * 2 + [("3+4=", None)] * 2
    kept = completion_records(ROLLOUT, step=12, rl=RLSection(drop_zero_variance=False))
    assert [r["trained"] for r in kept] == [True] * 4

    append_completions(str(tmp_path / "run"), records)
    append_completions(str(tmp_path / "run"), records[:1])
    lines = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [*records, records[0]]

    line = format_completion(records[1])
    assert line == "  group 0 reward 0.000 advantage -1.000 4 tokens (not trained): '2+2=' -> '44' (answer '4')"
    long = format_completion({**records[2], "completion": "x" * 1000})
    assert "'" + "x" * 400 + "...'" in long and "answer" not in long


def test_a_rollout_without_groups_has_no_records():
    assert completion_records(Rollout(index=0, version=0, groups=[], rewards=[]), step=1, rl=RLSection()) == []


def test_the_print_count_is_checked():
    with pytest.raises(ValueError, match="--rl.num_completions_to_print must be >= 0"):
        RLSection(num_completions_to_print=-1)
