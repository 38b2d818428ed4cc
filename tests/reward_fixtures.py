"""Reward functions for the recipe tests (given as "reward_fixtures:NAME")."""


def digits_or_raise(prompt: str, completion: str, reference) -> float:
    """The fraction of the completion that is digits (a graded signal even for an untrained model);
    raises on prompts that start with 1, so failures get counted."""
    if prompt.startswith("1"):
        raise RuntimeError("reward function failure on purpose")
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def always_raise(prompt: str, completion: str, reference) -> float:
    """Fails on every sample, so a run must stop with this traceback."""
    raise ZeroDivisionError("reward function that always fails")
