"""The update and publish phases of an RL step: the trainer's updates on the prepared batch, then
each task's new adapter version made live on the rollout side.
"""

from __future__ import annotations

import time

from archon.batch import PackedBatch
from archon.rl.run.batches import filler_batch
from archon.rl.run.context import RunContext
from archon.rl.run.task import Task


def update(ctx: RunContext, batch: PackedBatch, trained: list[Task], active: list[Task]) -> dict[str, list[dict]]:
    """Update: algorithm.ppo_epochs passes over the batch in algorithm.minibatches updates (the
    same for every task); minibatch m holds the m-th share of every `trained` task's sequences and
    steps each task's own optimizer. Then each `active` task's LR schedule advances once (it is a
    function of the RL step). A rank whose share of a minibatch is empty runs a filler batch in
    step with the others; a task with no sequence in a minibatch on any rank takes no update from
    it. Returns each trained task's updates (Trainer.train_step's metrics)."""
    updates: dict[str, list[dict[str, float]]] = {task.name: [] for task in trained}
    if trained:
        algo = trained[0].config.algorithm
        by_adapter = ctx.trainer.sequences_by_adapter(batch)
        losses = {task.name: task.algorithm.loss for task in trained}
        for _ in range(algo.ppo_epochs):
            for m in range(algo.minibatches):
                chosen = []
                for name, sequences in by_adapter.items():
                    if name in losses:
                        per = -(-len(sequences) // algo.minibatches)
                        chosen += sequences[m * per : (m + 1) * per]
                minibatch = batch.select(chosen) if chosen else filler_batch(ctx.multi_task, trained[0].index)
                out = ctx.trainer.train_step(
                    minibatch, losses, ctx.config.rollout.temperature, with_entropy=True, advance_schedule=False
                )
                for name, metrics in out.items():
                    updates[name].append(metrics)
    for task in active:
        ctx.trainer.advance_schedule(task.name)
    return updates


def publish(ctx: RunContext, task: Task, version: int) -> dict[str, float]:
    """Publish: the weight sync makes the task's trained adapter version `version` on the
    rollout side (under its own name on vLLM); returns what it sent (sync_adapter_bytes or
    sync_weight_bytes; rank 0 knows) and sync_s."""
    start = time.perf_counter()
    with ctx.view(task):
        sent = task.sync.publish(ctx.trainer.model, ctx.trainer.converter, task.config.lora, version)
        task.version = version
        if task.adapter_history is not None:
            task.adapter_history.record(ctx.trainer.model, version)
    if task.producer is not None:
        task.producer.published(version)
    metrics = {f"sync_{k}": v for k, v in sent.items() if k.endswith("_bytes")}
    return {"sync_s": time.perf_counter() - start, **metrics}
