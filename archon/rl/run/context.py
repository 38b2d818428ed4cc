"""What every phase of an RL step reads: the run's context, built once when the run starts (the
trainer, tokenizer, parallel layout, run directory, rollout engines and stop ids), with the
collectives bound to the data-parallel group and the ways the run turns a task's prompts into
samples.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from archon.distributed import reduce_floats
from archon.lora import task_view
from archon.parallel.dims import ParallelDims
from archon.rl.config import RLConfig
from archon.rl.data import tokenize_prompt
from archon.rl.run.episodes import episode_samples
from archon.rl.run.task import Task
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.trainer import Trainer


def eval_new_tokens(config: RLConfig) -> int:
    """The most tokens a held-out completion may have (eval.max_new_tokens, else the rollouts')."""
    return config.eval.max_new_tokens or config.rollout.max_new_tokens


def prompt_ids(tokenizer, examples, apply_chat_template: bool) -> list[list[int]]:
    """Each example's prompt token ids (pre-tokenized, or tokenized now)."""
    return [
        ex.prompt_ids if ex.prompt_ids is not None else tokenize_prompt(tokenizer, ex.prompt, apply_chat_template)
        for ex in examples
    ]


@dataclass(frozen=True)
class RunContext:
    """The run as the phases see it. `native` is the built-in engine on the training model (None
    with vLLM); `servers` the vLLM servers every task's adapters are served on (None without).
    With vLLM the first of the ranks given the same data (the context- and tensor-parallel ranks of
    one data-parallel rank) generates the rollouts and sends them to the others (`share_rollouts`);
    the built-in engine generates on every rank, in lockstep, with the same seeds."""

    config: RLConfig
    trainer: Trainer
    tokenizer: Any
    run_dir: Path
    stop_token_ids: tuple[int, ...]
    native: NativeRolloutEngine | None
    servers: Any
    share_rollouts: bool
    generates_rollouts: bool

    @property
    def dims(self) -> ParallelDims:
        return self.trainer.dims

    @property
    def device(self):
        return self.trainer.device

    @property
    def rank(self) -> int:
        return self.trainer.rank

    @property
    def dp(self) -> int:
        return self.trainer.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.trainer.dims.dp_rank

    @property
    def multi_task(self) -> bool:
        return self.trainer.multi_task

    @property
    def eval_new_tokens(self) -> int:
        return eval_new_tokens(self.config)

    def dp_sum(self, *values: float, op=dist.ReduceOp.SUM) -> list[float]:
        """Sum (or another `op`) over the data-parallel ranks."""
        return reduce_floats(values, self.device, self.dims.dp_group, op=op)

    def dp_max(self, value: float) -> float:
        return self.dp_sum(value, op=dist.ReduceOp.MAX)[0]

    def view(self, task: Task):
        """The model as `task`'s single-adapter model (the model itself for a run without tasks)."""
        return task_view(self.trainer.model, task.name) if self.multi_task else contextlib.nullcontext()

    def prompt_ids(self, task: Task, examples) -> list[list[int]]:
        return prompt_ids(self.tokenizer, examples, task.config.data.apply_chat_template)

    def sampling(self, task: Task, task_step: int) -> SamplingParams:
        """Training sampling for `task`'s step `task_step` on this rank (the seed follows the task's
        name and the data-parallel rank)."""
        cfg = self.config
        return SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            n=cfg.rollout.group_size,
            stop_token_ids=self.stop_token_ids,
            seed=cfg.seed * 1_000_003 + task_step * 1009 + task.seed_offset + self.dp_rank,
        )

    def generate(self, task: Task, examples, sampling: SamplingParams) -> list[Sample]:
        """`task`'s samples of `examples`, with its adapter."""
        if task.episodes is not None:
            engine = self.native if self.native is not None else task.rollout
            return episode_samples(task, examples, sampling, engine, task.index if self.multi_task else None)
        prompts = self.prompt_ids(task, examples)
        if self.native is not None and self.multi_task:
            return self.native.generate(
                prompts, sampling, adapters=[task.index] * len(prompts), adapter_seeds={task.index: sampling.seed}
            )
        return task.rollout.generate(prompts, sampling)
