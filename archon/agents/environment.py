"""Environments: what a multi-turn episode talks to.

An environment sees messages, never token ids. It is made for one episode from a dataset row:

    class Calculator(Environment):
        tools = [builtin_tool("python")]

        def reset(self, row):                      # the first messages
            self.answer = row["answer"]
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn, tool_results):        # the model's turn, and its tool calls' results
            if turn.tool_calls:
                return EnvStep(messages=tool_messages(turn, tool_results))
            return EnvStep(reward=float(turn.content.strip() == self.answer), done=True)

The episode loop (archon/agents/episodes.py) renders the messages, samples the model's turn, runs
the turn's tool calls in the tool workers, calls `step`, and ends the episode with a StopReason.
A GRPO group is G environments made from the same row; `group_rewards` may replace the group's
rewards once all of its episodes are over (a ranking, a pass@k credit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archon.agents.renderer import AssistantTurn, Message
from archon.agents.tools import Tool, ToolResult
from archon.agents.trajectory import StopReason, Trajectory  # noqa: F401 - StopReason at its old path for one release


@dataclass
class EnvStep:
    """What the environment answers a turn with: the messages it adds (tool results, a user turn),
    this step's reward, and whether the episode is over. `answer`: the episode's final answer, for
    the task's reward function to score (its reward is added to the steps' rewards)."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    answer: str | None = None


class Environment:
    """One episode's world. Subclass it, set `tools`, implement `reset` and `step`."""

    tools: list[Tool] = []
    """The tools the model is offered (their schemas are rendered into the prompt)."""

    def reset(self, row: dict) -> list[Message]:
        """The episode's first messages (system, user), from a dataset row."""
        raise NotImplementedError

    def step(self, turn: AssistantTurn, tool_results: list[ToolResult]) -> EnvStep:
        """The model's turn and the results of its tool calls (in the order of turn.tool_calls)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds; called once the episode is over."""

    @classmethod
    def group_rewards(cls, trajectories: list["Trajectory"]) -> list[float] | None:
        """Rewards for a whole group (the G episodes of one row, once all are over) in place of
        their own, or None to keep them."""
        return None


def tool_messages(turn: AssistantTurn, results: list[ToolResult]) -> list[Message]:
    """One tool message per call of the turn, with its result."""
    messages = []
    for call, result in zip(turn.tool_calls, results, strict=True):
        message: Message = {"role": "tool", "name": call.name, "content": result.content}
        if call.id is not None:
            message["tool_call_id"] = call.id
        messages.append(message)
    return messages


class ToolUseEnvironment(Environment):
    """The built-in environment: the row's prompt (a string, or a message list) as the first
    messages, after `system_prompt` if given; a turn with tool calls gets their results back as tool
    messages, and the first turn without one ends the episode, its content the answer that the
    task's reward function scores."""

    def __init__(self, tools: list[Tool], system_prompt: str | None = None, prompt_field: str = "prompt") -> None:
        self.tools = tools
        self.system_prompt, self.prompt_field = system_prompt, prompt_field

    def reset(self, row: dict) -> list[Message]:
        prompt = row[self.prompt_field]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, turn: AssistantTurn, tool_results: list[ToolResult]) -> EnvStep:
        if turn.tool_calls:
            return EnvStep(messages=tool_messages(turn, tool_results))
        return EnvStep(done=True, answer=turn.content)
