"""The episode loop on a scripted engine: each episode's turns are given as text, so every stop
reason, bad input and the trajectory's exact ids can be checked by hand. The Qwen3 renderer on a
BPE tokenizer with its special tokens, the real tool workers and the Python sandbox."""

from __future__ import annotations

import time

import pytest

from archon.agents.environment import Environment, EnvStep, StopReason, ToolUseEnvironment, tool_messages
from archon.agents.episodes import EpisodeLimits, EpisodeRunner
from archon.agents.renderer import get_renderer
from archon.agents.sandbox import builtin_tool
from archon.agents.tools import Tool, ToolRunner
from archon.rollout.base import Sample, SamplingParams
from tests.agent_tool_fixtures import lookup
from tests.test_renderers_qwen_llama import qwen3_tokenizer

PROMPT = "What is 123*456?"


@pytest.fixture(scope="module")
def renderer():
    return get_renderer("qwen3", qwen3_tokenizer(), enable_thinking=False)


@pytest.fixture(scope="module")
def tools():
    tools = [builtin_tool("python"), Tool.from_function(lookup)]
    with ToolRunner(tools, timeout_s=5.0, memory_mb=512) as runner:
        yield tools, runner


class ScriptedEngine:
    """Answers episode k's turn t with scripts[k][t] (text; the stop token is appended unless the
    text is cut by max_new_tokens). Episodes are told apart by their session keys."""

    def __init__(self, renderer, scripts: list[list[str]]):
        self.renderer, self.scripts = renderer, scripts
        self.episode_of_key: dict = {}
        self.turns: dict = {}
        self.calls: list[tuple[list[list[int]], list]] = []
        self.version = 7

    def generate(self, prompts, sampling: SamplingParams, sessions):
        self.calls.append((prompts, sessions))
        samples = []
        for index, key in enumerate(sessions):
            episode = self.episode_of_key.setdefault(key, len(self.episode_of_key))
            turn = self.turns.get(key, 0)
            self.turns[key] = turn + 1
            ids = self.renderer.encode(self.scripts[episode][turn]) + [self.renderer.stop_token_ids[0]]
            finish = "stop"
            if len(ids) > sampling.max_new_tokens:
                ids, finish = ids[: sampling.max_new_tokens], "length"
            samples.append(
                Sample(
                    index // sampling.n,
                    prompts[index // sampling.n],
                    ids,
                    [-0.25] * len(ids),
                    finish,
                    self.version,
                    [self.version] * len(ids),
                )
            )
        self.version += 1
        return samples


def run(renderer, tools, make_env, scripts, group_size=1, rows=None, **limits):
    tool_list, runner = tools
    episodes = EpisodeRunner(
        renderer, make_env, runner.call_many, [t.schema() for t in tool_list], EpisodeLimits(**limits)
    )
    engine = ScriptedEngine(renderer, scripts)
    rows = rows or [{"prompt": PROMPT}] * (len(scripts) // group_size)
    try:
        trajectories = episodes.run(rows, group_size, SamplingParams(temperature=1.0, seed=3), engine.generate, True)
    finally:
        episodes.close()
    return trajectories, engine


def python_call(code: str) -> str:
    return '<tool_call>\n{"name": "python", "arguments": {"code": "' + code + '"}}\n</tool_call>'


def test_a_tool_using_episode_is_the_sampled_ids_plus_the_rendered_environment(renderer, tools):
    make_env = lambda: ToolUseEnvironment(tools[0])  # noqa: E731
    trajectories, engine = run(renderer, tools, make_env, [[python_call("print(123*456)"), "56088"]])
    (t,) = trajectories
    assert t.stop_reason == StopReason.DONE and t.answer == "56088"
    assert t.num_turns == 2 and t.num_tool_calls == 1
    stop = renderer.stop_token_ids[0]
    first_turn = renderer.encode(python_call("print(123*456)")) + [stop]
    tool_message = {"role": "tool", "name": "python", "content": "56088\n"}
    bridged = renderer.bridge(first_turn, [tool_message])
    last_turn = renderer.encode("56088") + [stop]
    assert t.prompt_ids == renderer.render_prompt([{"role": "user", "content": PROMPT}], [x.schema() for x in tools[0]])
    assert t.completion_ids == first_turn + bridged + last_turn
    assert t.sampled_mask == [True] * len(first_turn) + [False] * len(bridged) + [True] * len(last_turn)
    assert t.token_versions == [7] * (len(first_turn) + len(bridged)) + [8] * len(last_turn)
    assert t.messages[-2] == tool_message
    # the second turn is prompted with the whole trajectory so far, under the episode's session
    prompts, sessions = engine.calls[1]
    assert prompts == [t.prompt_ids + first_turn + bridged] and len(sessions) == 1


def test_a_group_starts_from_one_prompt_and_every_stop_reason_is_recorded(renderer, tools):
    class Counting(ToolUseEnvironment):
        def step(self, turn, results):
            if turn.content == "boom":
                raise RuntimeError("the environment broke")
            if turn.content == "slow":
                time.sleep(3)
            return super().step(turn, results)

    make_env = lambda: Counting(tools[0])  # noqa: E731
    scripts = [
        ["56088"],  # done
        [python_call("print(1)")] * 3,  # turn limit
        ['<tool_call>\n{"name": "python", "arguments": {"code": </tool_call>'],  # parse error
        [python_call("print(1)") + "\n" + python_call("print(2)")] * 2,  # tool budget: 2 calls, then 2 more
        ["9" * 400],  # token budget: the turn is cut
        ["boom"],  # the environment raises
        ["slow"],  # the environment times out
        ['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "0"],  # unknown tool: told, goes on
    ]
    trajectories, engine = run(
        renderer,
        tools,
        make_env,
        scripts,
        group_size=8,
        max_turns=3,
        max_tool_calls=3,
        max_turn_tokens=64,
        step_timeout_s=1.0,
    )
    prompts, sessions = engine.calls[0]
    assert len(prompts) == 1 and len(sessions) == 8  # one prompt, n = 8
    reasons = [t.stop_reason for t in trajectories]
    assert reasons == [
        StopReason.DONE,
        StopReason.TURN_LIMIT,
        StopReason.PARSE_ERROR,
        StopReason.TOOL_BUDGET,
        StopReason.TOKEN_BUDGET,
        StopReason.ENV_ERROR,
        StopReason.TIMEOUT,
        StopReason.DONE,
    ]
    assert "JSON" in trajectories[2].error or "json" in trajectories[2].error.lower()
    assert "the environment broke" in trajectories[5].error
    assert (
        len(trajectories[4].completion_ids) == 64 and trajectories[4].completion_ids[-1] != renderer.stop_token_ids[0]
    )
    unknown = trajectories[7].messages[2]
    assert unknown["role"] == "tool" and "nope" in unknown["content"]
    for t in trajectories:  # every trajectory is its sampled turns and the environment's ids, nothing else
        assert len(t.completion_ids) == len(t.sampled_mask) == len(t.logprobs) == len(t.token_versions)
        assert all(lp == -0.25 for lp, sampled in zip(t.logprobs, t.sampled_mask) if sampled)


def test_bad_tools_and_environments_are_recorded_never_raised(renderer, tools):
    """A tool that fails comes back to the model as the tool's message; an environment whose reset
    raises gets an empty trajectory that trains nothing."""

    class BrokenReset(Environment):
        tools = []

        def reset(self, row):
            raise KeyError("prompt")

        def step(self, turn, results):
            return EnvStep(done=True)

    trajectories, _ = run(renderer, tools, BrokenReset, [["never"]])
    (t,) = trajectories
    assert t.stop_reason == StopReason.ENV_ERROR and "KeyError" in t.error
    assert t.completion_ids == [] and t.to_sample(0).completion_mask == []

    offered = tools[0]

    class Echo(Environment):
        tools = offered

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn, results):
            if turn.tool_calls:
                return EnvStep(messages=tool_messages(turn, results), reward=0.5)
            return EnvStep(done=True, reward=1.0)

    memory_hog = python_call("x = bytearray(10 * 2**30)")
    endless = python_call("while True: pass")
    bad_arguments = '<tool_call>\n{"name": "lookup", "arguments": {"word": 5}}\n</tool_call>'
    trajectories, _ = run(renderer, tools, Echo, [[memory_hog, endless, bad_arguments, "done"]], max_turns=4)
    (t,) = trajectories
    assert t.stop_reason == StopReason.DONE and t.reward == pytest.approx(2.5)
    results = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert "MemoryError" in results[0]
    assert "CPU" in results[1] or "wall-clock limit" in results[1]  # the sandbox stops it before the runner
    assert "word" in results[2] and "string" in results[2]


def test_group_rewards_replace_the_episodes_own(renderer, tools):
    class Ranked(ToolUseEnvironment):
        @classmethod
        def group_rewards(cls, trajectories):
            lengths = [len(t.completion_ids) for t in trajectories]
            return [float(n == min(lengths)) for n in lengths]

    make_env = lambda: Ranked(tools[0])  # noqa: E731
    trajectories, _ = run(renderer, tools, make_env, [["1"], ["12345"]], group_size=2)
    assert [t.reward for t in trajectories] == [1.0, 0.0]
