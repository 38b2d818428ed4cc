"""Multi-LoRA RL runs: the config's task list, the mixed-batch loop, per-task outputs and metrics,
isolation of a failing task, adding/removing a task at a checkpoint boundary, and the 2-task
learning test on a demo base warm-started on addition and subtraction."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_reporting
from test_bad_input_resume import snapshot
from test_checkpoint_faults import _run_until_killed
from test_grpo_recipe import write_tiny_setup

from archon.lora.peft import ADAPTER_CONFIG
from archon.rl.config import load_config_file, parse_config, validate
from archon.rl.loop import RLRun
from archon.rl.run_dir import LOCK_FILE, RunDirInUseError
from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

# Layout runs against one process, both in float64 (tests/multi_task_worker.py): what is left is
# float64 rounding, orders of magnitude below this.
FLOAT64_TOL = 1e-10

VARYING_REWARD = """
def reward(prompt, completion, reference):
    # differs between any two different completions of a group almost surely (a count of one
    # character is 0 in most groups of a tiny random model), so every group has something to learn
    return sum(map(ord, completion)) % 17 / 16
"""
FAILING_REWARD = """
def reward(prompt, completion, reference):
    raise RuntimeError("this reward function always fails")
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_tiny_setup(tmp_path_factory.mktemp("multi_run"))
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("-",), num_train=64, num_held_out=8))
    write_jsonl(train, root / "sub_train.jsonl")
    write_jsonl(held_out, root / "sub_held_out.jsonl")
    return root


def _task_yaml(name, data, held_out, reward="exact", rank=4, lr=1e-2):
    return (
        f"  - name: {name}\n    data: {{path: {data}}}\n    eval_path: {held_out}\n"
        f"    reward: {{function: '{reward}', num_workers: 0, max_failed_steps: 1}}\n"
        f"    lora: {{rank: {rank}, alpha: {2 * rank}}}\n    optim: {{lr: {lr}}}\n"
        "    algorithm: {name: grpo, minibatches: 2}\n"
    )


def _config_file(root: Path, run_dir: Path, steps: int, tasks: str) -> Path:
    path = run_dir.parent / f"{run_dir.name}_{steps}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"steps: {steps}\nmodel: {{path: {root / 'model'}, device: cpu}}\n"
        "rollout: {group_size: 4, prompts_per_step: 4, max_new_tokens: 4}\n"
        f"eval: {{every: {steps}, max_prompts: 4}}\n"
        f"logging: {{run_dir: {run_dir}, backends: [], progress: false}}\n"
        f"tasks:\n{tasks}"
    )
    return path


def _config(root: Path, run_dir: Path, steps: int, tasks: str, *extra: str):
    return parse_config(["--config", str(_config_file(root, run_dir, steps, tasks)), *extra])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_config_without_tasks_is_the_single_task_recipe():
    from archon.recipes.grpo_lora import DEMO_CONFIG

    assert load_config_file(DEMO_CONFIG).tasks == ()


def test_task_settings_are_checked_per_task(setup, tmp_path):
    bad = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl") + _task_yaml(
        "add", setup / "missing.jsonl", setup / "held_out.jsonl"
    )
    bad += _task_yaml("third", setup / "train.jsonl", setup / "held_out.jsonl")
    with pytest.raises(ValueError) as e:
        _config(
            setup,
            tmp_path / "run",
            1,
            bad,
            "--rollout.engine",
            "vllm",
            "--rollout.vllm.mode",
            "merged",
            "--rollout.vllm.transport",
            "collective",
            "--rollout.max-staleness",
            "1",
        )
    message = str(e.value)
    assert "tasks[1].name='add': task names must be unique" in message
    assert "tasks[1].data.path=" in message and "no such file" in message
    assert "rollout.vllm.max_loras=2: the servers serve every task's adapter at once" in message
    assert "rollout.vllm.mode='merged': merged weights serve one adapter, not one per task" in message
    assert "rollout.max_staleness=1: with tasks, each task has its own bound" in message
    asynchronous = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl") + "    max_staleness: 1\n"
    native_async = "tasks\\[0\\].max_staleness=1: with rollout.engine='native' asynchronous rollouts run on one process"
    with pytest.raises(ValueError, match=native_async):
        _config(setup, tmp_path / "run", 1, asynchronous)


@pytest.mark.parametrize(
    "name",
    ["a" * 101, "a" * 300, "", "a/b", "..", "a\0b"],
    ids=["101-chars", "300-chars", "empty", "slash", "dotdot", "nul"],
)
def test_a_task_name_that_cannot_name_its_directory_is_refused(setup, tmp_path, name):
    """A task's name names RUN_DIR/tasks/<name> and its served adapters: a name that cannot is
    refused when the config is read, naming the field, not at the run's first save."""
    config = _config(setup, tmp_path / "run", 1, _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl"))
    renamed = dataclasses.replace(config, tasks=(dataclasses.replace(config.tasks[0], name=name),))
    with pytest.raises(ValueError, match=re.escape(f"tasks[0].name={name!r}")):
        validate(renamed)
    validate(dataclasses.replace(config, tasks=(dataclasses.replace(config.tasks[0], name="a" * 100),)))


def test_two_tasks_train_in_one_run_with_their_own_outputs(setup, tmp_path, importable_module):
    """add + sub train together; a third task whose reward always fails is stopped alone."""
    failing = importable_module("multi_failing_reward", FAILING_REWARD) + ":reward"
    tasks = (
        _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl")
        + _task_yaml("sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", rank=2, lr=5e-3)
        + _task_yaml("broken", setup / "train.jsonl", setup / "held_out.jsonl", reward=failing)
    )
    run_dir = tmp_path / "run"
    config = _config(setup, run_dir, 2, tasks, "--checkpoint.every", "1")
    RLRun(config).run()
    records = _records(run_dir)
    steps = {r["step"]: r for r in records}
    for name in ("add", "sub"):
        assert steps[2][f"{name}/adapter_version"] == 2.0
        assert steps[1][f"{name}/lr"] == (1e-2 if name == "add" else 5e-3)
        assert f"{name}/eval_accuracy" in steps[0] and f"{name}/eval_accuracy" in steps[2]
        assert f"{name}/loss" in steps[1] and f"{name}/reward_mean" in steps[1]
        # every metric the task's loss reports, as the single-task recipe logs them
        assert {f"{name}/{key}" for key in ("policy_loss", "clip_fraction", "approx_kl", "entropy")} <= steps[1].keys()
        out = run_dir / "tasks" / name
        adapter = json.loads((out / "adapter" / ADAPTER_CONFIG).read_text())
        assert adapter["r"] == (4 if name == "add" else 2)
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
        assert [p.name for p in (out / "adapters").iterdir()] == ["step_000001"]
    # the broken task failed on step 1 (max_failed_steps=1), was stopped, and never trained
    assert steps[1]["broken/reward_errors"] == 16 and steps[1].get("broken/stopped") == 1.0
    assert "broken/loss" not in steps[1] and "broken/reward_mean" not in steps[2]
    assert not (run_dir / "tasks" / "broken" / "adapter").exists()
    assert steps[2]["active_tasks"] == 2.0
    assert json.loads((run_dir / "tasks" / "broken" / "stopped.json").read_text())["step"] == 1
    # resumed, the stopped task stays stopped and the others go on
    RLRun(_config(setup, run_dir, 3, tasks, "--checkpoint.every", "1", "--resume")).run()
    step3 = {r["step"]: r for r in _records(run_dir)}[3]
    assert step3["active_tasks"] == 2.0 and "broken/reward_errors" not in step3
    assert step3["add/adapter_version"] == 3.0


def test_a_damaged_stopped_record_is_named_and_nothing_is_lost(setup, tmp_path):
    """tasks/<name>/stopped.json cut short, or not a record: the resume is refused naming the file,
    and the run directory is left as it was."""
    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl")
    run_dir = tmp_path / "run"
    RLRun(_config(setup, run_dir, 1, tasks, "--eval.every", "0")).run()
    stopped = run_dir / "tasks" / "add" / "stopped.json"
    for content, problem in (('{"step": 1, "reason": "the rew', "cannot be read"), ('["add"]', "not a record")):
        stopped.write_text(content)
        before = snapshot(run_dir)
        with pytest.raises(ValueError, match=re.escape(f"{stopped} ") + f".*{problem}"):
            RLRun(_config(setup, run_dir, 2, tasks, "--eval.every", "0", "--resume")).run()
        assert snapshot(run_dir) == before


def test_a_multi_task_run_through_the_recipe_ends_normally_with_its_plot(setup, tmp_path, capsys):
    """The recipe runs a config with tasks to its end: it returns, and its plot draws each task's
    curves from the task-prefixed metrics."""
    from archon.recipes.grpo_lora import main

    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl") + _task_yaml(
        "sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", rank=2
    )
    run_dir = tmp_path / "run"
    main(["--config", str(_config_file(setup, run_dir, 1, tasks))])
    out = capsys.readouterr().out
    assert f"plot: {run_dir / 'curves.png'}" in out
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{run_dir / 'tasks' / 'add' / 'adapter'}, {run_dir / 'tasks' / 'sub' / 'adapter'}" in out
    assert not (run_dir / LOCK_FILE).exists()


def test_a_task_killed_between_the_renames_of_a_resave_resumes_from_its_checkpoint(setup, tmp_path):
    """Task add's step-2 checkpoint is saved again over itself, and the process is killed after the
    old copy was moved aside and before the new one took its place. The next --resume puts the old
    copy back, and add goes on from it (its adapter version 3 at step 3), not from a fresh adapter."""
    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl") + _task_yaml(
        "sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", rank=2
    )
    run_dir = tmp_path / "run"
    RLRun(_config(setup, run_dir, 2, tasks, "--eval.every", "0")).run()
    checkpoints = run_dir / "tasks" / "add" / "checkpoints"
    saved = snapshot(checkpoints / "step-00000002")
    _run_until_killed(
        "resave",
        ".step-00000002.tmp",
        ["--config", str(_config_file(setup, run_dir, 2, tasks)), "--eval.every", "0", "--resume"],
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-00000002.old", ".step-00000002.tmp"]

    RLRun(_config(setup, run_dir, 3, tasks, "--eval.every", "0", "--resume")).run()
    step3 = {r["step"]: r for r in _records(run_dir)}[3]
    assert step3["add/adapter_version"] == 3.0 and step3["sub/adapter_version"] == 3.0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000003"]
    assert snapshot(checkpoints / "step-00000002") == saved


def test_a_multi_task_run_holds_its_directory_until_it_ends(setup, tmp_path):
    """A second run on the directory, new or resumed, fails at once while the first holds it."""
    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl")
    run_dir = tmp_path / "run"
    run = RLRun(_config(setup, run_dir, 1, tasks, "--eval.every", "0"))
    for extra in ((), ("--resume",)):
        with pytest.raises(RunDirInUseError, match=f"run directory {run_dir} is in use by process {os.getpid()} "):
            RLRun(_config(setup, run_dir, 1, tasks, "--eval.every", "0", *extra))
    run.run()
    assert not (run_dir / LOCK_FILE).exists()
    RLRun(_config(setup, run_dir, 2, tasks, "--eval.every", "0", "--resume")).run()
    assert [r["step"] for r in _records(run_dir)] == [1, 2]


def test_a_model_with_several_eos_ids_stops_on_each_of_them(setup, tmp_path):
    """A model config with a list of EOS ids (as Llama 3's): every one of them ends a rollout, as in
    the single-task recipe."""
    import shutil

    root = tmp_path / "setup"
    shutil.copytree(setup / "model", root / "model")
    config_file = root / "model" / "config.json"
    hf_config = json.loads(config_file.read_text())
    hf_config["eos_token_id"] = [hf_config["eos_token_id"], 5]
    config_file.write_text(json.dumps(hf_config))
    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl")
    run = RLRun(_config(root, tmp_path / "run", 1, tasks))
    try:
        assert set(hf_config["eos_token_id"]) <= set(run.stop_token_ids)
    finally:
        run.close()


def test_a_task_is_added_and_one_removed_at_a_checkpoint_boundary(setup, tmp_path, importable_module):
    """Run add + sub for 2 steps; resume with sub + mul (add removed, mul added): sub continues
    with exactly the state it had (its uninterrupted run's losses, though it moved from second to
    first place in the list), mul starts fresh."""
    varying = importable_module("multi_varying_reward", VARYING_REWARD) + ":reward"
    add = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl", reward=varying)
    sub = _task_yaml("sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", reward=varying, rank=2, lr=5e-3)
    mul = _task_yaml("mul", setup / "train.jsonl", setup / "held_out.jsonl", reward=varying, rank=8)
    uninterrupted = tmp_path / "uninterrupted"
    RLRun(_config(setup, uninterrupted, 3, add + sub, "--eval.every", "0", "--seed", "1")).run()

    run_dir = tmp_path / "run"
    RLRun(_config(setup, run_dir, 2, add + sub, "--eval.every", "0", "--seed", "1")).run()
    add_adapter = (run_dir / "tasks" / "add" / "adapter" / "adapter_model.safetensors").read_bytes()
    RLRun(_config(setup, run_dir, 3, sub + mul, "--eval.every", "0", "--seed", "1", "--resume")).run()
    steps = {r["step"]: r for r in _records(run_dir)}
    expected = {r["step"]: r for r in _records(uninterrupted)}
    assert steps[3]["sub/loss"] == expected[3]["sub/loss"] and steps[3]["sub/grad_norm"] > 0
    assert steps[3]["sub/adapter_version"] == 3.0 and steps[3]["mul/adapter_version"] == 1.0
    assert "add/loss" not in steps[3]
    # the removed task's outputs are left as they were
    assert (run_dir / "tasks" / "add" / "adapter" / "adapter_model.safetensors").read_bytes() == add_adapter


TWO_SKILL_HELD_OUT = 600  # about 300 a skill: the greedy accuracy is then known to about 3 points


TWO_SKILL_SEED = 0


def two_skill_settings(demo):
    """The two-skill base's warm-start settings (with TWO_SKILL_SEED): the demo's model and SFT on
    addition and subtraction, with a larger held-out split."""
    task = dataclasses.replace(demo.task, operations=("+", "-"), num_held_out=TWO_SKILL_HELD_OUT)
    return dataclasses.replace(demo, task=task, sft_target_accuracy=0.3, sft_checks_at_target=3)


@pytest.fixture(scope="module")
def two_skill_demo(tmp_path_factory):
    """The demo's warm start (recipes/configs/demo.yaml) taught 2-digit addition AND subtraction (the
    weights archon ships for these settings), and each skill's train and held-out prompts in files."""
    from archon.demos.warm_start import prepare_demo
    from archon.recipes.grpo_lora import DEMO_CONFIG

    root = tmp_path_factory.mktemp("two_skills")
    config = load_config_file(DEMO_CONFIG)
    demo = dataclasses.replace(two_skill_settings(config.demo), cache_dir=str(root / "cache"))
    files = prepare_demo(demo, config.parallel, TWO_SKILL_SEED, rank=0, log=lambda message: None)
    for split, path in (("train", files.train_path), ("held_out", files.held_out_path)):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for name, op in (("add", "+"), ("sub", "-")):
            write_jsonl([r for r in rows if r["operation"] == op], root / f"{name}_{split}.jsonl")
    return root, files.model_dir


def test_two_tasks_learn_two_skills_at_once_on_the_demo_base_on_two_ranks(two_skill_demo, tmp_path):
    """Addition and subtraction, each its own adapter, data and exact-match reward, trained together
    on two data-parallel ranks (FSDP; each rank samples and trains on half of every task's prompts):
    each task's greedy held-out accuracy rises by at least 15 points. (That the two-rank run trains
    as one process does is test_a_two_task_run_on_two_ranks_equals_the_one_process_run.)

    The base is the warm start archon ships for these settings, the same on every machine. Over 80
    steps at the demo's learning rate both skills rise by more than 20 points under every CPU
    arithmetic tried (README, "The demo"); subtraction (borrows, negative results) is the slower
    one, and at twice that learning rate its accuracy swings from update to update instead."""
    root, model_dir = two_skill_demo
    steps = 80
    tasks = "".join(
        f"  - name: {name}\n    data: {{path: {root / f'{name}_train.jsonl'}}}\n"
        f"    eval_path: {root / f'{name}_held_out.jsonl'}\n    reward: {{function: exact, num_workers: 0}}\n"
        "    lora: {rank: 16, alpha: 32.0}\n    algorithm: {name: grpo, minibatches: 2}\n"
        "    optim: {lr: 0.002, max_grad_norm: 1.0, schedule: cosine, warmup_steps: 5, min_lr_ratio: 0.1}\n"
        for name in ("add", "sub")
    )
    config_path = tmp_path / "two_skills.yaml"
    config_path.write_text(
        f"steps: {steps}\nmodel: {{path: {model_dir}, device: cpu}}\n"
        "rollout: {group_size: 8, prompts_per_step: 32, max_new_tokens: 5}\n"
        f"eval: {{every: {steps}, max_prompts: {TWO_SKILL_HELD_OUT}}}\n"
        f"logging: {{run_dir: {tmp_path / 'run'}, backends: [], progress: false}}\ntasks:\n{tasks}"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(Path(__file__).resolve().parents[1] / "recipes" / "grpo_lora.py"),
        "--config",
        str(config_path),
    ]
    result = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    evals = {r["step"]: r for r in _records(tmp_path / "run") if "add/eval_accuracy" in r}
    for name in ("add", "sub"):
        before, after = evals[0][f"{name}/eval_accuracy"], evals[steps][f"{name}/eval_accuracy"]
        print(f"{name}: held-out accuracy {before:.3f} -> {after:.3f}")
        assert after >= before + 0.15, (name, before, after)


def test_each_task_has_its_own_teacher_and_kl_reference(setup, tmp_path, monkeypatch):
    """A distillation task (its own teacher) beside a GRPO task with a KL penalty (the base as
    reference): the teacher's per-token advantages reach only the distillation task's tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from archon.rl.run import loop

    torch.manual_seed(1)  # a teacher of the same architecture and vocabulary, other weights
    teacher = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(setup / "model"))
    teacher.save_pretrained(tmp_path / "teacher")
    distill = _task_yaml("distill", setup / "train.jsonl", setup / "held_out.jsonl").replace(
        "algorithm: {name: grpo, minibatches: 2}",
        f"algorithm: {{name: grpo, minibatches: 2, teacher_path: {tmp_path / 'teacher'}}}",
    )
    kl = _task_yaml("kl", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl").replace(
        "algorithm: {name: grpo,", "algorithm: {name: grpo, loss: {kl_coef: 0.1},"
    )
    seen = {}
    prepare = loop.RLRun.prepare

    def recording(self, tasks, collected, scores):
        batch, prepared, score_s = prepare(self, tasks, collected, scores)
        seen["batch"] = batch
        return batch, prepared, score_s

    monkeypatch.setattr(loop.RLRun, "prepare", recording)
    distill2 = distill.replace("name: distill", "name: distill2")
    run = RLRun(_config(setup, tmp_path / "run", 1, distill + kl + distill2, "--eval.every", "0"))
    tasks = {task.name: task for task in run.tasks}
    assert tasks["distill"].teacher is not None and tasks["kl"].teacher is None
    assert tasks["distill2"].teacher is tasks["distill"].teacher  # one copy of a shared teacher
    run.run()
    batch = seen["batch"]
    task = batch.extras["task"]
    assert batch.ref_logprobs is not None  # the KL task's reference, the base model
    mask = batch.loss_mask
    distill_adv, kl_adv = batch.advantages[(task == 0) & mask], batch.advantages[(task == 1) & mask]
    # the distillation task's advantages are per token, -(log pi_theta - log pi_teacher); the GRPO
    # task keeps one advantage per sequence (all zero here: exact-match rewards of a random model)
    assert distill_adv.abs().max() > 1e-3 and len(set(distill_adv.tolist())) > len(distill_adv) // 2
    assert torch.equal(kl_adv, torch.zeros_like(kl_adv))
    record = _records(tmp_path / "run")[-1]
    assert torch.isfinite(torch.tensor([record["distill/loss"], record["kl/loss"]])).all()


LAYOUTS = {"fsdp": (), "tp": ("--parallel.tp", "2"), "ep": ("--parallel.ep", "2"), "cp": ("--parallel.cp", "2")}


def _layout_job(setup: Path, run_dir: Path, rollouts: Path, mode: str, layout: tuple[str, ...] = ()) -> list[str]:
    """tests/multi_task_worker.py's arguments for the layout test's two-task run on the model and
    data of `setup`: `mode` "record" (one process, its rollouts saved to `rollouts`) or "replay" (on
    two ranks with the `layout` flags)."""
    # learning rates of a real run; both runs compute in float64 (multi_task_worker.py), so the
    # layouts' reordered sums leave float64 rounding only
    tasks = (
        _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl", reward="layout_reward:reward", lr=1e-3)
        + _task_yaml("sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", reward="exact", rank=2, lr=5e-4)
    ).replace("minibatches: 2", "minibatches: 1")
    config = _config_file(setup, run_dir, 2, tasks)
    return [mode, str(rollouts), "--config", str(config), "--eval.every", "0", "--model.dtype", "float64", *layout]


@pytest.fixture(scope="module")
def layout_runs(setup, tmp_path_factory) -> dict:
    """The layout test's runs: in one process, the run recorded on the dense model (whose rollouts
    the fsdp, tp and cp layouts replay) and on a tiny MoE model (4 experts, 2 a token, for ep), one
    after the other; then every layout's two-rank replay, in one torchrun launch. Returns {layout:
    (the one-process run directory, the two-rank one)}."""
    from helpers import tiny_char_checkpoint

    root = tmp_path_factory.mktemp("layouts")
    rewards = root / "rewards"
    rewards.mkdir()
    (rewards / "layout_reward.py").write_text(VARYING_REWARD)
    moe = root / "moe"  # the same data on the MoE model
    tiny_char_checkpoint("qwen3_moe", moe / "model", num_experts=4, num_experts_per_tok=2)
    for name in ("train.jsonl", "held_out.jsonl", "sub_train.jsonl", "sub_held_out.jsonl"):
        (moe / name).write_bytes((setup / name).read_bytes())
    data = {"dense": setup, "moe": moe}
    model_of = {layout: "moe" if layout == "ep" else "dense" for layout in LAYOUTS}
    worker = Path(__file__).with_name("multi_task_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(rewards), str(worker.parent)])}

    def run(launcher: list[str], jobs: list[list[str]]) -> None:
        args = [arg for index, job in enumerate(jobs) for arg in (["--then"] if index else []) + job]
        cmd = [sys.executable, *launcher, str(worker), *args]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600 * len(jobs))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    run([], [_layout_job(data[m], root / f"one-{m}", root / f"{m}.pkl", "record") for m in data])
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run(
        torchrun,
        [
            _layout_job(data[model_of[n]], root / f"two-{n}", root / f"{model_of[n]}.pkl", "replay", LAYOUTS[n])
            for n in LAYOUTS
        ],
    )
    return {n: (root / f"one-{model_of[n]}", root / f"two-{n}") for n in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_two_task_run_on_two_ranks_equals_the_one_process_run(layout_runs, layout):
    """Two tasks (their own LoRA ranks, learning rates and rewards) for two RL steps on two ranks,
    FSDP (each rank a share of every task's prompts), TP (both ranks the whole batch), CP (both ranks
    the whole batch, each half of every micro-batch's tokens) or, on a MoE model with LoRA on its
    experts, EP (each rank half of the experts and a share of the prompts):
    the per-task losses, gradient norms and final adapters equal the one-process run's. Both runs
    train on the same recorded rollouts (tests/multi_task_worker.py), the part of a step that
    depends on the layout by design."""
    from safetensors.torch import load_file

    runs = dict(zip(("one", "two"), layout_runs[layout]))
    one, two = ({r["step"]: r for r in _records(runs[name])} for name in ("one", "two"))
    for step in (1, 2):
        for key in ("loss", "grad_norm", "reward_mean", "groups_kept", "policy_loss"):
            for task in ("add", "sub"):
                assert_close_reporting(
                    two[step][f"{task}/{key}"],
                    one[step][f"{task}/{key}"],
                    FLOAT64_TOL,
                    f"{layout} step {step} {task}/{key}",
                )
    # the varying reward gives the add task something to learn (its first loss is 0 by construction:
    # one update of a policy equal to its old one, with advantages that sum to 0 in each group)
    assert one[1]["add/grad_norm"] > 1e-3, one[1]
    for task in ("add", "sub"):
        expected = load_file(str(runs["one"] / "tasks" / task / "adapter" / "adapter_model.safetensors"))
        got = load_file(str(runs["two"] / "tasks" / task / "adapter" / "adapter_model.safetensors"))
        assert expected.keys() == got.keys()
        for key in expected:
            assert got[key].dtype == torch.float64, f"{task} adapter {key}: {got[key].dtype}, not the run's float64"
            assert_close_reporting(got[key], expected[key], FLOAT64_TOL, f"{layout} {task} adapter {key}")


def test_a_multi_task_run_resumes_every_task_from_the_step_of_a_checkpoint_path(setup, tmp_path, importable_module):
    """--resume RUN_DIR/tasks/<name>/checkpoints/step-N: every task goes on from its own checkpoint
    of step N, with the metrics and adapters of the run that was not interrupted; each task's newer
    outputs are set aside, not deleted. A path that is not a checkpoint is refused, naming the form."""
    from safetensors.torch import load_file

    varying = importable_module("resume_path_reward", VARYING_REWARD) + ":reward"
    tasks = _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl", reward=varying) + _task_yaml(
        "sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", reward=varying, rank=2
    )
    run_dir = tmp_path / "run"
    # float64: the resumed steps must repeat the uninterrupted run's arithmetic, which no CPU can move
    keep = ("--eval.every", "0", "--checkpoint.every", "1", "--checkpoint.keep-last", "3", "--model.dtype", "float64")
    RLRun(_config(setup, run_dir, 3, tasks, *keep)).run()
    whole = {r["step"]: r for r in _records(run_dir)}
    adapters = {
        name: load_file(str(run_dir / "tasks" / name / "adapter" / "adapter_model.safetensors"))
        for name in ("add", "sub")
    }
    with pytest.raises(FileNotFoundError, match="step-NNNNNNNN"):
        RLRun(_config(setup, run_dir, 3, tasks, "--eval.every", "0", "--resume", str(run_dir / "tasks"))).run()
    step_1 = run_dir / "tasks" / "sub" / "checkpoints" / "step-00000001"
    RLRun(_config(setup, run_dir, 3, tasks, *keep, "--resume", str(step_1))).run()
    resumed = {r["step"]: r for r in _records(run_dir)}
    assert sorted(resumed) == [1, 2, 3]
    for step in (2, 3):
        for key in ("add/loss", "sub/loss", "add/reward_mean", "sub/grad_norm"):
            assert resumed[step][key] == pytest.approx(whole[step][key], abs=FLOAT64_TOL), (step, key)
    for name in ("add", "sub"):
        task_dir = run_dir / "tasks" / name
        set_aside = task_dir / "superseded" / "after-step-00000001-0"
        assert sorted(p.name for p in (set_aside / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
        got = load_file(str(task_dir / "adapter" / "adapter_model.safetensors"))
        for key, value in adapters[name].items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)
