"""A reward function that raises, for the test that a failing reward stops every rank."""


def raises(*, prompt: str, completion: str, answer: str | None) -> float:
    """Always raises: a grader with a bug."""
    raise ValueError("the grader is broken")
