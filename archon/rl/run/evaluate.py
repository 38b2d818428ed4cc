"""The evaluate phase: each task's greedy accuracy on its held-out prompts."""

from __future__ import annotations

import torch

from archon.rl.run.context import RunContext
from archon.rl.run.score import score, table_rows
from archon.rl.run.task import Task
from archon.rollout.base import SamplingParams


def evaluate(ctx: RunContext, tasks: list[Task]) -> tuple[dict[str, float], list[dict]]:
    """Evaluate: the held-out accuracy of each task of `tasks` that has held-out prompts (metrics
    `<prefix>eval_accuracy`), and the evaluation's sample-table rows (with logging.samples_every)."""
    accuracies, rows = {}, []
    for task in tasks:
        if task.eval_set is not None:
            accuracies[task.prefix + "eval_accuracy"], task_rows = evaluate_task(ctx, task)
            rows += task_rows
    return accuracies, rows


def evaluate_task(ctx: RunContext, task: Task) -> tuple[float, list[dict]]:
    """The task's greedy accuracy on its held-out prompts (this rank's share; summed over ranks), and
    the sample-table rows of its samples."""
    examples = task.eval_set.examples[: ctx.config.eval.max_prompts][ctx.dp_rank :: ctx.dp]
    sampling = SamplingParams(max_new_tokens=ctx.eval_new_tokens, temperature=0, stop_token_ids=ctx.stop_token_ids)
    samples = ctx.generate(task, examples, sampling) if examples else []
    if not examples:  # keep the collectives of the generation in step with the other ranks
        ctx.generate(task, [task.eval_set.examples[0]], sampling)
    scores = score(ctx, task, examples, samples) if samples else None
    rewards = scores.rewards if scores is not None else torch.zeros(0)
    rows = table_rows(ctx, task, examples, samples, scores) if ctx.config.logging.samples_every else []
    correct, total = ctx.dp_sum(float((rewards >= 1.0).sum()), float(len(samples)))
    return correct / max(total, 1.0), rows
