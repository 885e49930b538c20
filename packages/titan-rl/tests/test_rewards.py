"""The built-in rewards, a user function by dotted path, and weighted composition, by hand."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from titan.rl.rewards import (
    build_reward,
    char_match,
    exact_match,
    format_match,
    last_number,
    numeric_match,
)


def call(fn, completion, answer="abc"):
    return fn(prompt="p", completion=completion, answer=answer)


def test_exact_match():
    assert call(exact_match, " abc\n") == 1.0
    assert call(exact_match, "abd") == 0.0
    assert call(exact_match, "abc", answer=None) == 0.0


def test_char_match_gives_partial_credit_over_the_longer_length():
    assert call(char_match, "abc") == 1.0
    assert call(char_match, "abd") == pytest.approx(2 / 3)
    assert call(char_match, "ab") == pytest.approx(2 / 3)
    assert call(char_match, "abcabc") == pytest.approx(3 / 6)
    assert call(char_match, "") == 0.0


def test_numeric_match_reads_the_last_number():
    assert last_number("2 + 3 = 5.") == 5.0
    assert last_number("total: 1,234") == 1234.0
    assert last_number("none") is None
    assert call(numeric_match, "so the answer is 42.", answer="42") == 1.0
    assert call(numeric_match, "41", answer="42") == 0.0
    assert call(numeric_match, "0.5", answer="1/2 = 0.50") == 1.0


def test_format_reward_is_a_full_match():
    fn = format_match(r"<answer>\w+</answer>")
    assert call(fn, "<answer>abc</answer>") == 1.0
    assert call(fn, "x <answer>abc</answer>") == 0.0


def test_user_function_by_dotted_path_and_weighted_sum(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(*, prompt, completion, answer):\n    return len(completion) / 10\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward(["exact_match", "function"], weights=[2.0, 0.5], function="my_rewards:length_bonus")
    assert reward(prompt="p", completion="abc", answer="abc") == pytest.approx(2.0 + 0.5 * 0.3)
    dotted = build_reward(["function"], function="my_rewards.length_bonus")
    assert dotted.score(["p", "p"], ["ab", "abcd"], [None, None]) == pytest.approx([0.2, 0.4])
    sys.modules.pop("my_rewards", None)


def test_bad_reward_configs_name_the_flag():
    with pytest.raises(ValueError, match="--rl.rewards 'bleu'"):
        build_reward(["bleu"])
    with pytest.raises(ValueError, match="--rl.format_regex"):
        build_reward(["format"])
    with pytest.raises(ValueError, match="--rl.format_regex"):
        build_reward(["format"], format_regex="(")
    with pytest.raises(ValueError, match="--rl.reward_weights"):
        build_reward(["exact_match"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="--rl.reward_function"):
        build_reward(["function"], function="no_such_module_xyz:fn")


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is not None, reason="math-verify is installed")
def test_math_verify_is_optional_and_imported_only_when_used():
    reward = build_reward(["math_verify"])  # building does not import it
    with pytest.raises(ValueError, match="math-verify"):
        reward(prompt="p", completion="1/2", answer="0.5")
