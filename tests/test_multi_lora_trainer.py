"""Multi-LoRA trainer: per-task optimizers, schedules, isolation of failures, per-task checkpoints
(a task added or removed at a checkpoint boundary), and per-task PEFT exports that load alone.

A multi-task trainer and each task's single-adapter trainer (or PEFT) compute the same math: every
trainer here is float64 and runs inside `fp32_islands_in_fp64`, so what is left between them is
float64 rounding."""

import parallel_cases as cases
import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.batch import PackedBatch
from archon.checkpoint.resume import CheckpointError, CheckpointManager
from archon.lora import LoRAConfig, lora_parameters, task_parameters, task_view
from archon.trainer import TASK_EXTRA, OptimConfig, Trainer, TrainerConfig, TrainerTask

A = TrainerTask("add", LoRAConfig(rank=4, alpha=8.0), OptimConfig(lr=2e-2, max_grad_norm=0.5))
B = TrainerTask(
    "sub",
    LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj", "down_proj")),
    OptimConfig(lr=5e-3, schedule="linear", warmup_steps=1, total_steps=4),
)
C = TrainerTask("mul", LoRAConfig(rank=8, alpha=8.0), OptimConfig(lr=1e-2))
FP64_TOL = 1e-10
"""Absolute tolerance of losses, log-probs, logits and adapter values; the largest difference
measured is 4.2e-14 (an adapter after two AdamW steps; losses, log-probs and logits
within 5e-15)."""


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _config(path, tasks=None, lora=None, optim=None):
    return TrainerConfig(
        model_path=str(path),
        lora=lora,
        optim=optim or OptimConfig(),
        device="cpu",
        micro_batch_tokens=48,
        head_chunk_size=16,
        tasks=tuple(tasks or ()),
        dtype="float64",
    )


def _single(path, task):
    return Trainer(_config(path, lora=task.lora, optim=task.optim))


def _mixed(trainer, seed, task_of_sequence):
    """A batch of cases' sequences, sequence i of task task_of_sequence[i], with old log-probs."""
    batch = cases.make_batch(256, seed=seed)
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    batch.extras[TASK_EXTRA] = torch.repeat_interleave(torch.tensor(task_of_sequence), lengths)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    return batch


def _of_task(batch, index):
    chosen = [i for i, t in enumerate(batch.extras[TASK_EXTRA][batch.cu_seqlens[:-1]].tolist()) if t == index]
    sub = batch.select(chosen)
    del sub.extras[TASK_EXTRA]
    return sub


TASK_OF_SEQUENCE = [0, 1, 1, 0, 1, 0][: len(cases.SEQ_LENS)]


def test_each_task_trains_as_its_own_single_adapter_run(qwen3_path):
    """Two steps of a mixed batch == two steps of each task's single-adapter trainer on its own
    sequences: same per-task loss, learning rates (own schedule), and adapter."""
    multi = Trainer(_config(qwen3_path, tasks=[A, B]))
    singles = {task.name: _single(qwen3_path, task) for task in (A, B)}
    for step in range(2):
        batch = _mixed(multi, seed=step, task_of_sequence=TASK_OF_SEQUENCE)
        out = multi.train_step(batch, {"add": cases.loss_fn, "sub": cases.loss_fn}, with_entropy=True)
        for index, task in enumerate((A, B)):
            sub = _of_task(batch, index)
            expected = singles[task.name].train_step(sub, cases.loss_fn, with_entropy=True)
            got = out[task.name]
            assert got["lr"] == expected["lr"] and got["optimizer_steps"] == expected["optimizer_steps"] == step + 1
            assert got["tokens"] == expected["tokens"] and got["sequences"] == expected["sequences"]
            assert_close_reporting(got["loss"], expected["loss"], FP64_TOL, f"{task.name}, step {step}: loss")
    for task in (A, B):
        mine, theirs = task_parameters(multi.model, task.name), lora_parameters(singles[task.name].model)
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert_close_reporting(mine[name], theirs[name], FP64_TOL, f"{task.name}: {name} after two steps")
    assert multi.adapters["sub"].scheduler.get_last_lr() != multi.adapters["add"].scheduler.get_last_lr()


def test_a_non_finite_task_is_skipped_alone(qwen3_path):
    trainer = Trainer(_config(qwen3_path, tasks=[A, B]))
    before = {t: {n: p.clone() for n, p in task_parameters(trainer.model, t).items()} for t in ("add", "sub")}

    def nan_loss(batch, logprobs, ctx):
        loss, metrics = cases.loss_fn(batch, logprobs, ctx)
        return loss * float("nan"), metrics

    batch = _mixed(trainer, seed=0, task_of_sequence=TASK_OF_SEQUENCE)
    out = trainer.train_step(batch, {"add": nan_loss, "sub": cases.loss_fn}, with_entropy=True)
    assert out["add"]["skipped"] == 1.0 and out["sub"]["skipped"] == 0.0
    assert trainer.adapters["add"].steps == 0 and trainer.adapters["sub"].steps == 1
    add_now = task_parameters(trainer.model, "add")
    assert all(torch.equal(add_now[n], p) for n, p in before["add"].items())
    assert not trainer.adapters["add"].optimizer.state  # AdamW never stepped
    sub_now = task_parameters(trainer.model, "sub")
    assert any(not torch.equal(sub_now[n], p) for n, p in before["sub"].items())
    assert all(torch.isfinite(p).all() for p in sub_now.values())


def test_task_checkpoints_survive_adding_and_removing_tasks(qwen3_path, tmp_path):
    """Each task checkpoints into its own directory; a run with another task list (one removed, one
    added, order changed) resumes the kept task exactly and leaves the new one at its start."""
    trainer = Trainer(_config(qwen3_path, tasks=[A, B]))
    managers = {t: CheckpointManager(tmp_path / t / "checkpoints") for t in ("add", "sub")}
    for step in range(2):
        batch = _mixed(trainer, seed=step, task_of_sequence=TASK_OF_SEQUENCE)
        trainer.train_step(batch, {"add": cases.loss_fn, "sub": cases.loss_fn}, with_entropy=True)
    for task, manager in managers.items():
        trainer.save_checkpoint(manager, 2, data_state={"task": task}, task=task)

    resumed = Trainer(_config(qwen3_path, tasks=[C, B]))
    fresh_mul = {n: p.clone() for n, p in task_parameters(resumed.model, "mul").items()}
    state = resumed.load_checkpoint(managers["sub"], task="sub")
    assert state["step"] == 2 and state["data"] == {"task": "sub"}
    assert resumed.adapters["sub"].steps == 2
    assert resumed.adapters["sub"].scheduler.get_last_lr() == trainer.adapters["sub"].scheduler.get_last_lr()
    saved, loaded = task_parameters(trainer.model, "sub"), task_parameters(resumed.model, "sub")
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    now_mul = task_parameters(resumed.model, "mul")
    assert all(torch.equal(now_mul[n], p) for n, p in fresh_mul.items())
    # the next step of the kept task goes on exactly as in the uninterrupted run
    batch = _mixed(trainer, seed=5, task_of_sequence=[1] * len(cases.SEQ_LENS))
    expected = trainer.train_step(batch, {"sub": cases.loss_fn}, with_entropy=True)["sub"]["loss"]
    batch.extras[TASK_EXTRA] = torch.ones_like(batch.extras[TASK_EXTRA])  # "sub" is index 1 in both runs
    got = resumed.train_step(batch, {"sub": cases.loss_fn}, with_entropy=True)["sub"]["loss"]
    assert got == expected
    # a checkpoint of another LoRA config is refused, naming the task's setting that differs
    with pytest.raises(CheckpointError, match="rank"):
        resumed.load_checkpoint(managers["add"], task="mul")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_each_tasks_peft_export_loads_alone_in_peft(tiny_checkpoint, tmp_path, model_type):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from archon.tools.align import packed_batch

    path = tiny_checkpoint(model_type)
    trainer = Trainer(_config(path, tasks=[A, B]))
    g = torch.Generator().manual_seed(0)
    for task in ("add", "sub"):
        randomise_lora(task_parameters(trainer.model, task), 0.1, g)
    seqs, tokens, positions, cu = packed_batch((6, 11), 256, seed=0)
    outputs = {}
    for task in ("add", "sub"):
        out = trainer.export_peft(tmp_path / task, str(path), task=task)
        # HF's grouped-GEMM experts have no fp64 kernel; its eager experts loop over them
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
        with torch.no_grad():
            base = torch.cat([hf(s[None]).logits[0] for s in seqs])
            peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
            theirs = torch.cat([peft_model(s[None]).logits[0] for s in seqs])
            with task_view(trainer.model, task):
                ours = trainer.model.eval()(tokens, positions, cu, 11)
        assert_close_reporting(ours, theirs, FP64_TOL, f"{model_type}, task {task}: archon against PEFT logits")
        assert (theirs - base).abs().max() > 1e-3  # the adapter loaded, not silently nothing
        outputs[task] = theirs
    assert (outputs["add"] - outputs["sub"]).abs().max() > 1e-3


def test_multi_task_batch_without_task_ids_is_refused(qwen3_path):
    trainer = Trainer(_config(qwen3_path, tasks=[A, B]))
    batch = PackedBatch.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="extras\\['task'\\]"):
        trainer.logprobs(batch)
    with pytest.raises(ValueError, match="one loss function per task"):
        trainer.train_step(batch, cases.loss_fn)


def test_policy_and_reference_logprobs_of_a_mixed_batch(qwen3_path):
    """Policy log-probs: each sequence under its own task's adapter (as that task's single-adapter
    trainer scores it); reference (use_adapter=False): the base model, for every task (the KL
    reference)."""
    trainer = Trainer(_config(qwen3_path, tasks=[A, B]))
    g = torch.Generator().manual_seed(0)
    for task in ("add", "sub"):
        randomise_lora(task_parameters(trainer.model, task), 0.1, g)
    batch = _mixed(trainer, seed=3, task_of_sequence=TASK_OF_SEQUENCE)
    reference = trainer.logprobs(batch, use_adapter=False).logprobs
    plain = batch.select(list(range(batch.num_sequences)))
    del plain.extras[TASK_EXTRA]
    for index, task in enumerate((A, B)):
        single = _single(qwen3_path, task)
        with torch.no_grad():
            for name, p in lora_parameters(single.model).items():
                p.copy_(task_parameters(trainer.model, task.name)[name])
        mine = batch.extras[TASK_EXTRA] == index
        policy = single.logprobs(plain).logprobs[mine]
        assert_close_reporting(batch.old_logprobs[mine], policy, FP64_TOL, f"{task.name}: policy log-probs")
        base = single.logprobs(plain, use_adapter=False).logprobs
        assert_close_reporting(reference, base, FP64_TOL, f"{task.name}: reference log-probs")
        assert (batch.old_logprobs[mine] - reference[mine]).abs().max() > 1e-4
