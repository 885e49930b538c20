"""Verifiable rewards, composable by weighted sum.

A reward function is ``fn(*, prompt: str, completion: str, answer: str | None) -> float``:
``completion`` is the decoded generated text (without the stop token), ``answer`` the
reference from the prompt dataset. Built-in ones (``--rl.rewards``):

- ``exact_match``: 1 when the completion equals the answer (surrounding whitespace ignored);
- ``char_match``: the fraction of the answer's positions the completion gets right, divided
  by the longer length (partial credit, so a small model's rewards vary within a group);
- ``numeric``: 1 when the last number in the completion equals the answer's number
  (``--rl.numeric_tolerance``);
- ``format``: 1 when the completion matches ``--rl.format_regex`` (``re.fullmatch``, DOTALL);
- ``math_verify``: the ``math-verify`` package's equivalence check (installed separately,
  imported only when used);
- ``function``: a user function given by dotted path (``--rl.reward_function
  package.module:function`` or ``package.module.function``).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RewardFn = Callable[..., float]
REWARD_NAMES: tuple[str, ...] = ("exact_match", "char_match", "numeric", "format", "math_verify", "function")

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def exact_match(*, prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when the completion is the answer, whitespace at both ends ignored."""
    return float(answer is not None and completion.strip() == answer.strip())


def char_match(*, prompt: str, completion: str, answer: str | None) -> float:
    """Positions where completion and answer agree, over the longer of the two lengths."""
    if answer is None:
        return 0.0
    got, want = completion.strip(), answer.strip()
    longest = max(len(got), len(want))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(got, want, strict=False)) / longest


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas in thousands ignored), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    try:
        return float(found[-1])
    except ValueError:
        return None


def numeric_match(*, prompt: str, completion: str, answer: str | None, tolerance: float = 1e-6) -> float:
    """1.0 when the last number of the completion equals the answer's last number."""
    if answer is None:
        return 0.0
    got, want = last_number(completion), last_number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance))


def format_match(pattern: str) -> RewardFn:
    """A reward of 1.0 when the whole completion matches the regex ``pattern``."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(*, prompt: str, completion: str, answer: str | None) -> float:
        return float(compiled.fullmatch(completion) is not None)

    return reward


def math_verify_match(*, prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when ``math-verify`` finds the completion's answer equivalent to the reference."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ValueError(
            "--rl.rewards math_verify needs the math-verify package; install it (pip install "
            "math-verify) or choose another reward"
        ) from None
    if answer is None:
        return 0.0
    return float(verify(parse(answer), parse(completion)))


def load_function(path: str) -> RewardFn:
    """The callable at ``package.module:function`` (or ``package.module.function``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"--rl.reward_function {path!r} is not a dotted path; write package.module:function"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--rl.reward_function {path!r} cannot be imported ({err}); check the path") from None
    if not callable(fn):
        raise ValueError(f"--rl.reward_function {path!r} is not callable")
    return fn


@dataclass
class CombinedReward:
    """A weighted sum of reward functions, each called with keyword arguments."""

    terms: list[tuple[str, RewardFn, float]]
    """(name, function, weight) per term."""

    def __call__(self, *, prompt: str, completion: str, answer: str | None) -> float:
        """The weighted sum of every term's reward."""
        return sum(
            weight * float(fn(prompt=prompt, completion=completion, answer=answer))
            for _, fn, weight in self.terms
        )

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None]) -> list[float]:
        """Rewards of aligned prompts, completions and answers."""
        return [self(prompt=p, completion=c, answer=a) for p, c, a in zip(prompts, completions, answers, strict=True)]


def build_reward(
    names: Sequence[str],
    *,
    weights: Sequence[float] | None = None,
    format_regex: str | None = None,
    function: str | None = None,
    numeric_tolerance: float = 1e-6,
) -> CombinedReward:
    """A :class:`CombinedReward` from reward names (module docstring) and their weights
    (default 1 each)."""
    if not names:
        raise ValueError("--rl.rewards is empty; name at least one reward, e.g. exact_match")
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(
            f"--rl.reward_weights has {len(weights)} values for {len(names)} rewards; give one per reward"
        )
    terms = []
    for name, weight in zip(names, weights, strict=True):
        terms.append((name, _one_reward(name, format_regex, function, numeric_tolerance), float(weight)))
    return CombinedReward(terms)


def _one_reward(name: str, format_regex: str | None, function: str | None, tolerance: float) -> RewardFn:
    """The function behind one reward name."""
    if name == "exact_match":
        return exact_match
    if name == "char_match":
        return char_match
    if name == "numeric":
        return lambda **kw: numeric_match(**kw, tolerance=tolerance)
    if name == "format":
        if not format_regex:
            raise ValueError("--rl.rewards format needs --rl.format_regex (a regular expression)")
        try:
            return format_match(format_regex)
        except re.error as err:
            raise ValueError(f"--rl.format_regex {format_regex!r} is not a valid regex: {err}") from None
    if name == "math_verify":
        return math_verify_match
    if name == "function":
        if not function:
            raise ValueError("--rl.rewards function needs --rl.reward_function package.module:function")
        return load_function(function)
    raise ValueError(f"--rl.rewards {name!r} is not a reward; choose from {', '.join(REWARD_NAMES)}")
