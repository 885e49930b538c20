"""The built-in rewards, a user function by dotted path, and weighted composition, by hand."""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest
from titan.rl.rewards import (
    MAX_HUNG_CALLS,
    CombinedReward,
    RewardError,
    build_reward,
    char_match,
    exact_match,
    format_match,
    last_number,
    numeric_match,
    overlong_penalty,
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


def test_a_reward_written_for_trl_is_called_as_trl_calls_it(tmp_path, monkeypatch):
    """A `GRPOTrainer` reward (`completions` in, a list out) gets, per completion, the prompt
    as the dataset gave it (the conversation), the completion as an assistant message, and
    the row's other columns by name; None scores 0. titan-style functions are unchanged."""
    from titan.rl.rewards import RewardContext

    (tmp_path / "trl_rewards.py").write_text(
        "calls = []\n"
        "def accuracy(prompts, completions, solution, **kwargs):\n"
        "    calls.append((prompts, completions, solution, kwargs))\n"
        "    return [None if s is None else float(s in c[0]['content'] if isinstance(c, list) else s in c)\n"
        "            for c, s in zip(completions, solution)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward(["function"], function="trl_rewards:accuracy")
    messages = [{"role": "user", "content": "2+2?"}]
    chat = RewardContext(messages=messages, columns={"solution": "4", "level": 3})
    assert reward.score(["rendered"] * 2, ["It is 4.", "It is 5."], ["4", "4"], [chat, chat]) == [1.0, 0.0]
    import trl_rewards

    prompts, completions, solution, extra = trl_rewards.calls[0]
    assert prompts == [messages] and completions == [[{"role": "assistant", "content": "It is 4."}]]
    assert solution == ["4"] and extra == {"level": [3]}
    text = RewardContext(columns={"solution": "4"})  # a text prompt: strings, as TRL passes them
    assert reward.score(["2+2?"], ["4"], ["4"], [text]) == [1.0]
    assert trl_rewards.calls[-1][:2] == (["2+2?"], ["4"])
    assert reward.score(["p"], ["x"], [None], [RewardContext(columns={"solution": None})]) == [0.0]  # None: 0
    sys.modules.pop("trl_rewards", None)


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
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ValueError, match="pip install math-verify"):  # at the start of the run
            build_reward(["math_verify"])
    else:
        build_reward(["math_verify"])
        assert "math_verify" not in sys.modules  # building does not import it


def test_a_hung_reward_times_out_in_a_background_thread():
    """The async schedule scores off the main thread, where signal-based timeouts cannot
    fire: the timeout still holds there, the call scores 0 and is counted."""
    release = threading.Event()

    def hangs(*, prompt, completion, answer):
        if completion == "hang":
            release.wait()
        return 1.0

    # 2 s: far more than a call that returns at once needs on a loaded machine.
    reward = CombinedReward([("hangs", hangs, 1.0)], timeout_s=2.0)
    result: list[list[float]] = []
    scorer = threading.Thread(target=lambda: result.append(reward.score(["p", "p"], ["hang", "ok"], ["a", "a"])))
    scorer.start()
    scorer.join(timeout=60)  # a guard against a hang, not a time budget
    release.set()
    assert result == [[0.0, 1.0]] and reward.timeouts == 1


def test_a_reward_that_raises_names_itself_and_the_completion():
    def broken(*, prompt, completion, answer):
        raise KeyError("field")

    reward = CombinedReward([("mine", broken, 1.0)], timeout_s=60.0)  # raises at once
    with pytest.raises(RewardError, match=r"reward 'mine' raised KeyError: 'field' \(on the completion 'x'\)"):
        reward(prompt="p", completion="x", answer="a")


def test_too_many_hung_calls_stop_the_run():
    release = threading.Event()

    def hangs(*, prompt, completion, answer):
        release.wait()
        return 0.0

    reward = CombinedReward([("hangs", hangs, 1.0)], timeout_s=0.01)
    try:
        with pytest.raises(RewardError, match="still running"):
            for _ in range(MAX_HUNG_CALLS + 1):
                reward(prompt="p", completion="c", answer="a")
    finally:
        release.set()


def test_soft_overlong_penalty_by_hand():
    # Budget 20 tokens, buffer 5: free up to 15, then -1/5 per token, -factor at 20.
    kw = {"max_new_tokens": 20, "buffer_len": 5}
    assert [overlong_penalty(n, **kw) for n in (10, 15, 16, 18, 20)] == pytest.approx([0, 0, -0.2, -0.6, -1.0])
    assert overlong_penalty(18, **kw, factor=0.5) == pytest.approx(-0.3)
    assert overlong_penalty(20, max_new_tokens=20, buffer_len=0) == 0.0


def test_each_terms_unweighted_values_come_with_the_weighted_sum():
    """score_terms: the weighted sums as score gives them, and each term's own values by
    label (a repeated name numbered), for per-reward metrics."""
    reward = build_reward(["exact_match", "char_match"], weights=[1.0, 2.0])
    totals, terms = reward.score_terms(["p", "p"], ["ab", "ax"], ["ab", "ab"])
    assert terms == {"exact_match": [1.0, 0.0], "char_match": [1.0, 0.5]}
    assert totals == [3.0, 1.0] == reward.score(["p", "p"], ["ab", "ax"], ["ab", "ab"])
    twice = build_reward(["format", "format"], format_regex="a.*")
    assert twice.labels == ["format1", "format2"]
