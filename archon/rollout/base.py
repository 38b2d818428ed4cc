"""The rollout-engine contract: prompts in, sampled token ids + log-probs + finish reasons out.

An engine only generates: it never sees the trainer. Which adapter version it samples with is
published to it by the weight sync (archon.sync.weight_sync) through a ServedPolicy
(archon.rollout.policy), and every Sample carries that version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from archon.rollout.policy import ServedPolicy


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    n: int = 1
    """Samples per prompt."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Seeds the sampling noise: the same call gives the same samples. The native engine draws the
    noise of a step for its whole cache table from one generator, so a prompt's samples depend also
    on the other prompts of the call and on the table's size (with several tasks: only on the
    prompts of the same task)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.n < 1:
            raise ValueError(f"SamplingParams.top_k must be >= 0 and n >= 1, got top_k={self.top_k}, n={self.n}")


@dataclass
class Sample:
    """One completion. `logprobs[i]` is log μ(completion_ids[i]) under the distribution the token
    was drawn from (the behaviour policy μ): the policy at the sampling temperature, truncated by
    top-k then top-p and renormalised (no truncation: just the temperature; greedy: temperature 1),
    under the adapter version `token_versions[i]`.

    `version` is the adapter version the sample was started with, the oldest of its tokens'. Under
    the update policy 'finish' (a request finishes on the version it started with) every token has
    that version; under 'continue' (partial rollouts) a publish during the sample switches its later
    tokens to the new version, so `token_versions` is non-decreasing, e.g. [v]*a + [v+1]*b."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    version: int
    token_versions: list[int]
    extra: dict = field(default_factory=dict)
    completion_mask: list[bool] | None = None
    """Which completion tokens are trained on; None: all of them. A multi-turn trajectory
    (archon.agents.trajectory) masks out the tokens its environment added between sampled turns."""

    def __post_init__(self) -> None:
        for name in ("token_versions", "logprobs", "completion_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completion_ids):
                raise ValueError(
                    f"Sample.{name} has {len(values)} entries for {len(self.completion_ids)} completion tokens"
                )


class RolloutEngine(Protocol):
    policy: ServedPolicy
    """The published adapter version (and served name) new requests use; the weight sync writes it."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """`sampling.n` samples per prompt, ordered prompt by prompt."""

    def health(self) -> dict:
        """Liveness and the adapter version new requests get."""

    def close(self) -> None:
        """Release what the engine holds (servers it launched, threads); safe to call twice."""
