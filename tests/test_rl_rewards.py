import textwrap

import pytest
import torch

from archon.rl.reward_fns import (
    exact_match_reward,
    math_verify_reward,
    resolve_reward_function,
)
from archon.rl.rewards import RewardConfig, RewardScorer

# One user reward function whose behaviour is chosen by the completion, so a single worker serves
# every case: "raise", "hang" (a pure-Python infinite loop), "exit" (the process dies), "none".
USER_REWARDS = textwrap.dedent(
    """
    import os

    def reward(prompt, completion, reference):
        if completion == "raise":
            raise RuntimeError("broken reward")
        if completion == "hang":
            while True:
                pass
        if completion == "hang-catching":
            while True:
                try:
                    pass
                except Exception:
                    pass
        if completion == "exit":
            os._exit(3)
        if completion == "none":
            return None
        if completion == "nan":
            return float("nan")
        if completion == "inf":
            return float("-inf")
        if completion == "huge":
            return 1e39  # finite in Python, beyond float32
        print("reward functions may print")
        return float(completion == reference)
    """
)


@pytest.fixture(scope="module")
def user_module(importable_module):
    return importable_module("my_rewards", USER_REWARDS) + ":reward"


def test_math_verify_reward_positive_and_negative():
    assert math_verify_reward("", "The answer is 42.", "42") == 1.0
    assert math_verify_reward("", "so the result is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_verify_reward("", "-7", -7) == 1.0
    assert math_verify_reward("", "The answer is 43.", "42") == 0.0
    assert math_verify_reward("", "no number here", "42") == 0.0


def test_exact_match_reward():
    assert exact_match_reward("", " 46\n", "46") == 1.0
    assert exact_match_reward("", "46.", "46") == 0.0
    assert exact_match_reward("", "126", 126) == 1.0


def test_bad_spec_fails_when_the_scorer_is_built(user_module):
    with pytest.raises(ValueError, match="module:function"):
        resolve_reward_function("no_colon_here")
    with pytest.raises(ValueError, match="has no attribute"):
        RewardScorer(RewardConfig(function="my_rewards:missing", num_workers=0))
    with pytest.raises(RuntimeError, match="could not be loaded"):
        RewardScorer(RewardConfig(function="not_a_module_anywhere:fn", num_workers=1))


def test_math_rewards_in_a_worker_process():
    with RewardScorer(RewardConfig(function="math", timeout_s=20.0)) as scorer:
        rewards, metrics = scorer.score(["q"] * 3, ["The answer is 42", "41", "\\boxed{3/4}"], ["42", "42", "0.75"])
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [1.0, 0.0, 1.0]
    assert metrics["reward_mean"] == pytest.approx(2 / 3)
    assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0


def test_worker_failures_are_counted_and_never_stop_scoring(user_module):
    config = RewardConfig(function=user_module, timeout_s=1.0, num_workers=1)
    with RewardScorer(config) as scorer:
        completions = ["7", "raise", "hang", "8", "exit", "none", "7"]
        rewards, metrics = scorer.score(["p"] * 7, completions, ["7"] * 7)
        assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert metrics["reward_errors"] == 3  # raise, exit, none
        assert metrics["reward_timeouts"] == 1
        # the hung and the dead worker were replaced: the next batch is scored normally
        rewards, metrics = scorer.score(["p", "p"], ["1", "2"], ["1", "1"])
        assert rewards.tolist() == [1.0, 0.0]
        assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0
        assert scorer.totals == {"samples": 9, "errors": 3, "timeouts": 1}


def test_several_workers_score_in_order(user_module):
    with RewardScorer(RewardConfig(function=user_module, timeout_s=5.0, num_workers=2)) as scorer:
        completions = [str(i % 3) for i in range(12)]
        rewards, _ = scorer.score(["p"] * 12, completions, ["1"] * 12)
    assert rewards.tolist() == [float(i % 3 == 1) for i in range(12)]


def test_in_process_timer_stops_a_python_hang(user_module):
    with RewardScorer(RewardConfig(function=user_module, timeout_s=0.3, num_workers=0)) as scorer:
        rewards, metrics = scorer.score(["p"] * 5, ["raise", "hang", "hang-catching", "x", "none"], ["x"] * 5)
    assert rewards.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert metrics["reward_timeouts"] == 2
    assert metrics["reward_errors"] == 2


def test_mismatched_lengths_are_an_error():
    scorer = RewardScorer(RewardConfig(function="exact", num_workers=0))
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        scorer.score(["a", "b"], ["a"], ["a", "b"])
    rewards, _ = scorer.score(["a"], ["a"], None)
    assert rewards.tolist() == [0.0]  # "a" != str(None)


@pytest.mark.parametrize("num_workers", [0, 1], ids=["in-process", "worker"])
def test_non_finite_rewards_are_errors_and_the_first_traceback_is_kept(user_module, num_workers):
    with RewardScorer(RewardConfig(function=user_module, timeout_s=5.0, num_workers=num_workers)) as scorer:
        completions = ["7", "nan", "huge", "inf", "raise", "7"]
        rewards, metrics = scorer.score(["p"] * 6, completions, ["7"] * 6)
        assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert metrics["reward_errors"] == 4 and metrics["reward_mean"] == pytest.approx(2 / 6)
        # the traceback of the first exception (the NaN check in call_reward), with its frames
        assert scorer.last_traceback.startswith("Traceback (most recent call last)")
        assert "call_reward" in scorer.last_traceback and "ValueError: reward function returned nan" in (
            scorer.last_traceback
        )
        scorer.score(["p"], ["raise"], ["7"])
        assert "my_rewards.py" in scorer.last_traceback and "RuntimeError: broken reward" in scorer.last_traceback
        scorer.score(["p"], ["7"], ["7"])
        assert scorer.last_traceback is None
