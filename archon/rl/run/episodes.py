"""Multi-turn tasks in the RL loop: a task with an environment (archon.agents) makes its samples
by running episodes, and scores them by their environments' rewards plus its reward function on
their final answers.

A trajectory is one Sample: its prompt is the first rendered prompt, its completion every later
id, and `completion_mask` keeps the environment's ids out of the loss; each sampled id keeps its
own behaviour log-prob and adapter version, so importance weights and the staleness bound work
per token across turns.
"""

from __future__ import annotations

import logging

import torch

from archon.agents.agent_episodes import AgentEpisodes
from archon.agents.environment import StopReason
from archon.agents.trajectory import Trajectory
from archon.distributed import true_on_any_rank
from archon.rl.run.step_metrics import Scores
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.native import NativeRolloutEngine

logger = logging.getLogger(__name__)


def _any_rank(running: bool, group, device) -> bool:
    """Whether any rank of `group` still has episodes running (None: this process alone)."""
    return running if group is None else true_on_any_rank(running, device, group)


def episode_samples(task, examples, sampling: SamplingParams, engine, adapter: int | None) -> list[Sample]:
    """`task`'s trajectories of `examples` (sampling.n episodes each) as Samples. With the built-in
    engine every episode keeps its KV cache between turns, and every rank of the engine's sync group
    runs the same number of turns (a rank whose episodes are over generates nothing, in step).
    adapter: on a multi-task model, the task's adapter index."""
    rows = [example.row for example in examples]
    if isinstance(task.episodes, AgentEpisodes):
        trajectories = task.episodes.run(rows, sampling.n, sampling, engine)
    elif isinstance(engine, NativeRolloutEngine):

        def generate(prompts, turn_sampling, sessions):
            if adapter is None:
                return engine.generate(prompts, turn_sampling, sessions=sessions)
            return engine.generate(
                prompts,
                turn_sampling,
                adapters=[adapter] * len(prompts),
                adapter_seeds={adapter: turn_sampling.seed},
                sessions=sessions,
            )

        group, device = engine.sync_group, engine.device
        trajectories = task.episodes.run(
            rows,
            sampling.n,
            sampling,
            generate,
            keeps_sessions=True,
            end_sessions=engine.end_sessions,
            any_running=lambda running: _any_rank(running, group, device),
        )
    else:
        trajectories = task.episodes.run(
            rows,
            sampling.n,
            sampling,
            lambda prompts, turn_sampling, sessions: engine.generate(prompts, turn_sampling),
            keeps_sessions=False,
        )
    return [trajectory.to_sample(i // sampling.n) for i, trajectory in enumerate(trajectories)]


def score_episodes(task, examples, samples: list[Sample]) -> Scores:
    """Each trajectory's reward: its environment's, plus the task's reward function on its final
    answer where the environment handed one over; the step's episode counts."""
    trajectories: list[Trajectory] = [s.extra["trajectory"] for s in samples]
    errors = [t.error for t in trajectories if t.stop_reason == StopReason.ENV_ERROR]
    if errors:  # counted in stop_env_error; the why is only here
        first = next((error for error in errors if error), "no message")
        logger.warning(
            "task %r: %d of %d episodes ended env_error; the first: %s",
            task.name,
            len(errors),
            len(trajectories),
            first,
        )
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    answered = [i for i, t in enumerate(trajectories) if t.answer is not None]
    rows = [examples[samples[i].prompt_index] for i in answered]
    # scored even when empty: every rank reports the same per-term and per-source totals
    scored = task.scorer.score_batch(
        [row.prompt for row in rows],
        [trajectories[i].answer for i in answered],
        [row.reference for row in rows],
        [row.data_source for row in rows],
        [row.extra_info for row in rows],
        [samples[i].prompt_index for i in answered],
    )
    reward_metrics = scored.metrics
    if answered:
        rewards[answered] += scored.rewards
    sums = {
        "turns_mean": float(sum(t.num_turns for t in trajectories)),
        "tool_calls_mean": float(sum(t.num_tool_calls for t in trajectories)),
        "sampled_tokens_mean": float(sum(t.num_sampled for t in trajectories)),
        "environment_tokens_mean": float(sum(len(t.completion_ids) - t.num_sampled for t in trajectories)),
        "cut_trajectories": float(sum(t.cut for t in trajectories)),
    }
    for reason in StopReason:
        sums[f"stop_{reason.value}"] = float(sum(t.stop_reason == reason for t in trajectories))
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
    return Scores(
        rewards, (rewards >= 1.0).float(), lengths, reward_metrics, episode_sums=sums, reward_sums=scored.sums
    )
