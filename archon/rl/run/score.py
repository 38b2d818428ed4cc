"""The score phase of an RL step: a task's rewards of its samples (its reward workers, or its
environments' rewards for multi-turn tasks), and the sample-table rows of scored samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from archon.rl.run.context import RunContext
from archon.rl.run.episodes import score_episodes
from archon.rl.run.step_metrics import Scores
from archon.rl.run.task import Task
from archon.rl.samples import merge_rank_rows, sample_rows
from archon.rollout.base import Sample


def score(ctx: RunContext, task: Task, examples, samples: list[Sample]) -> Scores:
    """Score: the task's rewards of the samples (its reward workers), whether each is correct,
    response lengths."""
    if task.episodes is not None:
        return score_episodes(task, examples, samples)
    completions = ctx.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    rows = [examples[s.prompt_index] for s in samples]
    scored = task.scorer.score_batch(
        [row.prompt for row in rows],
        completions,
        [row.reference for row in rows],
        [row.data_source for row in rows],
        [row.extra_info for row in rows],
        [s.prompt_index for s in samples],
    )
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
    return Scores(
        scored.rewards,
        (scored.rewards >= 1.0).float(),
        lengths,
        scored.metrics,
        scored.parts,
        reward_sums=scored.sums,
    )


def table_rows(ctx: RunContext, task: Task, examples, samples: list[Sample], scores: Scores | None) -> list[dict]:
    """The sample-table rows (archon.rl.samples) of the task's scored samples, whole groups of
    every data-parallel rank's, at most logging.samples_per_table rows (on every rank)."""
    limit = ctx.config.logging.samples_per_table
    rows = sample_rows(task.name, examples, samples, scores, ctx.tokenizer, task.version, limit, ctx.dp)
    per_rank = [rows]
    if ctx.dp > 1:
        per_rank = [None] * ctx.dp
        dist.all_gather_object(per_rank, rows, group=ctx.dims.dp_group)
    return merge_rank_rows(per_rank, limit)
