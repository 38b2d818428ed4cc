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

import concurrent.futures
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

from archon.agents.environment import Environment, EnvStep, StopReason
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
    def __init__(self, key, env: Environment, row: dict, group: int) -> None:
        self.key, self.env, self.row, self.group = key, env, row, group
        self.trajectory: Trajectory | None = None

    @property
    def running(self) -> bool:
        return self.trajectory is not None and self.trajectory.stop_reason is None

    def stop(self, reason: StopReason, error: str | None = None) -> None:
        self.trajectory.stop_reason = reason
        self.trajectory.error = error


class EpisodeRunner:
    """Runs groups of episodes. make_env(): a fresh Environment (one per episode); run_tools(calls):
    their results in order (archon.agents.tools.ToolRunner.call_many); tool_schemas: what the
    prompt offers."""

    _keys = itertools.count()

    def __init__(
        self,
        renderer: Renderer,
        make_env: Callable[[], Environment],
        run_tools: Callable[[list[ToolCall]], list[ToolResult]],
        tool_schemas: list[dict] | None,
        limits: EpisodeLimits,
    ) -> None:
        self.renderer, self.make_env, self.run_tools = renderer, make_env, run_tools
        self.tool_schemas = tool_schemas or None
        for name in ("max_turns", "max_tokens", "max_turn_tokens"):
            if getattr(limits, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be at least 1, got {getattr(limits, name)}")
        self.limits = limits
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="archon-env")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def framing_tokens(self, system_prompt: str | None = None) -> int:
        """The ids a first prompt has beyond its messages' text: the format's framing, the tool
        schemas and the system prompt (for sizing a server's context)."""
        messages = [{"role": "user", "content": ""}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return len(self.renderer.render_prompt(messages, self.tool_schemas))

    def _call_env(self, episode: _Episode, fn, *args):
        """fn(*args) with the step timeout; (result, None) or (None, (reason, error))."""
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=self.limits.step_timeout_s), None
        except concurrent.futures.TimeoutError:
            # the thread cannot be stopped; the episode no longer waits for it
            return None, (StopReason.TIMEOUT, f"the environment took more than {self.limits.step_timeout_s} s")
        except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, not the run
            return None, (StopReason.ENV_ERROR, describe_exception(exc))

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
        episodes = [
            _Episode(next(self._keys), self.make_env(), row, g) for g, row in enumerate(rows) for _ in range(group_size)
        ]
        try:
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
                try:
                    episode.env.close()
                except Exception:  # noqa: BLE001 - closing is best effort; the trajectory is kept
                    pass
        trajectories = [e.trajectory for e in episodes]
        for g in range(len(rows)):
            group = trajectories[g * group_size : (g + 1) * group_size]
            replaced = type(episodes[g * group_size].env).group_rewards(group)
            if replaced is not None:
                if len(replaced) != len(group):
                    raise ValueError(f"group_rewards returned {len(replaced)} rewards for a group of {len(group)}")
                for trajectory, reward in zip(group, replaced):
                    trajectory.reward = float(reward)
        return trajectories

    def _start(self, episodes: list[_Episode]) -> None:
        for episode in episodes:
            messages, failure = self._call_env(episode, episode.env.reset, episode.row)
            if failure is None:
                try:
                    prompt_ids = self.renderer.render_prompt(list(messages), self.tool_schemas)
                except Exception as exc:  # noqa: BLE001 - messages the format cannot render
                    failure = (StopReason.ENV_ERROR, f"rendering the first messages failed: {describe_exception(exc)}")
            if failure is not None:
                # an empty trajectory: it trains nothing, and keeps its group whole
                episode.trajectory = Trajectory(
                    prompt_ids=self.renderer.render_prompt([{"role": "user", "content": ""}])
                )
                episode.stop(*failure)
                continue
            episode.trajectory = Trajectory(prompt_ids=prompt_ids, messages=list(messages))

    def _turn(
        self, running: list[_Episode], turn: int, sampling: SamplingParams, generate: Generate, keeps_sessions: bool
    ) -> None:
        limits = self.limits
        budget = min(limits.max_turn_tokens, max(limits.max_tokens - len(e.trajectory.completion_ids) for e in running))
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
            left = limits.max_tokens - len(trajectory.completion_ids)
            ids = sample.completion_ids[:left]
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
        start = 0
        for episode, parsed in pending:
            own = results[start : start + len(parsed.tool_calls)]
            start += len(parsed.tool_calls)
            self._step(episode, parsed, own, last_turn=turn == limits.max_turns - 1)

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

    def _step(self, episode: _Episode, parsed: AssistantTurn, results: list[ToolResult], last_turn: bool) -> None:
        trajectory = episode.trajectory
        step, failure = self._call_env(episode, episode.env.step, parsed, results)
        if failure is None and not isinstance(step, EnvStep):
            failure = (StopReason.ENV_ERROR, f"step returned {type(step).__name__}, expected an EnvStep")
        if failure is not None:
            episode.stop(*failure)
            return
        trajectory.step_rewards.append(float(step.reward))
        trajectory.reward += float(step.reward)
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
        if len(trajectory.completion_ids) + len(added) >= self.limits.max_tokens:
            episode.stop(StopReason.TOKEN_BUDGET)
            return
        trajectory.add_environment(added)
        trajectory.messages.extend(messages)


def last_turn_ids(trajectory: Trajectory) -> list[int]:
    """The ids of the trajectory's last sampled turn."""
    end = len(trajectory.sampled_mask)
    start = end
    while start > 0 and trajectory.sampled_mask[start - 1]:
        start -= 1
    return trajectory.completion_ids[start:end]
