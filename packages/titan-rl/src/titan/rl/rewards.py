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
  package.module:function`` or ``package.module.function``). A function written for TRL's
  ``GRPOTrainer`` (it takes ``completions``: lists in, a list of floats or None out) is
  called as TRL calls it, one completion at a time: ``prompts`` (the conversation when the
  prompt was one), ``completions`` (``[{"role": "assistant", "content": text}]`` then) and
  every other column of the prompt's row by name (``solution=[...]``); None scores 0;
- ``model``: a learned reward, a Hugging Face sequence-classification model's logit for the
  prompt followed by the completion (``--rl.reward_model``; ``titan.rl.reward_model``), scored
  a batch at a time.

Every call runs under a timeout (``--rl.reward_timeout_s``) that works in any thread (the
async schedule scores in a background thread, where signal-based timeouts such as
math-verify's cannot fire): the call runs in a daemon thread the caller waits on (a reward
model's batches run without one: a forward pass does not hang). A call
that times out scores 0 for that reward and is counted (``reward_timeouts`` in the metrics);
Python cannot stop a thread, so it keeps running in the background, and more than
:data:`MAX_HUNG_CALLS` such calls stop the run. A reward that raises stops the run with a
:class:`RewardError` naming the reward and the completion.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RewardFn = Callable[..., float]
REWARD_NAMES: tuple[str, ...] = ("exact_match", "char_match", "numeric", "format", "math_verify", "function", "model")

MAX_HUNG_CALLS = 8
"""Reward calls that may still be running after their timeout before the run is stopped."""

logger = logging.getLogger("titan")


class RewardError(RuntimeError):
    """A reward function raised, or too many reward calls hung."""


class RewardTimeout(Exception):
    """One reward call did not return within its timeout."""


def call_with_timeout(fn: Callable[..., float], kwargs: dict, timeout_s: float) -> float:
    """``fn(**kwargs)``, waiting at most ``timeout_s`` seconds (0: no limit) in whatever thread
    calls it; raises :class:`RewardTimeout` when it does not return in time (the call goes on
    in its daemon thread) and re-raises what ``fn`` raised."""
    if timeout_s <= 0:
        return fn(**kwargs)
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="titan-reward")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


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


@functools.cache
def _math_verify_no_signals() -> tuple[dict, dict]:
    """Keyword arguments that turn off math-verify's SIGALRM timeouts (which raise off the
    main thread) in the versions that have them; titan's own timeout covers the call."""
    from math_verify import parse, verify

    parse_kw = {"parsing_timeout": None} if "parsing_timeout" in inspect.signature(parse).parameters else {}
    verify_kw = {"timeout_seconds": None} if "timeout_seconds" in inspect.signature(verify).parameters else {}
    return parse_kw, verify_kw


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
    parse_kw, verify_kw = _math_verify_no_signals()
    return float(verify(parse(answer, **parse_kw), parse(completion, **parse_kw), **verify_kw))


def overlong_penalty(length: int, *, max_new_tokens: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens: 0 up to
    ``max_new_tokens - buffer_len``, then falling linearly to ``-factor`` at
    ``max_new_tokens`` (and ``-factor`` beyond); 0 when ``buffer_len`` is 0."""
    if buffer_len <= 0:
        return 0.0
    free = max_new_tokens - buffer_len
    if length <= free:
        return 0.0
    return -factor * min(1.0, (length - free) / buffer_len)


@dataclass(frozen=True)
class RewardContext:
    """What a TRL-style reward sees besides the completion: the prompt as the dataset gave it
    (``messages`` for a conversation, else None) and the row's other columns."""

    messages: list[dict] | None = None
    columns: dict[str, Any] = field(default_factory=dict)


class TRLStyleReward:
    """A reward function written for TRL's ``GRPOTrainer`` (``fn(prompts, completions, **columns)
    -> list[float | None]``), called with one completion at a time."""

    wants_context = True

    def __init__(self, fn: Callable[..., Sequence[float | None]]) -> None:
        self.fn = fn

    def __call__(self, *, prompt: str, completion: str, answer: str | None,
                 context: RewardContext | None = None) -> float:
        context = context or RewardContext()
        conversational = context.messages is not None
        prompts = [context.messages if conversational else prompt]
        completions = [[{"role": "assistant", "content": completion}] if conversational else completion]
        columns = {name: [value] for name, value in context.columns.items()}
        values = self.fn(prompts=prompts, completions=completions, **columns)
        value = list(values)[0]
        return 0.0 if value is None else float(value)


def is_trl_style(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is written for TRL: it takes the batch's ``completions``."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


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
    return TRLStyleReward(fn) if is_trl_style(fn) else fn


@dataclass
class CombinedReward:
    """A weighted sum of reward functions, each called with keyword arguments under
    ``timeout_s`` (module docstring)."""

    terms: list[tuple[str, RewardFn, float]]
    """(name, function, weight) per term."""
    timeout_s: float = 0.0
    """Seconds one reward call may take (0: no limit)."""
    timeouts: int = field(default=0, init=False)
    """Calls that timed out so far (each scored 0)."""

    def __call__(self, *, prompt: str, completion: str, answer: str | None,
                 context: RewardContext | None = None) -> float:
        """The weighted sum of every term's reward (``context`` reaches TRL-style ones)."""
        return self.score([prompt], [completion], [answer], [context])[0]

    def _one(self, name: str, fn: RewardFn, prompt: str, completion: str, answer: str | None,
             context: RewardContext | None) -> float | None:
        """One term's reward of one completion under the timeout (None when it timed out)."""
        call = {"prompt": prompt, "completion": completion, "answer": answer}
        if getattr(fn, "wants_context", False):
            call["context"] = context
        try:
            return float(call_with_timeout(fn, call, self.timeout_s))
        except RewardTimeout:
            self._timed_out(name, completion)
            return None
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(
                f"reward {name!r} raised {type(err).__name__}: {err} (on the completion {completion[:80]!r})"
            ) from err

    @staticmethod
    def _batch(name: str, fn: Any, prompts: Sequence[str], completions: Sequence[str],
               contexts: Sequence[RewardContext | None]) -> list[float]:
        """One batched term's rewards (a reward model): all completions in one call."""
        try:
            return [float(v) for v in fn.score_batch(prompts, completions, contexts)]
        except Exception as err:
            raise RewardError(f"reward {name!r} raised {type(err).__name__}: {err}") from err

    def _timed_out(self, name: str, completion: str) -> None:
        self.timeouts += 1
        logger.warning("reward %r took longer than --rl.reward_timeout_s %g on %r: scored 0",
                       name, self.timeout_s, completion[:80])
        hung = sum(t.name == "titan-reward" for t in threading.enumerate())
        if hung > MAX_HUNG_CALLS:
            raise RewardError(
                f"{hung} reward calls are still running after --rl.reward_timeout_s {self.timeout_s:g}: reward "
                f"{name!r} hangs; fix it or raise the timeout"
            )

    @property
    def labels(self) -> list[str]:
        """One metric label per term (:func:`reward_labels`)."""
        return reward_labels([name for name, _, _ in self.terms])

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None],
              contexts: Sequence[RewardContext | None] | None = None) -> list[float]:
        """Rewards of aligned prompts, completions and answers (and the prompts' contexts,
        for TRL-style rewards)."""
        return self.score_terms(prompts, completions, answers, contexts)[0]

    def score_terms(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None],
                    contexts: Sequence[RewardContext | None] | None = None
                    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sums (as :meth:`score`) and each term's own unweighted values by
        :attr:`labels` (a timed-out call counts 0), for per-reward metrics as TRL logs them."""
        contexts = contexts if contexts is not None else [None] * len(prompts)
        totals = [0.0] * len(prompts)
        terms: dict[str, list[float]] = {}
        for label, (name, fn, weight) in zip(self.labels, self.terms, strict=True):
            if getattr(fn, "batched", False):
                values: list[float | None] = list(self._batch(name, fn, prompts, completions, contexts))
            else:
                values = [self._one(name, fn, p, c, a, x)
                          for p, c, a, x in zip(prompts, completions, answers, contexts, strict=True)]
            for i, value in enumerate(values):
                if value is not None:  # a timed-out call scores 0 for this term
                    totals[i] += weight * value
            terms[label] = [0.0 if value is None else value for value in values]
        return totals, terms


def reward_labels(names: Sequence[str]) -> list[str]:
    """One label per reward name (metrics, completions.jsonl, GDPO's weights): the name,
    numbered when a name repeats."""
    return [name if names.count(name) == 1 else f"{name}{names[:i].count(name) + 1}" for i, name in enumerate(names)]


def build_reward(
    names: Sequence[str],
    *,
    weights: Sequence[float] | None = None,
    format_regex: str | None = None,
    function: str | None = None,
    numeric_tolerance: float = 1e-6,
    timeout_s: float = 0.0,
    reward_model: str | None = None,
    reward_model_batch_size: int = 32,
    device: Any = "cpu",
    model_spec: Any | None = None,
) -> CombinedReward:
    """A :class:`CombinedReward` from reward names (module docstring) and their weights
    (default 1 each); ``reward_model`` (a folder) is loaded on ``device`` for ``model``, on
    titan's code when it is of ``model_spec``'s family (the policy's)."""
    if not names:
        raise ValueError("--rl.rewards is empty; name at least one reward, e.g. exact_match")
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(
            f"--rl.reward_weights has {len(weights)} values for {len(names)} rewards; give one per reward"
        )
    if reward_model and "model" not in names:
        raise ValueError(f"--rl.reward_model {reward_model} is read by --rl.rewards model, which this run does not "
                         "name: add it (with a --rl.reward_weights entry if weighted) or drop the flag")
    terms = []
    for name, weight in zip(names, weights, strict=True):
        if name == "model":
            if not reward_model:
                raise ValueError("--rl.rewards model needs --rl.reward_model (a sequence-classification model folder "
                                 "or Hub id)")
            from titan.rl.reward_model import RewardModel

            fn: RewardFn = RewardModel(reward_model, device=device, batch_size=reward_model_batch_size,
                                       model_spec=model_spec)
        else:
            fn = _one_reward(name, format_regex, function, numeric_tolerance)
        terms.append((name, fn, float(weight)))
    return CombinedReward(terms, timeout_s=timeout_s)


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
        if importlib.util.find_spec("math_verify") is None:  # found, not imported: that waits for a call
            raise ValueError(
                "--rl.rewards math_verify needs the math-verify package; install it (pip install "
                "math-verify) or choose another reward"
            )
        return math_verify_match
    if name == "function":
        if not function:
            raise ValueError("--rl.rewards function needs --rl.reward_function package.module:function")
        return load_function(function)
    raise ValueError(f"--rl.rewards {name!r} is not a reward; choose from {', '.join(REWARD_NAMES)}")
