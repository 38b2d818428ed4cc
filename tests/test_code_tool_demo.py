"""The code-tool demo: its tokenizer, its shipped warm start (a weak policy in the episode loop) and a
short RL run from it on which the tool calls and the reward rise."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from archon.demos import code_tool as code_tool_demo
from archon.demos.warm_start import packaged_tokenizer, packaged_warm_start, prepare_demo
from archon.rl.config import load_config_file, parse_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "code_tool_demo.yaml"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The demo's config and its warm start, installed from the shipped files in a fresh cache."""
    config = load_config_file(CONFIG)
    demo = dataclasses.replace(config.demo, cache_dir=str(tmp_path_factory.mktemp("cache")))
    messages = []
    files = prepare_demo(demo, config.parallel, config.seed, rank=0, log=messages.append)
    return config, demo, files, messages


def test_the_demo_starts_from_the_shipped_weights_and_tokenizer(shipped):
    config, demo, files, messages = shipped
    weights, tokenizer = packaged_warm_start(demo, config.seed), packaged_tokenizer(demo, config.seed)
    assert weights.exists() and tokenizer.exists(), f"nothing shipped for the code-tool demo's settings: {demo}"
    assert any("shipped with archon" in m for m in messages)
    assert not any("sandbox" in m or "SFT" in m or "tokenizer" in m for m in messages)  # nothing was made anew
    loaded, expected = load_file(files.model_dir / "model.safetensors"), load_file(weights)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert (files.model_dir / code_tool_demo.TOKENIZER_FILE).read_text() == tokenizer.read_text()


def test_the_tokenizer_has_the_qwen3_special_tokens_single_digits_and_a_short_tools_preamble(shipped):
    config, _, files, _ = shipped
    tokenizer = code_tool_demo.hf_tokenizer(files.model_dir / code_tool_demo.TOKENIZER_FILE)
    for token in code_tool_demo.SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("print(123*4056)", add_special_tokens=False)]
    assert "".join(pieces) == "print(123*4056)"
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234056")  # a digit is a token alone
    row = json.loads(files.held_out_path.read_text().splitlines()[0])
    renderer = code_tool_demo.demo_renderer(tokenizer)
    plan = {"row": row, "offered": True, "code": None}
    (trajectory,) = code_tool_demo.sft_trajectories(renderer, [plan])
    # the preamble that describes the tool (hundreds of characters) is a few tokens
    assert len(trajectory.prompt_ids) < 40 and len(tokenizer.decode(trajectory.prompt_ids)) > 500


def test_bpe_training_is_deterministic_on_one_corpus():
    texts = ["<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n", '<tool_call>\n{"name": "python"}\n</tool_call>'] * 20
    first, second = (code_tool_demo.build_tokenizer(texts, vocab_size=300) for _ in range(2))
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_the_shipped_warm_start_is_a_weak_policy_that_is_right_when_it_calls_the_tool(shipped):
    from archon.build import build_model

    config, _, files, _ = shipped
    model = build_model(str(files.model_dir), lora=None).model
    tokenizer = code_tool_demo.hf_tokenizer(files.model_dir / code_tool_demo.TOKENIZER_FILE)
    rows = [json.loads(line) for line in files.held_out_path.read_text().splitlines()][:100]
    greedy = code_tool_demo.episode_success(model, "cpu", tokenizer, rows, config.environment)
    assert greedy["success"] <= 0.4, greedy
    # Sampled at temperature 1, pooled over three seeds (300 episodes): one seed's 100 episodes hold
    # about 25 tool calls, too few for a rate. Measured 2026-12-06 over seeds 0-5: 48-68% of the
    # episodes that call the tool are right per seed (pooled 60%), 23-34% call it.
    pooled = {"success": 0.0, "tool_calls": 0.0, "tool_success": 0.0}
    for seed in range(3):
        torch.manual_seed(seed)
        sampled = code_tool_demo.episode_success(model, "cpu", tokenizer, rows, config.environment, temperature=1.0)
        pooled = {key: pooled[key] + sampled[key] / 3 for key in pooled}
    assert 0.1 <= pooled["tool_calls"] <= 0.6, pooled
    assert pooled["tool_success"] >= 0.5 * pooled["tool_calls"], pooled  # the tool path is mostly right
    assert pooled["success"] - pooled["tool_success"] <= 0.05, pooled  # few are right without it


def test_a_short_run_calls_the_tool_more_and_is_rewarded_more(shipped, tmp_path, monkeypatch):
    """Six RL steps of the demo on one process: the tool-call rate and the reward rise, and episodes
    that called the sandbox were right."""
    from archon.rl.loop import RLRun
    from archon.rl.run import score as loop

    _, demo, files, _ = shipped
    seen = []

    def recording(task, examples, samples):
        scores = score_episodes(task, examples, samples)
        seen.extend((s.extra["trajectory"], float(r)) for s, r in zip(samples, scores.rewards))
        return scores

    score_episodes = loop.score_episodes
    monkeypatch.setattr(loop, "score_episodes", recording)
    config = parse_config(
        [
            "--config",
            str(CONFIG),
            "--model.path",
            str(files.model_dir),
            "--data.path",
            str(files.train_path),
            "--eval.every",
            "0",
            "--steps",
            "6",
            "--logging.run-dir",
            str(tmp_path / "run"),
            "--logging.no-progress",
            "--logging.backends",
        ]
    )
    RLRun(config).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 6
    first, last = steps[:2], steps[-2:]
    assert sum(r["tool_calls_mean"] for r in last) > sum(r["tool_calls_mean"] for r in first), steps
    assert sum(r["reward_mean"] for r in last) > sum(r["reward_mean"] for r in first), steps
    assert any(t.num_tool_calls > 0 and reward >= 1.0 for t, reward in seen)
