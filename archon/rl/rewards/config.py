"""The reward section of the config (`reward`, and each task's `tasks[i].reward`): a reward function
or weighted terms, routed by the rows' data_source."""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal, Sequence

from archon.rl.problems import Problems
from archon.rl.reward_fns import reward_function_problem
from archon.rl.rewards.http import MAX_CHOICES, JudgeConfig, RewardServerConfig, judge_choices

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


# ---- the section's rules ----------------------------------------------------------------------------


def reward_problems(reward: RewardConfig, where: str = "reward") -> Problems:
    """What is wrong with the reward section `where` (reward, or tasks[i].reward) on its own: its
    function or terms, and its routing by data_source naming terms it has."""
    if not reward.terms:
        problems = Problems()
        if (problem := reward_function_problem(reward.function)) is not None:
            problems.append(f"{where}.function={reward.function!r}: {problem}")
    else:
        problems = _reward_term_problems(reward, where)
        problems.require(
            reward.function == RewardConfig.function,
            f"{where}.function",
            reward.function,
            "is not used when reward.terms is set (make it one of the terms)",
        )
    names = {term.name for term in reward.term_configs()}
    for source, terms in reward.sources.items():
        for name in terms:
            problems.require(
                name in names,
                f"{where}.sources[{source!r}]",
                list(terms),
                f"names no term {name!r} (the terms: {sorted(names)})",
            )
    for name in reward.default_terms or ():
        problems.require(
            name in names,
            f"{where}.default_terms",
            list(reward.default_terms),
            f"names no term {name!r} (the terms: {sorted(names)})",
        )
    problems.require(
        reward.default_terms is None or reward.sources,
        f"{where}.default_terms",
        None if reward.default_terms is None else list(reward.default_terms),
        "only applies with reward.sources (without it every term scores every sample)",
    )
    return problems


def _reward_term_problems(reward: RewardConfig, where: str) -> Problems:
    problems = Problems()
    seen = set()
    for i, term in enumerate(reward.terms):
        at = f"{where}.terms[{i}]"
        problems.require(
            bool(TERM_NAME.fullmatch(term.name)),
            f"{at}.name",
            term.name,
            "must be letters, digits, _ . or - (it names the term's metrics)",
        )
        problems.require(term.name not in seen, f"{at}.name", term.name, "is the name of an earlier term")
        seen.add(term.name)
        problems.require(math.isfinite(term.weight), f"{at}.weight", term.weight, "must be a finite number")
        if term.kind in ("function", "group"):
            if (problem := reward_function_problem(term.function)) is not None:
                problems.append(f"{at}.function={term.function!r}: {problem}")
        elif term.kind == "server":
            problems += _http_problems(term.server, f"{at}.server", term.server.url, "url")
        else:
            problems += _judge_problems(term.judge, f"{at}.judge")
    return problems


def _http_problems(config: RewardServerConfig | JudgeConfig, at: str, url: str, url_name: str) -> list[str]:
    problems = Problems()
    problems.require(
        urllib.parse.urlsplit(url).scheme in ("http", "https") and bool(urllib.parse.urlsplit(url).netloc),
        f"{at}.{url_name}",
        url,
        "must be an http:// or https:// URL",
    )
    problems.require(config.timeout_s > 0, f"{at}.timeout_s", config.timeout_s, "must be positive")
    problems.require(config.retries >= 0, f"{at}.retries", config.retries, "must be 0 or more")
    problems.require(config.backoff_s >= 0, f"{at}.backoff_s", config.backoff_s, "must be 0 or more")
    problems.require(config.concurrency >= 1, f"{at}.concurrency", config.concurrency, "must be 1 or more")
    problems.require(
        not config.api_key_env or bool(os.environ.get(config.api_key_env)),
        f"{at}.api_key_env",
        config.api_key_env,
        "names an environment variable that is not set",
    )
    if isinstance(config, RewardServerConfig):
        problems.require(config.batch_size >= 1, f"{at}.batch_size", config.batch_size, "must be 1 or more")
    return problems


def _judge_problems(judge: JudgeConfig, at: str) -> list[str]:
    problems = Problems(_http_problems(judge, at, judge.base_url, "base_url"))
    problems.require(bool(judge.model), f"{at}.model", judge.model, "must name the model the endpoint serves")
    problems.require(judge.max_tokens >= 1, f"{at}.max_tokens", judge.max_tokens, "must be 1 or more")
    if not judge.prompt:
        problems.append(f"{at}.prompt is not set: the rubric, with {{prompt}}, {{completion}} and {{reference}}")
    else:
        try:
            judge.prompt.format(prompt="", completion="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            problems.append(
                f"{at}.prompt: {type(e).__name__}: {e} (the template may use {{prompt}}, {{completion}} "
                "and {reference}; write a literal brace twice)"
            )
    low, high = judge.score_range
    problems.require(
        math.isfinite(low) and math.isfinite(high) and low < high,
        f"{at}.score_range",
        list(judge.score_range),
        "must be two finite numbers, the lowest first",
    )
    if judge.score_regex:
        try:
            re.compile(judge.score_regex)
        except re.error as e:
            problems.append(f"{at}.score_regex={judge.score_regex!r}: not a regular expression: {e}")
    if judge.structured_output == "choice":
        problems.require(
            0 < len(judge_choices(judge)) <= MAX_CHOICES,
            f"{at}.score_range",
            list(judge.score_range),
            f"with structured_output=choice must hold 1 to {MAX_CHOICES} integers (the choices)",
        )
    return problems
