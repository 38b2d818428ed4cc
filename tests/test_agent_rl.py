"""Multi-turn tasks in the RL loop, on a tiny random Qwen3 with the Qwen3 chat format: a task with
the built-in tool_use environment, and an agent function written against an OpenAI client, each
trained for a step; what they train on is their trajectories' sampled ids."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from archon.agents.episodes import EpisodeLimits
from archon.agents.setup import EnvironmentConfig
from archon.lora import LoRAConfig
from archon.rl.config import EvalConfig, LoggingConfig, RLConfig, RolloutConfig
from archon.rl.data import DataConfig
from archon.rl.loop import RLRun
from archon.rl.rewards import RewardConfig
from archon.tools.align import make_tiny_hf_checkpoint
from tests.test_renderers_qwen_llama import qwen3_tokenizer


def two_request_agent(base_url: str, row: dict) -> float:
    """Asks, then asks again with the model's answer in the conversation; rewards a longer second reply."""
    client = openai.OpenAI(base_url=base_url, max_retries=0)  # the endpoint's token: OPENAI_API_KEY
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="archon", messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again?"},
    ]
    second = client.chat.completions.create(model="archon", messages=messages)
    return float(len(second.choices[0].message.content) > len(first.choices[0].message.content))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = qwen3_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("qwen3"),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    tokenizer.save_pretrained(model_dir)
    data = model_dir / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a}*{b}?", "answer": str(a * b)}) + "\n"
            for a, b in [(12, 34), (56, 78), (90, 12), (34, 56)]
        )
    )
    return model_dir, data


def config(checkpoint, run_dir, environment: EnvironmentConfig) -> RLConfig:
    model_dir, data = checkpoint
    return RLConfig(
        steps=1,
        seed=0,
        model=dataclasses.replace(RLConfig().model, path=str(model_dir)),
        lora=LoRAConfig(rank=4, alpha=8.0),
        data=DataConfig(path=str(data), answer_field="answer"),
        reward=RewardConfig(function="exact", num_workers=0),
        rollout=RolloutConfig(group_size=2, prompts_per_step=2, max_new_tokens=16, temperature=1.0),
        environment=environment,
        eval=EvalConfig(every=0),
        logging=LoggingConfig(run_dir=str(run_dir)),
    )


def test_a_tool_use_task_trains_on_its_episodes(checkpoint, tmp_path):
    environment = EnvironmentConfig(
        name="tool_use",
        tools=("python",),
        enable_thinking=False,
        limits=EpisodeLimits(max_turns=2, max_tokens=48, max_turn_tokens=12),
    )
    run = RLRun(config(checkpoint, tmp_path / "run", environment))
    try:
        metrics = run.run()
    finally:
        run.close()
    assert metrics["reward_samples"] == 4 and metrics["turns_mean"] >= 1
    stops = sum(
        metrics[f"stop_{reason}"]
        for reason in ("done", "turn_limit", "token_budget", "tool_budget", "parse_error", "timeout", "env_error")
    )
    assert stops == pytest.approx(1.0)
    # the behaviour log-probs of every sampled id, turn after turn, are the trainer's at the same positions
    assert metrics["sampled_tokens_mean"] > 0 and metrics["logprob_abs_diff_max"] < 1e-4


def test_an_agent_function_task_trains_on_its_recorded_sessions(checkpoint, tmp_path):
    environment = EnvironmentConfig(
        agent="tests.test_agent_rl:two_request_agent", enable_thinking=False, limits=EpisodeLimits(max_turn_tokens=10)
    )
    run = RLRun(config(checkpoint, tmp_path / "run", environment))
    try:
        metrics = run.run()
    finally:
        run.close()
    assert metrics["reward_samples"] == 4  # two prompts x two agents
    assert metrics["turns_mean"] == 2 and metrics["stop_done"] == 1.0  # each made two requests and returned
    assert metrics["environment_tokens_mean"] > 0 and metrics["sampled_tokens_mean"] > 0
    assert metrics["logprob_abs_diff_max"] < 1e-4  # the recorded log-probs are the ones the trainer computes
