"""The reward section of the config (`reward`, and each task's `tasks[i].reward`): a reward function
or weighted terms, routed by the rows' data_source."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Sequence

from archon.rl.rewards.http import JudgeConfig, RewardServerConfig

TERM_NAME = re.compile(r"[A-Za-z0-9_.-]+")

RewardTermKind = Literal["function", "group", "server", "judge"]


@dataclass
class RewardTermConfig:
    """One term of a reward: its values times `weight` are added to the sample's reward."""

    name: str = ""
    """The term's name in the metrics (reward/<name>_mean) and in `sources`: letters, digits, _ . -"""
    kind: RewardTermKind = "function"
    """function: `function` per sample; group: `function` on all the completions of a prompt at
    once, returning one value each; server: a reward server (`server`); judge: an LLM judge (`judge`)."""
    function: str = ""
    """For function and group terms: math, exact or package.module:function (see docs/rewards.md for
    the signatures, verl's included)."""
    weight: float = 1.0
    """The term's weight in the sum."""
    server: RewardServerConfig = field(default_factory=RewardServerConfig)
    """For server terms."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """For judge terms."""


@dataclass
class RewardConfig:
    """How completions are scored."""

    function: str = "math"
    """math (math-verify against the reference), exact (exact match), or package.module:function
    taking (prompt, completion, reference) and returning a float. Used when `terms` is empty."""
    timeout_s: float = 10.0
    """Per-sample time limit; a sample over it gets reward 0 and counts as a timeout."""
    num_workers: int = 1
    """Worker processes that run the reward function. 0 runs it in this process under a SIGALRM
    timer: main thread only, and a hang inside C code is not interrupted."""
    max_failed_steps: int = 3
    """Stop the run, showing the reward function's traceback, when it fails (raises or times out)
    on every sample of this many steps in a row."""
    terms: tuple[RewardTermConfig, ...] = ()
    """Several reward terms, each weighted; the reward is their weighted sum. Empty: `function` alone."""
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Which terms score each data_source (the rows' `data_source` field), by term name. Empty:
    every term scores every sample."""
    default_terms: tuple[str, ...] | None = None
    """With `sources`: the terms of a data_source not listed there. None: such a source is an error."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"RewardConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"RewardConfig.num_workers must be >= 0, got {self.num_workers}")
        if self.max_failed_steps < 1:
            raise ValueError(f"RewardConfig.max_failed_steps must be >= 1, got {self.max_failed_steps}")

    def term_configs(self) -> tuple[RewardTermConfig, ...]:
        """The terms; without `terms`, the one term `function` (named after it)."""
        if self.terms:
            return self.terms
        return (RewardTermConfig(name=self.function.rpartition(":")[2] or "reward", function=self.function),)

    def describe(self) -> str:
        """ "the reward function 'math'" or "the reward terms 'a', 'b'", for messages."""
        if not self.terms:
            return f"the reward function {self.function!r}"
        return "the reward terms " + ", ".join(repr(term.name) for term in self.terms)

    def unrouted_sources(self, data_sources: Sequence[str]) -> list[str]:
        """Of `data_sources`, those `sources` and `default_terms` give no terms (in order, once each)."""
        if not self.sources or self.default_terms is not None:
            return []
        return sorted({source for source in data_sources if source not in self.sources})


class UnroutedSourceError(ValueError):
    """A sample's data_source has no reward terms."""


def unrouted_message(sources: Sequence[str], where: str = "reward") -> str:
    shown = ", ".join(repr(source) for source in sources[:10])
    return (
        f"data_source {shown} has no reward terms: {where}.sources does not list it and {where}.default_terms "
        f"is not set (list it in {where}.sources, or set {where}.default_terms for the sources not listed)"
    )
