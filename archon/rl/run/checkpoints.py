"""A run's checkpoints: each task's resume checkpoint and PEFT adapter export at an RL step, and
loading them back when a run resumes.
"""

from __future__ import annotations

from pathlib import Path

from archon.checkpoint.resume import STEP_DIR
from archon.rl.model_card import model_card, task_export_dir
from archon.rl.run.context import RunContext
from archon.rl.run.run_dir import TASKS_DIR, prune_adapter_exports
from archon.rl.run.task import Task, resume_named_tasks


def save(ctx: RunContext, tasks: list[Task], step: int, guards: dict, final: bool = False) -> None:
    """Each task's resume checkpoint for RL step `step` (with the state of its fidelity guard, of
    `guards` by task name) and its PEFT adapter with its model card
    (README.md, archon.rl.model_card): TASK_DIR/adapter at the end, TASK_DIR/adapters/step_NNNNNN
    before it (the newest checkpoint.keep_last_adapters kept), where TASK_DIR is the run directory
    for a run without tasks and RUN_DIR/tasks/<name> for a named task.

    The data position saved is that of the last trained step: rollouts a producer made ahead
    are not saved, and a resumed run samples their prompts again (nothing lost, nothing trained
    twice)."""
    for task in tasks:
        state = {**task.state(), "fidelity": guards[task.name].state_dict()}
        ctx.trainer.save_checkpoint(task.checkpoints, step, state, task=task.name)
        out = task_export_dir(task, step, final)
        card = model_card(ctx, task, step, final) if ctx.rank == 0 else None
        ctx.trainer.export_peft(out, base_model_name_or_path=ctx.config.model.path, task=task.name, model_card=card)
        if not final and ctx.rank == 0:
            prune_adapter_exports(task.dir / "adapters", ctx.config.checkpoint.keep_last_adapters)


def load_checkpoints(ctx: RunContext, tasks: list[Task], resume_from: Path | None) -> int:
    """Load each task's checkpoint (a run without tasks: `resume_from`, the one prepare_run_dir
    chose; named tasks: each its own newest, or its checkpoint of `resume_from`'s step, and tasks
    without one, added now, start fresh). Returns the RL step to go on from."""
    config = ctx.config
    if config.tasks:
        step = None if resume_from is None else int(STEP_DIR.fullmatch(resume_from.name).group(1))
        return resume_named_tasks(tasks, ctx.trainer, ctx.run_dir / TASKS_DIR, config.steps, step)
    (task,) = tasks
    state = ctx.trainer.load_checkpoint(task.checkpoints, resume_from)
    first = state["step"]
    if first > config.steps:
        raise ValueError(
            f"--resume {resume_from}: the checkpoint is at step {first}, beyond this run's steps="
            f"{config.steps}; raise --steps to continue it"
        )
    task.load_state(state["data"], first)
    return first
