"""A multi-turn trajectory: one packed sequence of sampled turns and environment tokens.

    prompt_ids       the first rendered prompt (the system and user messages, the tools, the first
                     assistant header)
    completion_ids   everything after it, in order: each sampled turn verbatim, then the ids the
                     renderer bridged in (the environment's messages and the next assistant header)
    sampled_mask     per completion id: True where the policy sampled it (trained on), False where
                     the environment added it (masked out of the loss)
    logprobs         per completion id: the behaviour log-prob of a sampled id, 0.0 for an added one
    token_versions   per completion id: the adapter version that sampled it; an added id carries the
                     version of the turn before it, so the staleness bound reads sampled ids only

A trajectory trains as one Sample whose `completion_mask` is sampled_mask: its sampled ids get the
loss, with their own log-probs and versions, turn after turn.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from archon.agents.renderer import Message
from archon.rollout.base import Sample


class StopReason(str, enum.Enum):
    """Why an episode ended."""

    DONE = "done"
    """The environment said so."""
    TURN_LIMIT = "turn_limit"
    """It reached the most assistant turns allowed."""
    TOKEN_BUDGET = "token_budget"
    """Its tokens reached the trajectory's budget, or a turn reached the per-turn limit unfinished."""
    TOOL_BUDGET = "tool_budget"
    """A turn asked for more tool calls than the episode had left."""
    PARSE_ERROR = "parse_error"
    """The model's turn had a malformed tool call."""
    TIMEOUT = "timeout"
    """The environment's reset or step took longer than allowed."""
    ENV_ERROR = "env_error"
    """The environment raised, or gave a reward that is not a finite number."""
    PROMPT_TOO_LONG = "prompt_too_long"
    """The environment's first messages do not fit the model's context."""


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    sampled_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    """The conversation as messages: the first ones, then each turn read back and each addition."""
    step_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    """The steps' rewards summed (or the group's reward, when the environment gives one)."""
    answer: str | None = None
    """The final answer the environment handed to the task's reward function, if any."""
    stop_reason: StopReason | None = None
    error: str | None = None
    """What went wrong, for the stop reasons that are failures."""
    num_turns: int = 0
    num_tool_calls: int = 0
    start_version: int = 0
    cut: bool = False
    """Its completion was cut to the run's or the model's limit after the episode (`cut_to`)."""

    def add_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"a sampled turn has {len(ids)} ids, {len(logprobs)} log-probs, {len(versions)} versions")
        self.completion_ids += ids
        self.sampled_mask += [True] * len(ids)
        self.logprobs += logprobs
        self.token_versions += versions

    def add_environment(self, ids: list[int]) -> None:
        version = self.token_versions[-1] if self.token_versions else self.start_version
        self.completion_ids += ids
        self.sampled_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [version] * len(ids)

    def cut_to(self, completion_tokens: int) -> bool:
        """Keep the first `completion_tokens` completion ids (and their masks, log-probs and
        versions); whether anything was cut (then `cut` is set)."""
        if len(self.completion_ids) <= completion_tokens:
            return False
        keep = max(completion_tokens, 0)
        self.completion_ids = self.completion_ids[:keep]
        self.sampled_mask = self.sampled_mask[:keep]
        self.logprobs = self.logprobs[:keep]
        self.token_versions = self.token_versions[:keep]
        self.cut = True
        return True

    @property
    def num_sampled(self) -> int:
        return sum(self.sampled_mask)

    @property
    def trajectory_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def to_sample(self, prompt_index: int) -> Sample:
        """The trajectory as one training Sample (completion_mask: the sampled ids)."""
        return Sample(
            prompt_index=prompt_index,
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            logprobs=list(self.logprobs),
            finish_reason="stop" if self.stop_reason == StopReason.DONE and not self.cut else "length",
            version=self.start_version,
            token_versions=list(self.token_versions),
            completion_mask=list(self.sampled_mask),
            extra={"trajectory": self},
        )
