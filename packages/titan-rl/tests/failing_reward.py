"""A reward function that raises, for the test that a failing reward stops every rank."""

import os


def raises(*, prompt: str, completion: str, answer: str | None) -> float:
    """Always raises: a grader with a bug."""
    raise ValueError("the grader is broken")


def raises_on_rank_1(*, prompt: str, completion: str, answer: str | None) -> float:
    """Raises on the launch's rank 1 only (a grader whose bug one rank's share hits); 0 elsewhere."""
    if os.environ.get("RANK") == "1":
        raise ValueError("the grader is broken")
    return 0.0
