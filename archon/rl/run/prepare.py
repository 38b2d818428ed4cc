"""The prepare phase of an RL step: each task's advantages and batch filters, every task's kept
samples packed in one training batch, and the log-probs the losses need.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from archon.batch import PackedBatch
from archon.lora import lora_parameters
from archon.rl.run.batches import concat_batches, filler_batch, rollout_batch
from archon.rl.run.context import RunContext
from archon.rl.run.producer import Rollouts
from archon.rl.run.step_metrics import Prepared, RewardCounts, Scores
from archon.rl.run.task import Task
from archon.rl.run.teachers import distill_from_teachers
from archon.rollout.base import Sample
from archon.trainer import TASK_EXTRA


def prepare(
    ctx: RunContext, tasks: list[Task], collected: dict[str, Rollouts], scores: dict[str, Scores]
) -> tuple[PackedBatch, dict[str, Prepared], float]:
    """Prepare: each task's advantages and batch filters, every task's kept samples packed in one
    batch (`extras["task"]` in a multi-task run), and the log-probs the losses need: proximal
    policy and reference in one forward each, each sequence's teacher (its data source's) on it;
    and the seconds spent scoring with the trainer. A task whose reward function failed on every
    sample (on every rank) has nothing to learn from and takes no update this step."""
    parts: list[PackedBatch] = []
    sources: list[str] = []  # the data source of each sequence of the batch (its prompt's row's)
    prepared: dict[str, Prepared] = {}
    for task in tasks:
        prepared[task.name], kept, part = _shape(ctx, task, collected[task.name], scores[task.name])
        if part is not None:
            parts.append(part)
            examples = collected[task.name].examples
            sources += [examples[sample.prompt_index].data_source for sample in kept]
    batch = concat_batches(parts) if parts else filler_batch(ctx.multi_task, 0)
    trained = [task for task in tasks if prepared[task.name].trains]
    if not trained:
        return batch, prepared, 0.0
    score_start = time.perf_counter()
    _score_with_trainer(ctx, batch, trained)
    sequences = ctx.trainer.sequences_by_adapter(batch)
    for task in trained:
        of_task = _tokens_of(ctx, batch, [task])
        mine = batch.loss_mask & of_task
        prepared[task.name].gaps = _logprob_gaps(ctx, task, batch, mine)
        prepared[task.name].lag = batch.extras["version_lag"][mine].double()
        prepared[task.name].tokens = float(of_task.sum()) if parts else 0.0
        if not task.teachers or not parts or task.name not in sequences:
            continue
        mine = sequences[task.name]
        prepared[task.name].distill_gaps = distill_from_teachers(
            batch,
            mine,
            [task.teachers[sources[i]] for i in mine],
            [sources[i] for i in mine],
            task.algorithm,
            ctx.device,
            ctx.config.rollout.temperature,
        )
    return batch, prepared, time.perf_counter() - score_start


def _shape(
    ctx: RunContext, task: Task, rollouts: Rollouts, scores: Scores
) -> tuple[Prepared, list[Sample], PackedBatch | None]:
    """The task's shaped rewards, advantages and kept samples (its algorithm's), with its reward
    failures summed over the ranks once: whether it trains this step follows from them. Returns
    what prepare decided for the task, the samples it keeps, and their packed batch (None without
    any)."""
    counts = RewardCounts(
        *ctx.dp_sum(
            scores.reward_metrics["reward_errors"], scores.reward_metrics["reward_timeouts"], float(len(scores.rewards))
        )
    )
    shaped = task.algorithm.prepare(
        scores.rewards,
        scores.lengths,
        ctx.config.rollout.group_size,
        batch_sum=lambda totals: torch.tensor(ctx.dp_sum(*totals.tolist()), dtype=torch.float64),
    )
    rewards, advantages, keep = shaped.rewards, shaped.advantages, shaped.keep
    extremes = {
        "reward_abs_max": ctx.dp_max(float(rewards.abs().max()) if rewards.numel() else 0.0),
        "advantage_abs_max": ctx.dp_max(float(advantages.abs().max()) if advantages.numel() else 0.0),
    }
    prepared = Prepared(rewards, keep, counts, extremes=extremes)
    kept = [sample for sample, k in zip(rollouts.samples, keep.tolist()) if k] if prepared.trains else []
    if not kept:
        return prepared, kept, None
    part = rollout_batch(
        kept,
        advantages[keep],
        trainer_version=task.version,
        routed_experts=task.config.algorithm.routing_replay == "rollout",
    )
    if ctx.multi_task:
        part.extras[TASK_EXTRA] = torch.full((part.num_tokens,), task.index, dtype=torch.long)
    return prepared, kept, part


def _score_with_trainer(ctx: RunContext, batch: PackedBatch, trained: list[Task]) -> None:
    """The batch's proximal-policy log-probs (the rollout's, or the trainer's where a task's
    algorithm recomputes them) and, where a task's loss needs it, the reference's (the base)."""
    temperature = ctx.config.rollout.temperature
    recompute = [task for task in trained if task.config.algorithm.recompute_old_logprobs]
    batch.old_logprobs = batch.rollout_logprobs.clone()
    if recompute:
        scored = ctx.trainer.logprobs(batch, temperature).logprobs
        batch.old_logprobs = torch.where(_tokens_of(ctx, batch, recompute), scored, batch.old_logprobs)
    if any(task.algorithm.needs_reference for task in trained):
        batch.ref_logprobs = ctx.trainer.logprobs(batch, temperature, use_adapter=False).logprobs


def _tokens_of(ctx: RunContext, batch: PackedBatch, tasks: list[Task]) -> torch.Tensor:
    """[T] bool: the batch's tokens of `tasks`."""
    if not ctx.multi_task:
        return (
            torch.ones(batch.num_tokens, dtype=torch.bool) if tasks else torch.zeros(batch.num_tokens, dtype=torch.bool)
        )
    return torch.isin(batch.extras[TASK_EXTRA], torch.tensor([task.index for task in tasks]))


def _logprob_gaps(ctx: RunContext, task: Task, batch: PackedBatch, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|trainer - rollout| log-prob gap over the task's completion tokens, split in two when
    samples lag the trainer: `numerics`, the gap to the trainer's log-probs under the very adapter
    version that sampled (kernels, precision, batching), and `lag`, the part due to the adapter
    having moved on since. Without lag (or without the version-gap measurement) all of it is
    numerics. `mask`: [T] bool, the task's loss tokens."""
    total = (batch.old_logprobs - batch.rollout_logprobs).abs()
    gaps = {"total": total[mask], "numerics": total[mask], "lag": torch.zeros(int(mask.sum()))}
    if task.adapter_history is None:  # synchronous, or the measurement is off
        return gaps
    lags = _lags_present(ctx, task, batch, mask)
    if not lags:
        return gaps
    at_sampling = batch.old_logprobs.clone()
    with ctx.view(task):
        params = lora_parameters(ctx.trainer.model)
    for lag in lags:
        with task.adapter_history.swapped_in(params, task.version - lag):
            scored = ctx.trainer.logprobs(batch, ctx.config.rollout.temperature).logprobs
        at_sampling = torch.where(batch.extras["version_lag"] == lag, scored, at_sampling)
    gaps["numerics"] = (at_sampling - batch.rollout_logprobs).abs()[mask]
    gaps["lag"] = (batch.old_logprobs - at_sampling).abs()[mask]
    return gaps


def _lags_present(ctx: RunContext, task: Task, batch: PackedBatch, mask: torch.Tensor) -> list[int]:
    """The version lags > 0 of the task's tokens present on any data-parallel rank (so that every
    rank runs the same forwards), of versions the adapter history still holds."""
    present = torch.zeros(task.config.max_staleness + 1, dtype=torch.float64)
    lags = batch.extras["version_lag"][mask].unique()
    present[lags[(lags > 0) & (lags < present.numel())]] = 1.0
    anywhere = ctx.dp_sum(*present.tolist(), op=dist.ReduceOp.MAX)
    return [lag for lag in range(1, len(anywhere)) if anywhere[lag] > 0 and task.version - lag in task.adapter_history]
