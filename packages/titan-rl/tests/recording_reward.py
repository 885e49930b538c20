"""A reward function that records what it is called with, for the tests of what the rewards
see (one JSON line per call in the file named by ``$TITAN_TEST_REWARD_LOG``)."""

import json
import os


def records(*, prompt: str, completion: str, answer: str | None) -> float:
    """Append the call's arguments to the log; reward 1 when the completion holds the answer."""
    with open(os.environ["TITAN_TEST_REWARD_LOG"], "a") as log:
        log.write(json.dumps({"prompt": prompt, "completion": completion, "answer": answer}) + "\n")
    return float(answer is not None and answer in completion)


def trl_records(prompts, completions, answer, **kwargs):
    """A TRL-style reward (lists in, a list out) that records what it is called with."""
    with open(os.environ["TITAN_TEST_REWARD_LOG"], "a") as log:
        for prompt, completion, expected in zip(prompts, completions, answer, strict=True):
            log.write(json.dumps({"prompt": prompt, "completion": completion, "answer": expected,
                                  "other": sorted(kwargs)}) + "\n")
    return [float(expected in completion[0]["content"]) for completion, expected in zip(completions, answer, strict=True)]
