"""The GRPO-LoRA recipe end to end on a tiny model: in-process, and under torchrun with 2 processes."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from archon.lora import lora_parameters
from archon.rl.config import RLConfig, load_config_file, merge_into, parse_config
from archon.rl.tasks import (
    ArithmeticTaskConfig,
    arithmetic_splits,
    build_char_tokenizer,
    write_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
STEP_FIELDS = {
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "rollout_s",
    "train_s",
    "sync_s",
    "tokens_per_s",
    "entropy",
    "clip_fraction",
    "approx_kl",
    "reward_errors",
    "adapter_version",
    "grad_norm",
    "skipped_steps",
    "skipped_updates",
    "lr",
    "loss",
}


def write_tiny_setup(root: Path, hidden_size: int = 32, head_dim: int = 16) -> Path:
    """A tiny random Qwen3 with a character tokenizer in ROOT/model, and 2-digit addition data in
    ROOT/train.jsonl (64 prompts) and ROOT/held_out.jsonl (8)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        # vocabulary rounded up to even and 2 KV heads, so tensor parallelism over 2 ranks divides them
        vocab_size=len(tokenizer) + len(tokenizer) % 2,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=64, num_held_out=8))
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(held_out, root / "held_out.jsonl")
    return root


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = write_tiny_setup(tmp_path_factory.mktemp("grpo"))
    with open(root / "train.jsonl", "a") as f:  # one malformed row, counted and skipped
        f.write(json.dumps({"question": "no prompt field"}) + "\n")
    return root


def _args(root: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        "--model.path",
        str(root / "model"),
        "--data.path",
        str(root / "train.jsonl"),
        "--eval.path",
        str(root / "held_out.jsonl"),
        "--eval.every",
        "1",
        "--steps",
        str(steps),
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
    ]


def test_in_process_run_trains_only_the_adapter(tiny_setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from archon.checkpoint.hf import HFCheckpoint
    from archon.lora import is_lora_param
    from archon.rl.loop import RLRun

    config = parse_config(_args(tiny_setup, tmp_path / "run", steps=2))
    run = RLRun(config)
    train_set = run.tasks[0].train_set
    assert len(train_set.malformed) == 1 and "train.jsonl:65" in str(train_set.malformed[0])
    run.run()

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        assert STEP_FIELDS <= record.keys(), STEP_FIELDS - record.keys()
        assert "eval_accuracy" in record
    assert sum(r["reward_errors"] for r in records[1:]) > 0  # prompts starting with "1" raise
    assert records[-1]["adapter_version"] == 2

    checkpoint = HFCheckpoint(tiny_setup / "model")
    for name, tensor in run.trainer.model.state_dict().items():
        if not is_lora_param(name):
            hf_name = run.trainer.converter.hf_name(name)
            assert torch.equal(tensor, checkpoint.get(hf_name)), f"base weight {name} changed"
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())

    hf = AutoModelForCausalLM.from_pretrained(tiny_setup / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "run" / "adapter"))
    loaded = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert loaded == set(adapter)


def test_two_process_run_and_resume(tiny_setup, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"

    def torchrun(*extra):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "recipes" / "grpo_lora.py"),
            *extra,
        ]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        return result.stdout

    out = torchrun(*_args(tiny_setup, run_dir, steps=2), "--checkpoint.every", "1")
    assert "adapter (PEFT):" in out and "plot:" in out
    assert (run_dir / "curves.png").exists()
    first = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))

    out = torchrun(*_args(tiny_setup, run_dir, steps=3), "--resume")
    assert "resumed from step 2" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        assert STEP_FIELDS <= record.keys(), STEP_FIELDS - record.keys()
    after = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert first.keys() == after.keys()
    # the model card names torchrun's command line
    card = (run_dir / "adapter" / "README.md").read_text()
    assert "-m torch.distributed.run --standalone --nproc_per_node 2" in card and "--resume" in card
    assert any(not torch.equal(first[k], after[k]) for k in first)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_setup / "model", dtype=torch.float32), str(run_dir / "adapter")
    )
    loaded = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert loaded == set(after)


def test_tensor_parallel_run_generates_and_trains(tiny_setup, tmp_path):
    """Rollouts with the native engine on a model sharded over 2 ranks (vocabulary-parallel head)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "recipes" / "grpo_lora.py"),
        *_args(tiny_setup, run_dir, steps=2),
        "--parallel.tp",
        "2",
        "--parallel.dp-shard",
        "1",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["adapter_version"] == 2 and records[-1]["response_length"] > 0
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nrollout: {group_size: 4}\nalgorithm:\n  name: dapo\n")
    config = parse_config(["--config", str(path), "--rollout.group-size", "16"])
    assert config.steps == 7 and config.rollout.group_size == 16 and config.algorithm.name == "dapo"
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 5\n[lora]\nrank = 8\ntarget_modules = ['q_proj', 'v_proj']\n")
    config = load_config_file(toml)
    assert config.lora.rank == 8 and config.lora.target_modules == ("q_proj", "v_proj")
    path.write_text("rollout: {groupsize: 4}\n")
    with pytest.raises(ValueError, match=r"unknown config key 'rollout.groupsize'.*group_size"):
        load_config_file(path)
    with pytest.raises(ValueError, match="algorithm"):
        merge_into(RLConfig(), {"algorithm": {"name": "ppo2"}})
    assert load_config_file(REPO / "recipes" / "configs" / "qwen3_math.yaml").algorithm.dynamic_sampling
    assert load_config_file(REPO / "recipes" / "configs" / "demo.yaml").model.path is None


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# RL steps of 2 minibatches x 2 PPO epochs (4 updates each), a cosine schedule over the run.
MULTI_UPDATE = [
    "--algorithm.minibatches",
    "2",
    "--algorithm.ppo-epochs",
    "2",
    "--eval.every",
    "0",
    "--optim.schedule",
    "cosine",
    "--optim.warmup-steps",
    "1",
    "--optim.min-lr-ratio",
    "0.1",
]


class _Killed(Exception):
    pass


def test_resume_with_minibatches_and_epochs_matches_the_uninterrupted_run(tiny_setup, tmp_path, monkeypatch):
    """4 RL steps in one go; then 4 RL steps with a checkpoint every 2, killed in step 3 and resumed
    in a new RLRun: the same losses bit for bit, checkpoints and adapter versions in RL steps."""
    from archon.rl.loop import RLRun

    def args(run_dir, *extra):
        return parse_config([*_args(tiny_setup, run_dir, steps=4), *MULTI_UPDATE, "--checkpoint.every", "2", *extra])

    RLRun(args(tmp_path / "whole")).run()
    whole = _records(tmp_path / "whole")

    original_step = RLRun.step

    def step_then_kill(self, step):
        if step == 2:
            raise _Killed()
        return original_step(self, step)

    monkeypatch.setattr(RLRun, "step", step_then_kill)
    with pytest.raises(_Killed):
        RLRun(args(tmp_path / "split")).run()
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "split" / "checkpoints").iterdir()] == ["step-00000002"]
    state = json.loads((tmp_path / "split" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["optimizer_steps"] == 8
    resumed = RLRun(args(tmp_path / "split", "--resume"))
    assert resumed.config.optim.total_steps is None and resumed.trainer.config.optim.total_steps == 4
    resumed.run()
    split = _records(tmp_path / "split")
    assert [r["step"] for r in split] == [r["step"] for r in whole] == [1, 2, 3, 4]
    assert [r["loss"] for r in split] == [r["loss"] for r in whole]
    assert [r["lr"] for r in split] == [r["lr"] for r in whole]
    assert [r["adapter_version"] for r in split] == [1, 2, 3, 4]
    assert resumed.trainer.optimizer_steps == 16
    a = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "split" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_learning_rate_follows_the_schedule_in_rl_steps(tiny_setup, tmp_path, monkeypatch):
    """Every update of RL step s uses lr * lr_multiplier(s) of a schedule as long as the run."""
    from archon.optim import OptimConfig, lr_multiplier
    from archon.rl.loop import RLRun
    from archon.trainer import Trainer

    used: list[float] = []
    original = Trainer.optimizer_step

    def recording(self, loss=None, task=None):
        used.append(self.optimizer.param_groups[0]["lr"])
        return original(self, loss, task)

    monkeypatch.setattr(Trainer, "optimizer_step", recording)
    steps = 5
    RLRun(parse_config([*_args(tiny_setup, tmp_path / "run", steps=steps), *MULTI_UPDATE])).run()
    schedule = OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=1, min_lr_ratio=0.1, total_steps=steps)
    expected = [1e-2 * lr_multiplier(s, schedule) for s in range(steps)]
    assert used == pytest.approx([lr for lr in expected for _ in range(4)], rel=1e-12)
    assert expected[-1] > 1e-2 * 0.1 * 1.01  # the floor is reached only after the last step
    assert [r["lr"] for r in _records(tmp_path / "run")] == pytest.approx(expected, rel=1e-12)


def _nan_loss_at(run, bad_steps: set[int]):
    """Make the loss NaN during the given RL steps (1-based), through the loop's own loss function."""
    current = {"step": 0}
    (task,) = run.tasks
    loss_fn, step_fn = task.algorithm.loss, run.step

    def nan_loss(batch, logprobs, ctx):
        loss, metrics = loss_fn(batch, logprobs, ctx)
        return (loss * float("nan"), metrics) if current["step"] in bad_steps else (loss, metrics)

    def step(index):
        current["step"] = index + 1
        return step_fn(index)

    task.algorithm.loss, run.step = nan_loss, step


def test_nan_loss_step_is_skipped_counted_and_the_run_goes_on(tiny_setup, tmp_path):
    from archon.rl.loop import RLRun

    run_dir = tmp_path / "run"
    run = RLRun(
        parse_config(
            [
                *_args(tiny_setup, run_dir, steps=4),
                *MULTI_UPDATE,
                "--checkpoint.every",
                "1",
                "--checkpoint.keep-last-adapters",
                "2",
            ]
        )
    )
    _nan_loss_at(run, {2})
    states = []
    step_fn = run.step

    def snapshot():
        return {k: p.detach().clone() for k, p in lora_parameters(run.trainer.model).items()}, _optimizer_tensors(
            run.trainer
        )

    def snapshot_around(index):
        before = snapshot()
        metrics = step_fn(index)
        states.append((before, snapshot()))
        return metrics

    run.step = snapshot_around
    run.run()
    records = _records(run_dir)
    assert [r["skipped_updates"] for r in records] == [0, 4, 0, 0]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None  # NaN is written as null
    for index, ((lora_before, optim_before), (lora_after, optim_after)) in enumerate(states):
        unchanged = all(torch.equal(lora_before[k], lora_after[k]) for k in lora_before) and all(
            torch.equal(optim_before[k], optim_after[k]) for k in optim_before
        )
        assert unchanged == (index == 1), index
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in adapter.values())
    # adapter exports after steps 1-3, the newest 2 kept; checkpoints likewise
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    return {
        f"{i}/{key}": torch.as_tensor(value).clone()
        for i, state in enumerate(trainer.optimizer.state.values())
        for key, value in state.items()
    }


def test_nan_loss_steps_in_a_row_stop_the_run_naming_the_step(tiny_setup, tmp_path):
    from archon.rl.loop import RLRun
    from archon.trainer import NonFiniteError

    run_dir = tmp_path / "run"
    run = RLRun(
        parse_config(
            [
                *_args(tiny_setup, run_dir, steps=5),
                *MULTI_UPDATE,
                "--checkpoint.every",
                "1",
                "--algorithm.max-skipped-steps",
                "2",
            ]
        )
    )
    _nan_loss_at(run, {2, 3, 4})
    with pytest.raises(NonFiniteError, match=r"RL step 3: .* 2 RL steps in a row \(steps 2-3") as error:
        run.run()
    assert "lower optim.lr" in str(error.value) and "rewards" in str(error.value)
    assert [r["skipped_updates"] for r in _records(run_dir)] == [0, 4, 4]
    assert [r["skipped_steps"] for r in _records(run_dir)] == [0, 1, 2]
    # the checkpoints of the skipped steps hold the adapter of step 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_drgrpo_divides_by_max_new_tokens(tiny_setup, tmp_path):
    from archon.batch import PackedBatch
    from archon.rl.loop import RLRun
    from archon.trainer import LossContext

    run = RLRun(
        parse_config([*_args(tiny_setup, tmp_path / "run", steps=2), "--algorithm.name", "drgrpo", "--eval.every", "0"])
    )
    assert run.config.algorithm.loss.max_response_length is None
    algorithm = run.tasks[0].algorithm
    assert algorithm.max_response_length == 4  # rollout.max_new_tokens
    # Ratio 1, so each token's loss is -A; 3 and 1 response tokens, divided by 2 sequences * max_new_tokens.
    batch = PackedBatch.from_sequences([[1, 2, 3, 4], [5, 6, 7]], prompt_lens=[1, 2], advantages=[0.5, -2.0])
    assert batch.loss_mask.sum() == 4
    batch.old_logprobs = torch.zeros(batch.num_tokens)
    ctx = LossContext(global_tokens=torch.tensor(5.0), global_sequences=torch.tensor(2.0))
    loss, _ = algorithm.loss(batch, torch.zeros(batch.num_tokens), ctx)
    assert loss.item() == pytest.approx(-(3 * 0.5 + 1 * -2.0) / (2 * 4))
    run.run()
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and all(r["skipped_steps"] == 0 for r in records)


def test_a_reward_function_failing_on_every_sample_stops_the_run(tiny_setup, tmp_path):
    from archon.rl.loop import RLRun
    from archon.rl.task import RewardFunctionError

    args = [
        *_args(tiny_setup, tmp_path / "run", steps=5),
        "--reward.function",
        "reward_fixtures:always_raise",
        "--reward.max-failed-steps",
        "2",
        "--eval.every",
        "0",
    ]
    with pytest.raises(
        RewardFunctionError,
        match=r"RL step 2: .*'reward_fixtures:always_raise' failed on every "
        r"sample for 2 steps in a row",
    ) as error:
        RLRun(parse_config(args)).run()
    assert "Traceback (most recent call last)" in str(error.value)
    assert "reward_fixtures.py" in str(error.value) and "ZeroDivisionError: reward function that always fails" in (
        str(error.value)
    )
    assert [r["reward_errors"] for r in _records(tmp_path / "run")] == [16, 16]


SHORTENED_DEMO_STEPS = 60


def _shortened_demo_args(run_dir: Path, cache_dir: Path) -> list[str]:
    """The demo's own settings (recipes/configs/demo.yaml), cut to SHORTENED_DEMO_STEPS GRPO steps."""
    from archon.recipes import grpo_lora

    return [
        "--config",
        str(grpo_lora.DEMO_CONFIG),
        "--steps",
        str(SHORTENED_DEMO_STEPS),
        "--eval.every",
        str(SHORTENED_DEMO_STEPS),
        "--logging.run-dir",
        str(run_dir),
        "--demo.cache-dir",
        str(cache_dir),
        "--logging.no-progress",
        "--logging.backends",
        "--checkpoint.every",
        "0",
    ]


def _assert_held_out_accuracy_rose(run_dir: Path) -> tuple[float, float]:
    """The warm start stops at a target accuracy, but where exactly it lands depends on the
    arithmetic of the machine; the rise is what RL must deliver, at least 15 points held-out."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    (first_step, before), (last_step, after) = evals[0], evals[-1]
    assert (first_step, last_step) == (0, SHORTENED_DEMO_STEPS)
    print(f"held-out accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.15, evals
    return before, after


@pytest.mark.slow
def test_shortened_demo_improves_held_out_accuracy(tmp_path, demo_cache):
    from archon.recipes import grpo_lora

    grpo_lora.run(parse_config(_shortened_demo_args(tmp_path / "run", demo_cache[0])))
    _assert_held_out_accuracy_rose(tmp_path / "run")


@functools.cache  # one probe a capability: each starts a Python that imports torch
def _cpu_capability_under(capability: str) -> str:
    """The capability a process started with ATEN_CPU_CAPABILITY=`capability` computes with (the
    variable lowers it, never raises it above what the CPU offers)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    return subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _another_cpu_capability() -> str:
    """An ATEN_CPU_CAPABILITY other than the one this process computes with (which may itself be
    lowered by the variable): its kernels round differently, as another machine's would."""
    current = torch.backends.cpu.get_cpu_capability()
    for capability in ("avx2", "default", "avx512"):
        if capability.upper() != current and _cpu_capability_under(capability) == capability.upper():
            return capability
    pytest.skip(f"this CPU offers no arithmetic other than {current} to compare with")


@pytest.mark.slow
def test_shortened_demo_learns_under_another_cpu_arithmetic(tmp_path):
    """The whole shortened demo, warm start included, in a process whose kernels use another vector
    width: learning must not hinge on one machine's float arithmetic."""
    capability = _another_cpu_capability()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    used = _cpu_capability_under(capability)
    assert used == capability.upper() and used != torch.backends.cpu.get_cpu_capability()
    cmd = [sys.executable, str(REPO / "recipes" / "grpo_lora.py"), *_shortened_demo_args(tmp_path / "run", tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    _assert_held_out_accuracy_rose(tmp_path / "run")
