"""A task's episodes run by an agent function (environment.agent) within the run's limits.

The agents talk to an OpenAI-compatible endpoint (archon/agents/openai_server.py) served from the
rollout engine for the duration of each `run`, every row's G agents at once
(archon/agents/openai_agents.py run_agent_group). The run's limits hold whatever the agents ask:

- no turn samples more than `limits.max_turn_tokens` tokens, whatever a request's max_tokens says;
- each session is opened with a budget (`max_session_tokens`) of the model's context (and of the
  launched vLLM servers' max_model_len): a request is cut to what is left, and once it is spent
  the session's requests are refused;
- a trajectory longer than `limits.max_tokens` completion tokens is cut to it after the episode
  (`Trajectory.cut`, counted in the `cut_trajectories` metric): it is never trained whole.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

from archon.agents.episodes import EpisodeLimits, framing_tokens
from archon.agents.openai_agents import AgentFn, run_agent_group
from archon.agents.openai_engine import engine_context
from archon.agents.openai_server import ChatCompletionsServer
from archon.agents.trajectory import Trajectory
from archon.rollout.base import SamplingParams


class TurnLimitedEngine:
    """A rollout engine whose calls never sample more than `max_turn_tokens` tokens a sequence."""

    def __init__(self, engine, max_turn_tokens: int) -> None:
        self.engine, self.max_turn_tokens = engine, max_turn_tokens
        self._takes_sessions = "sessions" in inspect.signature(engine.generate).parameters
        if hasattr(engine, "end_sessions"):
            self.end_sessions = engine.end_sessions

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, sessions: list | None = None):
        capped = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, self.max_turn_tokens))
        if self._takes_sessions:
            return self.engine.generate(prompts, capped, sessions=sessions)
        return self.engine.generate(prompts, capped)


def session_budget(context_tokens: int | None, engine) -> int | None:
    """The most ids a session may hold: the model's context, and the engine's own limit (the vLLM
    servers' max_model_len) when smaller (None: unbounded)."""
    launched = getattr(getattr(engine, "servers", None), "max_model_len", None)  # VLLMRolloutEngine's servers
    known = [limit for limit in (context_tokens, engine_context(engine), launched) if isinstance(limit, int)]
    return min(known) if known else None


class AgentEpisodes:
    """A task's episodes run by `agent_fn` on an endpoint served from the rollout engine. Requests
    that set no sampling parameters sample as the run does (its temperature, top-p and top-k;
    `limits.max_turn_tokens` per request). `context_tokens`: the model's context (set by the run)."""

    def __init__(
        self, agent_fn: AgentFn, renderer, limits: EpisodeLimits, timeout_s: float, context_tokens: int | None = None
    ) -> None:
        self.agent_fn, self.renderer, self.limits, self.timeout_s = agent_fn, renderer, limits, timeout_s
        self.context_tokens = context_tokens

    def framing_tokens(self, system_prompt: str | None = None) -> int:
        """The ids a first prompt has beyond its messages' text (for sizing a server's context)."""
        return framing_tokens(self.renderer, None, system_prompt)

    def close(self) -> None:
        """Nothing outlives a run() (its endpoint closes with it)."""

    def run(self, rows: list[dict], group_size: int, sampling: SamplingParams, engine) -> list[Trajectory]:
        default = dataclasses.replace(sampling, n=1, max_new_tokens=self.limits.max_turn_tokens)
        results: list[list[Trajectory] | None] = [None] * len(rows)
        budget = session_budget(self.context_tokens, engine)
        with ChatCompletionsServer(
            TurnLimitedEngine(engine, self.limits.max_turn_tokens),
            self.renderer,
            "archon",
            default,
            max_session_tokens=budget,
            max_context_tokens=budget,
        ) as server:

            def run_row(i: int) -> None:
                results[i] = run_agent_group(server, self.agent_fn, rows[i], group_size, self.timeout_s)

            threads = [threading.Thread(target=run_row, args=(i,), name=f"agent-row-{i}") for i in range(len(rows))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        trajectories = [trajectory for group in results for trajectory in group]
        for trajectory in trajectories:
            if not trajectory.prompt_ids:  # an agent that made no request: an empty trajectory that trains nothing
                trajectory.prompt_ids = self.renderer.render_prompt([{"role": "user", "content": ""}])
            limit = self.limits.max_tokens
            if self.context_tokens is not None:
                limit = min(limit, self.context_tokens - len(trajectory.prompt_ids))
            trajectory.cut_to(limit)
        return trajectories
