"""The collect phase of an RL step: every active task's rollouts for the step, made now
(synchronously) or ahead by the task's producer (max_staleness >= 1, steps overlapping: see
.producer), with the staleness bound enforced, and shared with the ranks that do not generate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from archon.distributed import true_on_any_rank
from archon.rl.run.context import RunContext
from archon.rl.run.engines import RolloutLanes
from archon.rl.run.episodes import episode_samples
from archon.rl.run.producer import RolloutProducer, Rollouts
from archon.rl.run.task import Task
from archon.rl.run.versions import stale_groups
from archon.rollout.native import NativeRolloutEngine


def collect(ctx: RunContext, step: int, make: Callable[[], dict[str, Rollouts]]) -> dict[str, Rollouts]:
    """Collect: the step's rollouts of every active task, by task name. The ranks that generate make
    them (`make()`: own_rollouts of the active tasks) and send them to the ranks given the same data
    that do not. A failure on any rank stops every rank here, before the step's collectives."""
    rollouts, failure = None, None
    if ctx.generates_rollouts:
        try:
            rollouts = make()
        except Exception as error:  # raised below, once every rank knows
            failure = error
    failed = true_on_any_rank(failure is not None, ctx.device)  # over every rank: all generate or none
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(
            f"RL step {step + 1}: generating the rollouts failed on another rank (its log has the cause)"
        )
    if ctx.share_rollouts:
        shared = [rollouts]
        dist.broadcast_object_list(shared, group=ctx.dims.same_data_group, group_src=0)
        rollouts = shared[0]
    return rollouts


def own_rollouts(ctx: RunContext, tasks: list[Task], step: int) -> dict[str, Rollouts]:
    """This rank's rollouts of `tasks` for the step. Synchronously they are made now; with
    max_staleness N >= 1 the task's producer made them ahead, and any group sampled with a version
    older than the task's version - N is dropped and sampled again."""
    if ctx.native is not None and ctx.multi_task and all(t.episodes is None for t in tasks):
        return mixed_rollouts(ctx.native, tasks, ctx.prompt_ids, ctx.sampling, ctx.dp_rank, ctx.dp)
    collected = {}
    for task in tasks:
        if task.producer is None:
            rollouts = generate_rollouts(ctx, task, task.version)
            rollouts.wait_s = rollouts.generate_s
        else:
            rollouts = task.producer.take(task.version)
            replace_stale_groups(
                rollouts,
                ctx.config.rollout.group_size,
                task.version,
                task.config.max_staleness,
                lambda examples, task=task: ctx.generate(task, examples, ctx.sampling(task, task.version)),
            )
        collected[task.name] = rollouts
    return collected


def generate_rollouts(ctx: RunContext, task: Task, task_step: int) -> Rollouts:
    """The task's next prompt batch (this rank's share) and its samples, from its adapter version
    in service now (`task_step`: the task's own step count, which its versions follow)."""
    return begin_rollouts(ctx, task, task_step)()


def begin_rollouts(
    ctx: RunContext, task: Task, task_step: int, engine: NativeRolloutEngine | None = None
) -> Callable[[], Rollouts]:
    """Draw the task's next prompt batch (this rank's share) now; returns the function that
    generates its samples (on a producer's thread in the asynchronous mode). `engine`: a lane of
    the built-in engine's asynchronous rollouts; None: the run's engine."""
    examples = next(task.iterator)[ctx.dp_rank :: ctx.dp]
    iterator_state = task.iterator.state_dict()
    sampling = ctx.sampling(task, task_step)

    def generate() -> Rollouts:
        start = time.perf_counter()
        if engine is None:
            samples = ctx.generate(task, examples, sampling)
        elif task.episodes is not None:
            samples = episode_samples(task, examples, sampling, engine, None)
        else:
            samples = engine.generate(ctx.prompt_ids(task, examples), sampling)
        return Rollouts(task_step, examples, samples, iterator_state, generate_s=time.perf_counter() - start)

    return generate


def start_producers(ctx: RunContext, tasks: list[Task], steps: int) -> None:
    """A background producer for each task of `tasks` with max_staleness >= 1 (on the ranks that
    generate): it makes the task's next `steps` steps while the current one trains, at most
    max_staleness ahead, each step's generation beside the previous ones'. The built-in engine
    generates on lanes of its own (RolloutLanes), which each publish hands the new adapter to."""
    if not ctx.generates_rollouts:
        return
    for task in tasks:
        if task.config.max_staleness == 0:
            continue
        lanes, on_publish = None, None
        if ctx.native is not None:
            lanes = RolloutLanes(ctx.config, ctx.trainer, ctx.native.record_routing, task.version)
            on_publish = lanes.publish

        def begin(task_step: int, task=task, lanes=lanes) -> Callable[[], Rollouts]:
            return begin_rollouts(ctx, task, task_step, None if lanes is None else lanes.engine(task_step))

        task.producer = RolloutProducer(
            begin, task.version, task.version + steps, task.config.max_staleness, task.version, on_publish
        )


def replace_stale_groups(rollouts: Rollouts, group_size: int, version: int, max_staleness: int, generate) -> None:
    """Drop every group of `rollouts` with a sample (or token) made by an adapter version older than
    version - max_staleness and put in its place `generate(examples)`'s fresh samples of the same
    prompts (counted in rollouts.stale_dropped)."""
    G = group_size
    oldest = [min(s.token_versions, default=s.version) for s in rollouts.samples]
    stale = stale_groups(oldest, G, version, max_staleness)
    if not stale:
        return
    regenerated = generate([rollouts.examples[g] for g in stale])
    for slot, group in enumerate(stale):
        for i, sample in enumerate(regenerated[slot * G : (slot + 1) * G]):
            sample.prompt_index = group
            rollouts.samples[group * G + i] = sample
    rollouts.stale_dropped = len(stale) * G


def mixed_rollouts(native, tasks, prompt_ids, sampling, dp_rank: int, dp: int) -> dict[str, Rollouts]:
    """The next rollouts of every task of `tasks` (this data-parallel rank's share of its prompts),
    from the built-in engine `native` on a multi-task model in one mixed batch, each sequence with
    its task's adapter; `prompt_ids(task, examples)` tokenizes, `sampling(task, step)` is a task's
    sampling at its step. Each task samples from its own generators, seeded from its name: its
    samples depend on its prompts and its step, not on the other tasks or its place among them."""
    start = time.perf_counter()
    drawn = {task.name: next(task.iterator)[dp_rank::dp] for task in tasks}
    prompts, adapters = [], []
    for task in tasks:
        ids = prompt_ids(task, drawn[task.name])
        prompts += ids
        adapters += [task.index] * len(ids)
    seeds = {task.index: sampling(task, task.version).seed for task in tasks}
    sampling = sampling(tasks[0], tasks[0].version)
    samples = native.generate(prompts, sampling, adapters=adapters, adapter_seeds=seeds) if prompts else []
    generate_s = time.perf_counter() - start
    collected, first = {}, 0
    for task in tasks:
        count = len(drawn[task.name])
        mine = [s for s in samples if first <= s.prompt_index < first + count]
        for sample in mine:
            sample.prompt_index -= first
            # the engine's policy is not the task's: in-process, the task's version is in service
            sample.version, sample.token_versions = task.version, [task.version] * len(sample.completion_ids)
        collected[task.name] = Rollouts(
            task.version, drawn[task.name], mine, task.iterator.state_dict(), generate_s=generate_s, wait_s=generate_s
        )
        first += count
    return collected
