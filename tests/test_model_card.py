"""The model card (README.md) of every exported adapter directory: huggingface_hub reads its front
matter, PEFT still loads the directory, and the card names the LoRA settings, the data, the
algorithm, the metrics of metrics.jsonl at its step and the command that ran."""

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import write_tiny_setup

from archon.lora.peft import ADAPTER_CARD
from archon.rl.config import parse_config
from archon.rl.logging import model_card
from archon.rl.loop import RLRun

COMMAND = ["recipes/grpo_lora.py", "--config", "my run.yaml", "--steps", "2"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step GRPO run with an adapter export after each step, started as COMMAND."""
    root = write_tiny_setup(tmp_path_factory.mktemp("card"))
    run_dir = root / "run"
    args = [
        "--model.path",
        str(root / "model"),
        "--data.path",
        str(root / "train.jsonl"),
        "--eval.path",
        str(root / "held_out.jsonl"),
        "--eval.every",
        "1",
        "--steps",
        "2",
        "--rollout.prompts-per-step",
        "4",
        "--rollout.group-size",
        "4",
        "--rollout.max-new-tokens",
        "4",
        "--reward.function",
        "reward_fixtures:digits_or_raise",
        "--reward.num-workers",
        "0",
        "--checkpoint.every",
        "1",
        "--checkpoint.keep-last-adapters",
        "2",
        "--optim.lr",
        "1e-2",
        "--logging.run-dir",
        str(run_dir),
        "--logging.no-progress",
        "--logging.backends",
        "--lora.rank",
        "4",
        "--lora.alpha",
        "8",
        "--lora.target-modules",
        "q_proj",
        "v_proj",
        "--lora.dropout",
        "0.05",
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", COMMAND)
        patch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        RLRun(parse_config(args)).run()
    return root


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reported(text: str, description: str) -> float:
    match = re.search(rf"^- {re.escape(description)}[^:\n]*: (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{description!r} not in the card"
    return float(match.group(1))


@pytest.mark.parametrize("adapter, step", [("adapter", 2), ("adapters/step_000001", 1)], ids=["final", "step-1"])
def test_every_adapter_directory_has_a_model_card(finished_run, adapter, step):
    from huggingface_hub import ModelCard
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = finished_run / "run" / adapter
    card = ModelCard.load(directory / ADAPTER_CARD)
    assert card.data.base_model == str(finished_run / "model")
    assert card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-generation"
    assert {"lora", "grpo"} <= set(card.data.tags)
    text = card.text
    assert "| rank (r) | `4` |" in text and "| alpha | `8.0` |" in text and "| dropout | `0.05` |" in text
    assert "| target modules | `q_proj`, `v_proj` |" in text
    assert f"training prompts: `{finished_run / 'train.jsonl'}`, 64 prompts" in text
    assert f"held-out prompts: `{finished_run / 'held_out.jsonl'}`, 8 prompts" in text
    assert "| algorithm | `grpo` |" in text and "| clip range | `[1 - 0.2, 1 + 0.2]` |" in text
    assert "```bash\n" + shlex.join(["python", *COMMAND]) + "\n```" in text
    assert "python recipes/grpo_lora.py --config 'my run.yaml' --steps 2" in text
    # the metrics of the step the adapter was saved at: metrics.jsonl's record of that step
    record = next(r for r in _records(finished_run / "run") if r["step"] == step)
    assert f"From `metrics.jsonl`, RL step {step}:" in text
    for key, description in model_card.RESULT_METRICS[:3]:
        assert _reported(text, description) == pytest.approx(record[key], rel=1e-5, abs=1e-6)
    assert _reported(text, "held-out accuracy") == pytest.approx(record["eval_accuracy"], rel=1e-5, abs=1e-6)
    assert f"held-out accuracy (greedy, step {step})" in text
    # and PEFT still loads the directory
    hf = AutoModelForCausalLM.from_pretrained(finished_run / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(directory))
    assert any("lora_A" in name for name, _ in peft_model.named_parameters())


def test_the_final_card_reports_the_last_record(finished_run):
    from huggingface_hub import ModelCard

    last = _records(finished_run / "run")[-1]
    text = ModelCard.load(finished_run / "run" / "adapter" / ADAPTER_CARD).text
    assert "the final adapter, after 2 of 2 RL steps" in text
    assert _reported(text, "mean reward") == pytest.approx(last["reward_mean"], rel=1e-5, abs=1e-6)
    assert _reported(text, "accuracy (reward >= 1)") == pytest.approx(last["accuracy"], rel=1e-5, abs=1e-6)


def test_the_command_is_torchruns_under_torchrun(monkeypatch):
    monkeypatch.setattr("sys.argv", ["recipes/grpo_lora.py", "--steps", "3"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    parent = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc_per_node", "2", "recipes/grpo_lora.py", "--steps", "3"]
    monkeypatch.setattr(model_card, "_parent_command", lambda: parent)
    assert model_card.launch_command() == "torchrun --nproc_per_node 2 recipes/grpo_lora.py --steps 3"
    # the parent is not torchrun's command (another launcher): rebuilt from torchrun's environment
    monkeypatch.setattr(model_card, "_parent_command", lambda: ["/sbin/init"])
    assert model_card.launch_command() == "torchrun --nproc_per_node=2 --nnodes=2 recipes/grpo_lora.py --steps 3"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert model_card.launch_command() == "python recipes/grpo_lora.py --steps 3"
