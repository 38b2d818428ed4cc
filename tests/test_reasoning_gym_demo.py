"""The reasoning-gym demo (recipes/configs/reasoning_gym_demo.yaml): its settings validate, its shipped
warm start loads under the digest its settings give, the warm start's problems are rendered as the run
renders the task's prompts and answered as the task's own scorer reads answers, and settings that do
not fit the warm start are refused."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from archon.demos.warm_start import packaged_warm_start, prepare_demo
from archon.rl.config import load_config_file, parse_config
from archon.rl.data import load_prompt_dataset, tokenize_prompt
from archon.rl.reasoning_gym import reasoning_gym_reward
from archon.rl.reasoning_gym_demo import ReasoningGymDemoConfig, sft_rows
from archon.rl.tasks import build_char_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "recipes" / "configs" / "reasoning_gym_demo.yaml"


def _config():
    return load_config_file(CONFIG)


def test_the_demo_starts_from_its_shipped_warm_start(tmp_path):
    """A change to the demo's settings changes their digest; the shipped weights must then be written
    again (`python -m archon.demos.warm_start --config recipes/configs/reasoning_gym_demo.yaml`)."""
    config = _config()
    assert config.model.path is None and config.demo.kind == "reasoning_gym"
    shipped = packaged_warm_start(config.demo, config.seed)
    assert shipped.exists(), f"no warm start is shipped for these settings ({shipped.name}): {config.demo}"
    messages = []
    demo = dataclasses.replace(config.demo, cache_dir=str(tmp_path))
    files = prepare_demo(demo, config.parallel, config.seed, rank=0, log=messages.append)
    assert any("shipped with archon" in m for m in messages) and not any("SFT" in m for m in messages)
    loaded, expected = load_file(files.model_dir / "model.safetensors"), load_file(shipped)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    from archon.build import build_model

    build_model(str(files.model_dir), lora=None)
    # the other kinds' settings are not part of its digest, nor is the cache directory
    other = dataclasses.replace(demo, task=dataclasses.replace(demo.task, num_train=7), cache_dir=str(tmp_path / "x"))
    assert packaged_warm_start(other, config.seed) == shipped
    problems = dataclasses.replace(demo.reasoning_gym, system_prompt="Answer.")
    assert packaged_warm_start(dataclasses.replace(demo, reasoning_gym=problems), config.seed) != shipped


def test_the_demo_config_validates_and_evaluates_on_the_held_out_problems():
    config = parse_config(["--config", str(CONFIG)])
    assert config.reward.function == "reasoning_gym"
    assert config.data.path.startswith("reasoning_gym:spell_backward?")
    assert config.eval.path is None  # the recipe uses demo.reasoning_gym.held_out
    from archon.recipes.grpo_lora import _with_reasoning_gym_demo_data

    run = _with_reasoning_gym_demo_data(config)
    assert run.eval.path == config.demo.reasoning_gym.held_out
    assert run.data.system_prompt == config.demo.reasoning_gym.system_prompt


def _small_problems() -> ReasoningGymDemoConfig:
    return ReasoningGymDemoConfig(
        sft_data="reasoning_gym:spell_backward?size=300&seed=50&min_word_len=3&max_word_len=4",
        held_out="reasoning_gym:spell_backward?size=100&seed=1000&min_word_len=3&max_word_len=4",
    )


def test_warm_start_problems_are_the_runs_prompts_answered_as_the_scorer_reads_them():
    problems = _small_problems()
    tokenizer = build_char_tokenizer()
    train, held_out, left_out = sft_rows(problems, tokenizer)
    # 3- and 4-letter words are few enough that some training problems ask a held-out question
    assert left_out > 0 and len(train) == 300 - left_out and len(held_out) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    # the run's data source renders the same prompt ids for the same entries
    data = dataclasses.replace(_config().data, path=problems.held_out, system_prompt=problems.system_prompt)
    dataset = load_prompt_dataset(data, tokenizer)
    assert dataset.chat_template_applied and [r["prompt"] for r in held_out] == [e.prompt for e in dataset.examples]
    assert [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in held_out] == [
        tokenize_prompt(tokenizer, e.prompt, dataset.chat_template_applied) for e in dataset.examples
    ]
    # reasoning-gym's scorer (through archon's reward) gives the warm start's answers full marks
    for row, example in zip(held_out[:20], dataset.examples):
        assert reasoning_gym_reward(example.prompt, row["answer"], example.reference) == 1.0
        assert reasoning_gym_reward(example.prompt, row["answer"][::-1], example.reference) < 1.0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data.path", "reasoning_gym:chain_sum?size=100"], "trains on the problems it was warm-started on"),
        (["--data.path", "reasoning_gym:spell_backward?size=100&max_word_len=8"], "of the task and settings"),
        (
            ["--eval.path", "reasoning_gym:spell_backward?size=50&seed=9&min_word_len=3&max_word_len=6"],
            "leave eval.path unset",
        ),
        (["--data.system-prompt", "Be brief."], "leave data.system_prompt unset"),
        (["--demo.reasoning-gym.held-out", "reasoning_gym:spell_backward?size=50&seed=9"], "only size and seed"),
        (["--demo.reasoning-gym.sft-data", "spell_backward"], "must be a reasoning_gym source"),
    ],
)
def test_settings_that_do_not_fit_the_warm_start_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--config", str(CONFIG), *flags])


@pytest.mark.slow
def test_two_steps_of_the_demo_from_its_shipped_warm_start(tmp_path, capsys):
    """The demo's own settings cut to 2 steps and a few prompts, in this process: the shipped warm
    start answers some held-out problems exactly and earns partial credit on the sampled ones."""
    import json

    from archon.recipes import grpo_lora

    args = [
        "--config",
        str(CONFIG),
        "--steps",
        "2",
        "--optim.warmup-steps",
        "0",
        "--rollout.prompts-per-step",
        "4",
        "--eval.every",
        "2",
        "--eval.max-prompts",
        "40",
        "--logging.run-dir",
        str(tmp_path / "run"),
        "--demo.cache-dir",
        str(tmp_path / "cache"),
        "--logging.no-progress",
        "--logging.no-tensorboard",
        "--checkpoint.every",
        "0",
    ]
    grpo_lora.run(parse_config(args))
    assert "using the warm start shipped with archon" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert len(evals) == 2 and evals[0] >= 0.1  # the warm start's 28% on all 200 held-out problems
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 2 and all(0.3 < r["reward_mean"] <= 1.0 and r["reward_errors"] == 0 for r in steps)
