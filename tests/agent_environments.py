"""Agent functions and environments that tests run by "module:attribute" (in worker processes, or
in the ranks of a torchrun run): importable without pytest."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai

from archon.agents.environment import Environment, EnvStep


def client(base_url: str) -> openai.OpenAI:
    # the endpoint's token, where it asks for one, is in the agent's environment
    return openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0)


def two_request_agent(base_url: str, row: dict) -> float:
    """Asks, then asks again with the model's answer in the conversation; rewards a longer second reply."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client(base_url).chat.completions.create(model="archon", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again?"},
    ]
    second = client(base_url).chat.completions.create(model="archon", messages=messages)
    return float(len(second.choices[0].message.content) > len(first.choices[0].message.content))


def greedy_agent(base_url: str, row: dict) -> float:
    """Up to 200 turns, each asking for 93 tokens, until the endpoint refuses."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(200):
        try:
            reply = client(base_url).chat.completions.create(model="archon", messages=messages, max_tokens=93)
        except openai.APIStatusError:
            break
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
    return 1.0


class Echo(Environment):
    """The row's prompt, then one more user turn per step; a reward of row["reward"] per step, done
    after row["steps"] steps."""

    def reset(self, row):
        self.row, self.steps = row, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn, tool_results):
        self.steps += 1
        return EnvStep(
            messages=[{"role": "user", "content": "go on"}],
            reward=self.row.get("reward", 0.5),
            done=self.steps >= self.row.get("steps", 2),
        )


class Stuck(Environment):
    """Adds its process id to row["pid_file"] (a line), then never answers its first step (or its
    reset, when row["stuck_in"] is "reset")."""

    def reset(self, row):
        with Path(row["pid_file"]).open("a") as pids:
            pids.write(f"{os.getpid()}\n")
        if row.get("stuck_in") == "reset":
            time.sleep(3600)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn, tool_results):
        time.sleep(3600)
