"""The episode loop: G environments per dataset row, turn after turn, on any rollout engine.

Every turn, the episodes still running are generated together in one engine call, each prompted
with its whole trajectory so far (token ids, never text): the built-in engine keeps each episode's
KV cache between turns (`sessions=`), so a turn prefills only what the environment added; a vLLM
server gets the same token ids and reuses its prefix cache. The first turn of a row whose G
environments render the same prompt is one prompt with n = G samples.

After a turn: the renderer reads it back (content, reasoning, tool calls); a malformed tool call
ends the episode (parse_error), as does a turn asking for more tool calls than the episode has left
(tool_budget). The tool calls run in the tool workers, the environment's `step` takes the turn and
their results, and the messages it returns are rendered by `bridge` and appended, unsampled.
Episodes end when the environment says so (done), after `max_turns` turns (turn_limit), or when
the trajectory reaches `max_tokens` completion tokens or a turn ends unfinished (token_budget); a
sampled turn that would cross the budget is cut to it. An environment that raises or overruns
`step_timeout_s` ends its own episode (env_error, timeout) and never the run.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable

from archon.agents.environment import Environment, EnvStep, StopReason
from archon.agents.environment_worker import EnvironmentProcess, InProcessEnvironment, checked_reward, step_failure
from archon.agents.renderer import AssistantTurn, Message, Renderer
from archon.agents.tools import ToolCall, ToolResult
from archon.agents.trajectory import Trajectory
from archon.rollout.base import Sample, SamplingParams
from archon.workers import describe_exception

Generate = Callable[[list[list[int]], SamplingParams, list | None], list[Sample]]
"""(prompts, sampling, sessions: one key per sample or None) -> samples, as RolloutEngine.generate."""


@dataclass
class EpisodeLimits:
    max_turns: int = 8
    """Assistant turns per episode."""
    max_tokens: int = 2048
    """Completion tokens per trajectory: sampled turns and environment additions together."""
    max_turn_tokens: int = 512
    """Sampled tokens per turn."""
    max_tool_calls: int = 16
    """Tool calls per episode."""
    step_timeout_s: float = 60.0
    """Seconds an environment's reset or step may take."""


class _Episode:
    def __init__(self, key, env, row: dict, group: int) -> None:
        self.key, self.env, self.row, self.group = key, env, row, group
        """env: where the environment runs (archon.agents.environment_worker)."""
        self.trajectory: Trajectory | None = None

    @property
    def running(self) -> bool:
        return self.trajectory is not None and self.trajectory.stop_reason is None

    def stop(self, reason: StopReason, error: str | None = None) -> None:
        self.trajectory.stop_reason = reason
        self.trajectory.error = error


class EpisodeRunner:
    """Runs groups of episodes. make_env(): a fresh Environment, or an EnvironmentProcess (one per
    episode); run_tools(calls): their results in order (archon.agents.tools.ToolRunner.call_many);
    tool_schemas: what the prompt offers. `context_tokens`: the model's context (set by the run;
    None: unbounded): a trajectory never grows past it."""

    _keys = itertools.count()

    def __init__(
        self,
        renderer: Renderer,
        make_env: Callable[[], Environment | EnvironmentProcess],
        run_tools: Callable[[list[ToolCall]], list[ToolResult]],
        tool_schemas: list[dict] | None,
        limits: EpisodeLimits,
        context_tokens: int | None = None,
    ) -> None:
        self.renderer, self.make_env, self.run_tools = renderer, make_env, run_tools
        self.tool_schemas = tool_schemas or None
        for name in ("max_turns", "max_tokens", "max_turn_tokens"):
            if getattr(limits, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be at least 1, got {getattr(limits, name)}")
        self.limits = limits
        self.context_tokens = context_tokens

    def close(self) -> None:
        """Nothing outlives an episode (its environment's process or calls end with it)."""

    def framing_tokens(self, system_prompt: str | None = None) -> int:
        """The ids a first prompt has beyond its messages' text (for sizing a server's context)."""
        return framing_tokens(self.renderer, self.tool_schemas, system_prompt)

    def _environment(self):
        env = self.make_env()
        return InProcessEnvironment(env, self.limits.step_timeout_s) if isinstance(env, Environment) else env

    def _call_all(self, calls: list[tuple[_Episode, str, tuple]]) -> list[tuple]:
        """Each (episode, method, args) called at once on its environment; (result, None) or
        (None, (reason, error)) each, all within one step timeout."""
        pending = [episode.env.submit(method, *args) for episode, method, args in calls]
        deadline = time.monotonic() + self.limits.step_timeout_s
        return [call.result(deadline) for call in pending]

    def run(
        self,
        rows: list[dict],
        group_size: int,
        sampling: SamplingParams,
        generate: Generate,
        keeps_sessions: bool,
        end_sessions: Callable[[list], None] | None = None,
        any_running: Callable[[bool], bool] = bool,
    ) -> list[Trajectory]:
        """G = group_size episodes of each row, ordered row by row; sampling gives the temperature,
        top-p/top-k and seed (its n and max_new_tokens are set per turn, and turn k draws with seed +
        k). keeps_sessions: `generate` takes each episode's key and keeps its KV cache between turns,
        freed by end_sessions(keys) at the end. any_running(this process has episodes running) ->
        whether any process in lockstep with it does: while one does, every one generates (nothing,
        once its own are over), so that all run the same forwards."""
        episodes: list[_Episode] = []
        try:
            for g, row in enumerate(rows):
                episodes += [_Episode(next(self._keys), self._environment(), row, g) for _ in range(group_size)]
            self._start(episodes)
            for turn in range(self.limits.max_turns):
                running = [e for e in episodes if e.running]
                if not any_running(bool(running)):
                    break
                turn_sampling = (
                    sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + turn)
                )
                if running:
                    self._turn(running, turn, turn_sampling, generate, keeps_sessions)
                else:
                    generate([], dataclasses.replace(turn_sampling, n=1), [] if keeps_sessions else None)
            for episode in episodes:
                if episode.running:
                    episode.stop(StopReason.TURN_LIMIT)
        finally:
            if keeps_sessions and end_sessions is not None:
                end_sessions([e.key for e in episodes])
            for episode in episodes:
                episode.env.close()
        trajectories = [e.trajectory for e in episodes]
        for g in range(len(rows)):
            environment_class = episodes[g * group_size].env.environment_class
            group_rewards(environment_class, trajectories[g * group_size : (g + 1) * group_size])
        return trajectories

    def _start(self, episodes: list[_Episode]) -> None:
        outcomes = self._call_all([(episode, "reset", (episode.row,)) for episode in episodes])
        for episode, (messages, failure) in zip(episodes, outcomes):
            prompt_ids = None
            if failure is None:
                try:
                    prompt_ids = self.renderer.render_prompt(list(messages), self.tool_schemas)
                except Exception as exc:  # noqa: BLE001 - messages the format cannot render
                    failure = (StopReason.ENV_ERROR, f"rendering the first messages failed: {describe_exception(exc)}")
            if failure is None and self.context_tokens is not None and len(prompt_ids) >= self.context_tokens:
                failure = (
                    StopReason.PROMPT_TOO_LONG,
                    f"the environment's first messages render to {len(prompt_ids)} tokens, and the model's "
                    f"context is {self.context_tokens}",
                )
            if failure is not None:
                # an empty trajectory: it trains nothing, and keeps its group whole
                episode.trajectory = Trajectory(
                    prompt_ids=self.renderer.render_prompt([{"role": "user", "content": ""}])
                )
                episode.stop(*failure)
                continue
            episode.trajectory = Trajectory(prompt_ids=prompt_ids, messages=list(messages))

    def _room(self, trajectory: Trajectory) -> int:
        """The ids the trajectory may still grow by: the run's limit and the model's context."""
        room = self.limits.max_tokens - len(trajectory.completion_ids)
        if self.context_tokens is not None:
            room = min(room, self.context_tokens - len(trajectory.trajectory_ids))
        return room

    def _turn(
        self, running: list[_Episode], turn: int, sampling: SamplingParams, generate: Generate, keeps_sessions: bool
    ) -> None:
        limits = self.limits
        budget = min(limits.max_turn_tokens, max(self._room(e.trajectory) for e in running))
        if self.context_tokens is not None:
            # one call, one max_new_tokens: an episode whose context cannot hold it ends here
            for episode in running:
                left = self.context_tokens - len(episode.trajectory.trajectory_ids)
                if left < budget:
                    episode.stop(
                        StopReason.TOKEN_BUDGET,
                        f"the model's context ({self.context_tokens}) has room for {left} more tokens, "
                        f"the turn asks for {budget}",
                    )
            running = [e for e in running if e.running]
            if not running:
                generate([], dataclasses.replace(sampling, n=1), [] if keeps_sessions else None)
                return
        turn_sampling = dataclasses.replace(
            sampling, n=1, max_new_tokens=budget, stop_token_ids=tuple(self.renderer.stop_token_ids)
        )
        if turn == 0:
            samples = self._first_turn(running, turn_sampling, generate, keeps_sessions)
        else:
            prompts = [e.trajectory.trajectory_ids for e in running]
            samples = generate(prompts, turn_sampling, [e.key for e in running] if keeps_sessions else None)
        pending: list[tuple[_Episode, AssistantTurn]] = []
        for episode, sample in zip(running, samples, strict=True):
            trajectory = episode.trajectory
            if turn == 0:
                trajectory.start_version = sample.version
            ids = sample.completion_ids[: self._room(trajectory)]
            trajectory.add_sampled(ids, sample.logprobs[: len(ids)], sample.token_versions[: len(ids)])
            trajectory.num_turns += 1
            parsed = self.renderer.parse_turn(ids)
            trajectory.messages.append(parsed.message())
            if sample.finish_reason != "stop" or len(ids) < len(sample.completion_ids):
                episode.stop(StopReason.TOKEN_BUDGET)
            elif parsed.parse_error is not None:
                episode.stop(StopReason.PARSE_ERROR, parsed.parse_error)
            elif trajectory.num_tool_calls + len(parsed.tool_calls) > limits.max_tool_calls:
                episode.stop(
                    StopReason.TOOL_BUDGET,
                    f"{len(parsed.tool_calls)} tool calls with "
                    f"{limits.max_tool_calls - trajectory.num_tool_calls} left",
                )
            else:
                trajectory.num_tool_calls += len(parsed.tool_calls)
                pending.append((episode, parsed))
        calls = [call for _, parsed in pending for call in parsed.tool_calls]
        results = self.run_tools(calls) if calls else []
        steps, start = [], 0
        for episode, parsed in pending:
            steps.append((episode, "step", (parsed, results[start : start + len(parsed.tool_calls)])))
            start += len(parsed.tool_calls)
        for (episode, _, (parsed, _)), outcome in zip(steps, self._call_all(steps)):
            self._step(episode, outcome, last_turn=turn == limits.max_turns - 1)

    def _first_turn(
        self, running: list[_Episode], sampling: SamplingParams, generate: Generate, keeps_sessions: bool
    ) -> list[Sample]:
        """One prompt with n = G for a row whose episodes start alike; else one prompt each."""
        by_group: dict[int, list[_Episode]] = {}
        for episode in running:
            by_group.setdefault(episode.group, []).append(episode)
        shared = all(len({tuple(e.trajectory.prompt_ids) for e in group}) == 1 for group in by_group.values())
        sizes = {len(group) for group in by_group.values()}
        if shared and len(sizes) == 1:
            n = sizes.pop()
            ordered = [e for group in by_group.values() for e in group]
            if ordered == running:
                prompts = [group[0].trajectory.prompt_ids for group in by_group.values()]
                return generate(
                    prompts, dataclasses.replace(sampling, n=n), [e.key for e in ordered] if keeps_sessions else None
                )
        return generate(
            [e.trajectory.prompt_ids for e in running], sampling, [e.key for e in running] if keeps_sessions else None
        )

    def _step(self, episode: _Episode, outcome: tuple, last_turn: bool) -> None:
        """The environment's answer to a turn, (EnvStep or its fields as a dict, None) or (None, failure)."""
        trajectory = episode.trajectory
        step, failure = outcome
        if failure is None:
            if isinstance(step, dict):  # from a worker process, checked there
                step = EnvStep(**step)
            elif (error := step_failure(step, episode.env.environment_class.__name__)) is not None:
                failure = (StopReason.ENV_ERROR, error)
        if failure is not None:
            episode.stop(*failure)
            return
        reward = float(step.reward)
        trajectory.step_rewards.append(reward)
        trajectory.reward += reward
        if step.answer is not None:
            trajectory.answer = step.answer
        if step.done:
            episode.stop(StopReason.DONE)
            return
        if last_turn:
            episode.stop(StopReason.TURN_LIMIT)
            return
        messages: list[Message] = list(step.messages)
        try:
            added = self.renderer.bridge(last_turn_ids(trajectory), messages)
        except Exception as exc:  # noqa: BLE001 - messages the format cannot render
            episode.stop(
                StopReason.ENV_ERROR, f"rendering the environment's messages failed: {describe_exception(exc)}"
            )
            return
        if len(added) >= self._room(trajectory):
            episode.stop(StopReason.TOKEN_BUDGET)
            return
        trajectory.add_environment(added)
        trajectory.messages.extend(messages)


def group_rewards(environment_class: type[Environment], group: list[Trajectory]) -> None:
    """Replace the group's rewards by the environment's group_rewards, when it gives them. When it
    raises or gives a wrong count or a reward that is not a finite number, the group ends
    (env_error, naming the environment) with reward 0 everywhere: it trains nothing."""
    name = environment_class.__name__
    try:
        replaced = environment_class.group_rewards(group)
        if replaced is None:
            return
        if len(replaced) != len(group):
            raise ValueError(f"it returned {len(replaced)} rewards for a group of {len(group)}")
        rewards = []
        for reward in replaced:
            value, error = checked_reward(reward, f"{name}.group_rewards")
            if error is not None:
                raise ValueError(error)
            rewards.append(value)
    except Exception as exc:  # noqa: BLE001 - a group's failure ends the group, not the run
        why = f"{name}.group_rewards failed: {describe_exception(exc)}"
        for trajectory in group:
            trajectory.reward, trajectory.stop_reason, trajectory.error = 0.0, StopReason.ENV_ERROR, why
        return
    for trajectory, reward in zip(group, rewards):
        trajectory.reward = reward


def framing_tokens(renderer: Renderer, tool_schemas: list[dict] | None, system_prompt: str | None) -> int:
    """The ids a first prompt has beyond its messages' text: the format's framing, the tool schemas
    and the system prompt."""
    messages = [{"role": "user", "content": ""}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return len(renderer.render_prompt(messages, tool_schemas))


def last_turn_ids(trajectory: Trajectory) -> list[int]:
    """The ids of the trajectory's last sampled turn."""
    end = len(trajectory.sampled_mask)
    start = end
    while start > 0 and trajectory.sampled_mask[start - 1]:
        start -= 1
    return trajectory.completion_ids[start:end]
