"""The demo's warm start: the weights shipped for the settings the demo and the tests use, and the
SFT that makes a warm start for any other settings (its stop rule, its output, the writer of the
shipped files)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from test_multi_lora_run import TWO_SKILL_SEED, two_skill_settings

from archon.demos import warm_start as demo_module
from archon.demos.warm_start import _split_development, packaged_warm_start, prepare_demo
from archon.recipes.grpo_lora import DEMO_CONFIG
from archon.rl.config import load_config_file
from archon.rl.tasks import ArithmeticTaskConfig


def _demo_config():
    return load_config_file(DEMO_CONFIG)


@pytest.mark.parametrize("which", ["demo", "two_skills"])
def test_the_demo_and_the_two_skill_test_start_from_shipped_weights(which, tmp_path):
    """A change to the demo's settings (or to the warm-start code's defaults) changes their digest;
    the shipped weights must then be written again (`python -m archon.demos.warm_start ...`)."""
    config = _demo_config()
    demo, seed = (config.demo, config.seed) if which == "demo" else (two_skill_settings(config.demo), TWO_SKILL_SEED)
    shipped = packaged_warm_start(demo, seed)
    assert shipped.exists(), f"no warm start is shipped for these settings ({shipped.name}): {demo}"
    messages = []
    demo = dataclasses.replace(demo, cache_dir=str(tmp_path))
    files = prepare_demo(demo, config.parallel, seed, rank=0, log=messages.append)
    assert any("shipped with archon" in m for m in messages) and not any("SFT" in m for m in messages)
    loaded, expected = load_file(files.model_dir / "model.safetensors"), load_file(shipped)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    # the model directory loads as a checkpoint, and a second call reuses the cache
    from archon.build import build_model

    build_model(str(files.model_dir), lora=None)
    assert prepare_demo(demo, config.parallel, seed, rank=0, log=messages.append) == files
    assert "using the cached warm start" in messages[-1]


def test_development_problems_are_the_first_of_each_operation_and_kept_out_of_training():
    rows = [{"prompt": str(i), "operation": "+-"[i % 3 == 0]} for i in range(20)]
    development, rest = _split_development(rows, per_operation=3)
    assert [r["prompt"] for r in development["-"]] == ["0", "3", "6"]
    assert [r["prompt"] for r in development["+"]] == ["1", "2", "4"]
    assert len(rest) == 14 and not {r["prompt"] for r in rest} & {r["prompt"] for d in development.values() for r in d}


def _tiny_settings(tmp_path, **overrides):
    """A 1-layer model on 1-digit addition: a warm start of seconds."""
    task = ArithmeticTaskConfig(operations=("+", "-"), min_digits=1, max_digits=1, num_train=150, num_held_out=20)
    settings = dict(
        task=task,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        sft_steps=60,
        sft_check_every=5,
        sft_dev_examples=8,
        sft_batch_size=16,
        cache_dir=str(tmp_path / "cache"),
    )
    return dataclasses.replace(_demo_config().demo, **{**settings, **overrides})


def test_the_sft_stops_once_every_operation_is_at_the_target_for_the_checks_in_a_row(tmp_path):
    config = _demo_config()
    messages = []
    # target 0: every check passes, so it stops at the third check
    demo = _tiny_settings(tmp_path, sft_target_accuracy=0.0, sft_checks_at_target=3)
    files = prepare_demo(demo, config.parallel, config.seed, rank=0, log=messages.append)
    checks = [m for m in messages if m.startswith("demo SFT step")]
    assert [m.split(":")[0] for m in checks] == [f"demo SFT step {s}/60" for s in (5, 10, 15)]
    assert all("greedy accuracy + " in m and ", - " in m for m in checks)  # each operation's own accuracy
    assert (files.model_dir / "config.json").exists()
    # an unreachable target: it runs to sft_steps
    messages.clear()
    prepare_demo(
        _tiny_settings(tmp_path, sft_target_accuracy=1.01), config.parallel, config.seed, rank=0, log=messages.append
    )
    assert [m for m in messages if m.startswith("demo SFT step")][-1].startswith("demo SFT step 60/60")
    # the rows name their operation, and the data files hold every problem
    rows = [json.loads(line) for line in files.train_path.read_text().splitlines()]
    assert len(rows) == 150 and {r["operation"] for r in rows} == {"+", "-"}


def test_the_writer_of_shipped_warm_starts_warm_starts_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_module, "PACKAGED_WARM_STARTS", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    demo_args = [
        "--task.operations",
        "+",
        "--task.min-digits",
        "1",
        "--task.max-digits",
        "1",
        "--task.num-train",
        "60",
        "--task.num-held-out",
        "10",
        "--hidden-size",
        "32",
        "--num-hidden-layers",
        "1",
        "--num-attention-heads",
        "2",
        "--num-key-value-heads",
        "1",
        "--intermediate-size",
        "64",
        "--sft-steps",
        "10",
        "--sft-check-every",
        "5",
        "--sft-dev-examples",
        "4",
        "--sft-batch-size",
        "8",
    ]
    args = [a.replace("--", "--demo.", 1) if a.startswith("--") else a for a in demo_args] + ["--seed", "3"]
    demo_module.main(args)
    written = list((tmp_path / "shipped").iterdir())
    assert len(written) == 1 and written[0].suffix == ".safetensors"
    first = load_file(written[0])
    written[0].write_bytes(b"stale")  # not reused: the writer warm-starts again
    demo_module.main(args)
    again = load_file(written[0])
    assert first.keys() == again.keys() and "model.embed_tokens.weight" in first
    settings = dataclasses.replace(
        _demo_config().demo,
        **{
            "task": ArithmeticTaskConfig(operations=("+",), min_digits=1, max_digits=1, num_train=60, num_held_out=10),
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "sft_steps": 10,
            "sft_check_every": 5,
            "sft_dev_examples": 4,
            "sft_batch_size": 8,
        },
    )
    assert written[0] == packaged_warm_start(settings, seed=3)  # the file prepare_demo looks for
