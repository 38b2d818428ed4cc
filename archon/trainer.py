"""The trainer: what the RL loop uses of a built model.

`Trainer` gives `logprobs` (policy, or reference with the adapter off) and `train_step`
(micro-batches by token budget, accumulation, clipping, AdamW, LR schedule, and skipping any
update whose loss or gradient is not finite), plus resume checkpoints and PEFT export, which
refuse to write NaN or inf.

With `TrainerConfig.tasks` it trains several adapters (multi-LoRA) on the one frozen base: each
task has its own LoRA config, AdamW, LR schedule and optimizer-step count; a packed batch mixes
tasks (`extras["task"]`, each token's task index) and `train_step_tasks` takes one loss function per
task, steps each task's optimizer on its own (a non-finite task is skipped alone), and checkpoints
and PEFT exports are per task (`task=`).

Data layout: every data-parallel rank passes its own PackedBatch; the ranks of one tensor-parallel
group pass the same one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from archon import device as devices
from archon.batch import PackedBatch
from archon.build import build_model
from archon.head import DEFAULT_CHUNK_SIZE, label_logprobs
from archon.lora import (
    LoRAConfig,
    adapter_disabled,
    adapter_routing,
    task_parameters,
    task_view,
)
from archon.load_balance import (
    MoEConfig,
    all_reduce_step_counts,
    drop_forward_records,
    load_balance_loss,
    load_imbalance,
    routers,
    update_correction_biases,
)
from archon.parallel import ParallelConfig, init_distributed, reduce_partial_grads
from archon.parallel.grad import clip_grad_norm
from archon.parallel.parallelize import DTYPES, DTypeName

# ---------------------------------------------------------------------------------------------
# Training configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW (fp32 states for the fp32 LoRA factors) with warm-up and decay.

    Schedule lengths count training steps: in the RL loop an RL step (all its minibatches and PPO
    epochs take the same learning rate), for `Engine.train_step` on its own one call.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None or 0 only measures it."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    """Linear warm-up from lr/(warmup_steps+1) to lr over the first warmup_steps steps."""
    total_steps: int | None = None
    """Steps over which linear/cosine decay to min_lr_ratio * lr. None: the run's length (the RL
    recipe fills in `steps`); set it only to decay over a different length."""
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.schedule={self.schedule!r} needs total_steps > warmup_steps "
                f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})"
            )

    def for_run(self, steps: int) -> OptimConfig:
        """This config with total_steps set to the run's `steps` when it is unset."""
        if self.total_steps is not None:
            return self
        if self.schedule != "constant" and steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.schedule={self.schedule!r} decays over the run's {steps} steps, which must be "
                f"more than optim.warmup_steps={self.warmup_steps}"
            )
        return replace(self, total_steps=steps)


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """Multiplier of config.lr for training step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return 1.0
    _require_total_steps(config)
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    if config.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def _require_total_steps(config: OptimConfig) -> None:
    if config.schedule != "constant" and config.total_steps is None:
        raise ValueError(
            f"OptimConfig.schedule={config.schedule!r} needs total_steps; set it or fill it in with for_run(steps)"
        )


class _LRLambda:
    def __init__(self, config: OptimConfig) -> None:
        _require_total_steps(config)  # now, not at the first step past the warm-up
        self.config = config

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.config)


@dataclass
class TrainerTask:
    """One adapter of a multi-task trainer."""

    name: str
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


TASK_EXTRA = "task"
"""PackedBatch.extras key of a multi-task batch: [T] long, each token's task index (TrainerConfig.tasks order)."""


@dataclass
class TrainerConfig:
    model_path: str
    """HF checkpoint directory (config.json + safetensors)."""
    lora: LoRAConfig | None = field(default_factory=LoRAConfig)
    """The adapter to train; None trains every parameter (full fine-tuning)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dtype: DTypeName = "float32"
    """Base-weight dtype (LoRA factors are always fp32). Use float32 on CPU."""
    device: str = "auto"
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward; whole sequences are packed up to it."""
    head_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Rows of logits computed at a time by the log-prob head."""
    seed: int = 0
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE load balancing (auxiliary loss, correction-bias updates); MoE models only."""
    tasks: tuple[TrainerTask, ...] = ()
    """Several adapters on the one base (multi-LoRA), each with its own LoRA config and optimizer;
    `lora` and `optim` are then unused and must be left None / default. Empty: one adapter."""


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


@dataclass
class LogprobOutput:
    logprobs: torch.Tensor
    """[T] fp32: log p(labels[t]) at loss_mask positions, 0 elsewhere."""
    entropy: torch.Tensor | None = None
    """[T] fp32 entropy of the next-token distribution at loss_mask positions, 0 elsewhere."""


def loss_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[2] fp32 on loss_mask's device: the loss-mask tokens of a packed batch, and its sequences
    with at least one of them."""
    mask = loss_mask.bool()
    ends = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])
    per_sequence = ends[cu_seqlens[1:].long()] - ends[cu_seqlens[:-1].long()]
    return torch.stack([mask.sum(), (per_sequence > 0).sum()]).float()


@dataclass
class LossContext:
    """What a loss function needs beyond its micro-batch and log-probs.

    A loss function returns its micro-batch's *share* of the whole batch's loss: numerators summed
    over the micro-batch, divided by a count over the whole batch (all micro-batches, all
    data-parallel ranks); which count an aggregation divides by is decided in one place,
    `archon.rl.losses.aggregation_normalizer`. The trainer sums gradients over micro-batches and ranks.
    """

    global_tokens: torch.Tensor
    """0-dim fp32: loss-mask tokens in the whole batch."""
    global_sequences: torch.Tensor
    """0-dim fp32: sequences with at least one loss-mask token in the whole batch."""
    temperature: float = 1.0
    entropy: torch.Tensor | None = None
    """[T] entropy (with gradient) when train_step was asked for it."""
    dp_size: int = 1

    @classmethod
    def for_batch(
        cls, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> LossContext:
        """The context of a batch scored in one piece (one micro-batch on one rank): its own counts."""
        tokens, sequences = loss_counts(loss_mask, cu_seqlens)
        return cls(tokens, sequences, entropy=entropy)


class NonFiniteError(RuntimeError):
    """A loss, gradient or trainable tensor is NaN or infinite where only a finite value will do."""


LossFn = Callable[[PackedBatch, torch.Tensor, LossContext], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass
class TaskState:
    """One task's training state in a multi-task trainer."""

    name: str
    lora: LoRAConfig
    optim: OptimConfig
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    optimizer_steps: int = 0


def _adamw(params: list[torch.nn.Parameter], optim: OptimConfig):
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _LRLambda(optim))


class Trainer:
    """A model ready to score and train, on this rank's share of the devices.

    Under torchrun the process group is started from the environment; a plain process runs alone.
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.device, self.rank, self.world_size = init_distributed(config.device)
        self.dims = config.parallel.dims(self.world_size, self.device.type)
        devices.manual_seed_all(config.seed + 1000 * self.dims.dp_rank)
        names = [task.name for task in config.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"TrainerConfig.tasks: task names must be unique, got {names}")
        if config.tasks and config.lora is not None:
            raise ValueError("TrainerConfig: with tasks, each task has its own LoRA config; set lora=None")
        if config.tasks and (config.moe.aux_loss_coef > 0 or config.moe.bias_update_rate > 0):
            # both act on the shared routing, so one task's batch would move every task's model
            raise ValueError(
                "TrainerConfig: MoE load balancing (moe.aux_loss_coef, moe.bias_update_rate) is not supported with "
                "several tasks; leave both at 0"
            )
        loaded = build_model(
            config.model_path,
            lora=config.lora,
            dtype=DTYPES[config.dtype],
            device=self.device,
            parallel=config.parallel,
            dims=self.dims,
            seed=config.seed,
            task_loras={task.name: task.lora for task in config.tasks} if config.tasks else None,
        )
        self.loaded = loaded
        self.model = loaded.model
        self.converter = loaded.converter
        self.lora = config.lora
        self.tasks: dict[str, TaskState] = {}
        """Multi-task: each task's adapter and optimizer, in routing order ({} for one adapter)."""
        for task in config.tasks:
            params = list(task_parameters(self.model, task.name).values())
            optimizer, scheduler = _adamw(params, task.optim)
            self.tasks[task.name] = TaskState(task.name, task.lora, task.optim, params, optimizer, scheduler)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.routers = routers(self.model)
        self._check_moe_config(config.moe)
        # one adapter: its optimizer; several: each task's own (self.tasks)
        self.optimizer, self.scheduler = (None, None) if self.tasks else _adamw(self.trainable, config.optim)
        self.optimizer_steps = 0
        """AdamW updates applied (skipped ones not counted); the schedule position is the scheduler's."""

    # ---- helpers ------------------------------------------------------------------------------
    def _check_moe_config(self, moe: MoEConfig) -> None:
        family = type(self.model).__name__
        if moe.aux_loss_coef > 0 and not self.routers:
            raise ValueError(f"moe.aux_loss_coef={moe.aux_loss_coef} but {family} has no MoE routers")
        if moe.bias_update_rate > 0 and (not self.routers or any(r.correction_bias is None for r in self.routers)):
            raise ValueError(
                f"moe.bias_update_rate={moe.bias_update_rate} but the routers of {family} have no "
                "score-correction bias (aux-loss-free balancing applies to DeepSeek-V3-style routers)"
            )

    @property
    def fsdp(self) -> bool:
        return self.dims.fsdp_enabled

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.dims.dp > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.dims.dp_group)
        return t

    def _micro_batches(self, batch: PackedBatch) -> tuple[list[PackedBatch], int]:
        """This rank's micro-batches, and how many forward passes every data-parallel rank runs (FSDP
        needs the same number of collectives on each)."""
        micro = batch.to(self.device).split_by_tokens(self.config.micro_batch_tokens)
        count = torch.tensor(len(micro), device=self.device)
        if self.fsdp:
            self._all_reduce(count, dist.ReduceOp.MAX)
        return micro, int(count)

    def _routing(self, batch: PackedBatch):
        """Each token's adapter, for a multi-task model (nothing to do for one adapter)."""
        if not self.tasks:
            return contextlib.nullcontext()
        if TASK_EXTRA not in batch.extras:
            raise ValueError(
                f"a multi-task trainer needs each token's task: PackedBatch.extras[{TASK_EXTRA!r}] ([T] task indices "
                f"into {list(self.tasks)})"
            )
        return adapter_routing(self.model, batch.extras[TASK_EXTRA])

    def _forward_logprobs(self, batch: PackedBatch, temperature: float, with_entropy: bool):
        with self._routing(batch):
            hidden = self.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
        index = batch.loss_mask.nonzero()[:, 0]
        lp, ent = label_logprobs(
            hidden[index], self.model.output_weight, batch.labels[index], temperature,
            self.config.head_chunk_size, with_entropy,
        )
        T = batch.num_tokens
        logprobs = torch.zeros(T, dtype=torch.float32, device=hidden.device).index_copy(0, index, lp)
        entropy = None
        if with_entropy:
            entropy = torch.zeros(T, dtype=torch.float32, device=hidden.device).index_copy(0, index, ent)
        return logprobs, entropy

    # ---- scoring ------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(
        self,
        batch: PackedBatch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        use_adapter: bool = True,
    ) -> LogprobOutput:
        """Log-probs (and entropy) of `batch.labels` at the loss-mask positions, in eval mode.

        use_adapter=False scores with the LoRA switched off: the reference (base) policy.
        """
        if not use_adapter and self.lora is None and not self.tasks:
            raise ValueError("use_adapter=False needs a LoRA model; this trainer trains every parameter")
        micro, count = self._micro_batches(batch)
        was_training = self.model.training
        self.model.eval()
        lps, ents = [], []
        try:
            with contextlib.nullcontext() if use_adapter else adapter_disabled(self.model):
                for i in range(count):
                    lp, ent = self._forward_logprobs(micro[min(i, len(micro) - 1)], temperature, with_entropy)
                    if i < len(micro):
                        lps.append(lp)
                        ents.append(ent)
        finally:
            self.model.train(was_training)
            if self.fsdp:
                self.model.reshard()
        return LogprobOutput(torch.cat(lps).cpu(), torch.cat(ents).cpu() if with_entropy else None)

    # ---- training -----------------------------------------------------------------------------
    def forward_backward(
        self,
        batch: PackedBatch,
        loss_fn: LossFn,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """Accumulate the gradient of the whole batch's loss (no optimizer step)."""
        self.model.train()
        micro, count = self._micro_batches(batch)
        host = batch.to("cpu")
        counts = torch.cat([loss_counts(host.loss_mask, host.cu_seqlens), torch.tensor([float(host.num_tokens)])])
        counts = counts.to(self.device)
        self._all_reduce(counts)
        global_tokens, global_sequences = counts[0].clone(), counts[1].clone()

        self._one_adapter("forward_backward")
        self.optimizer.zero_grad(set_to_none=True)
        for router in self.routers:
            router.routing.reset_step()
        loss_sum = torch.zeros((), device=self.device)
        reports = _MetricReports(self.device)
        for i in range(count):
            real = i < len(micro)
            mb = micro[i] if real else min(micro, key=lambda b: b.num_tokens)
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == count - 1)
            logprobs, entropy = self._forward_logprobs(mb, temperature, with_entropy)
            ctx = LossContext(global_tokens, global_sequences, temperature, entropy, self.dims.dp)
            loss, metrics = loss_fn(mb, logprobs, ctx)
            if self.routers:
                loss, metrics = self._add_load_balance(mb, loss, metrics, global_tokens, real)
            if not real:
                # Keeps this rank's collectives in step with ranks that have more micro-batches.
                loss = loss * 0.0
            loss.backward()
            drop_forward_records(self.routers)
            if not real:
                continue
            loss_sum += loss.detach().float()
            reports.add(metrics, float(mb.loss_mask.sum()))
        if self.fsdp:
            self.model.set_requires_gradient_sync(True)
        reduce_partial_grads(self.model)

        out: dict[str, float] = {}
        self._all_reduce(loss_sum)
        out["loss"] = loss_sum.item()
        out.update(reports.reduced(self._all_reduce, global_tokens))
        if self.routers:
            all_reduce_step_counts(self.routers, self.dims.dp_group if self.dims.dp > 1 else None)
            out["moe_load_imbalance"] = load_imbalance(self.routers)
        out.update(
            tokens=global_tokens.item(),
            sequences=global_sequences.item(),
            total_tokens=counts[2].item(),
            micro_batches=count,
        )
        return out

    def _add_load_balance(self, mb: PackedBatch, loss, metrics: dict, global_tokens: torch.Tensor, real: bool):
        """The routers' auxiliary loss of this micro-batch's forward, as the `moe_aux_loss` metric (a
        loss-token mean like the loss function's metrics) and, times moe.aux_loss_coef, added to the
        loss with the micro-batch's share of the batch's loss tokens. Real micro-batches' expert
        choices count towards the step's per-expert loads."""
        aux = load_balance_loss(self.routers)
        coef = self.config.moe.aux_loss_coef
        if coef > 0:
            loss = loss + coef * aux * (mb.loss_mask.sum() / global_tokens.clamp(min=1.0))
        if real:
            for router in self.routers:
                router.routing.count_forward()
        return loss, {**metrics, "moe_aux_loss": aux.detach()}

    def _same_on_every_rank(self, flag: bool) -> bool:
        """True when `flag` is true on any rank of the job."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def optimizer_step(self, loss: float | None = None) -> dict[str, float]:
        """Clip and step AdamW, unless `loss` (the global batch loss) or the global gradient norm is
        NaN or infinite: then the gradient is dropped and the parameters and the optimizer state
        (moments and AdamW's step count) stay as they were. Every rank takes the same decision.
        The LR schedule does not move here (see advance_schedule).

        Returns grad_norm (before clipping), the lr and skipped (1.0 for a skipped update).
        """
        self._one_adapter("optimizer_step")
        lr = self.optimizer.param_groups[0]["lr"]
        norm = clip_grad_norm(self.trainable, self.config.optim.max_grad_norm).item()
        finite = math.isfinite(norm) and (loss is None or math.isfinite(loss))
        skipped = self._same_on_every_rank(not finite)
        if not skipped:
            self.optimizer.step()
            self.optimizer_steps += 1
            if self.config.moe.bias_update_rate > 0:
                update_correction_biases(self.routers, self.config.moe.bias_update_rate)
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "lr": lr, "skipped": float(skipped)}

    def advance_schedule(self, task: str | None = None) -> None:
        """Move the LR schedule (of `task`, in a multi-task trainer) on by one training step. It moves
        whether or not the step's updates were skipped: the learning rate is a function of the step,
        so a skipped step does not shift the rest of the schedule."""
        scheduler = self._task(task).scheduler if self.tasks else self.scheduler
        with warnings.catch_warnings():
            # Raised when the very first update was skipped; that order is intended.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            scheduler.step()

    def train_step(
        self,
        batch: PackedBatch,
        loss_fn: LossFn,
        temperature: float = 1.0,
        with_entropy: bool = False,
        advance_schedule: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on `batch` (this rank's share), skipped when the loss or the gradient
        norm is not finite (see optimizer_step).

        loss_fn(micro_batch, logprobs[T], ctx) -> (loss, metrics): logprobs carry the gradient and
        are 0 outside micro_batch.loss_mask; the loss is the micro-batch's share of the batch loss
        (see LossContext). Metrics are per-micro-batch token means (weighted by loss tokens in the
        report), `*_max` / `*_min` extremes, or `num_tokens` (summed).

        advance_schedule=False leaves the LR schedule where it is, for a training step made of
        several updates (the RL loop's minibatches and PPO epochs); call advance_schedule() after
        the last one.

        Returns loss, grad_norm, lr, skipped, tokens (loss tokens), sequences, total_tokens,
        micro_batches, optimizer_steps, time_s and the loss function's metrics, all over the global
        batch.
        """
        start = time.perf_counter()
        metrics = self.forward_backward(batch, loss_fn, temperature, with_entropy)
        metrics.update(self.optimizer_step(metrics["loss"]))
        if advance_schedule:
            self.advance_schedule()
        metrics["optimizer_steps"] = self.optimizer_steps
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    # ---- several tasks (multi-LoRA) -------------------------------------------------------------
    def _one_adapter(self, what: str) -> None:
        if self.tasks:
            raise ValueError(f"Trainer.{what} trains one adapter; a multi-task trainer trains with train_step_tasks")

    def _task(self, task: str | None) -> TaskState:
        if not self.tasks:
            raise ValueError(f"task={task!r} given to a trainer with one adapter (TrainerConfig.tasks is empty)")
        if task not in self.tasks:
            raise ValueError(f"unknown task {task!r}; the trainer's tasks are {list(self.tasks)}")
        return self.tasks[task]

    def task_sequences(self, batch: PackedBatch) -> dict[str, list[int]]:
        """The sequences of a multi-task batch by task (tasks with none left out)."""
        first_token_task = batch.extras[TASK_EXTRA][batch.cu_seqlens[:-1].long()].tolist()
        names = list(self.tasks)
        chosen: dict[str, list[int]] = {}
        for sequence, index in enumerate(first_token_task):
            chosen.setdefault(names[index], []).append(sequence)
        return chosen

    def train_step_tasks(
        self,
        batch: PackedBatch,
        loss_fns: dict[str, LossFn],
        temperature: float = 1.0,
        with_entropy: bool = False,
        advance_schedule: bool = True,
    ) -> dict[str, dict[str, float]]:
        """One optimizer step of every task with sequences in the mixed `batch` (extras["task"]).

        Each micro-batch runs one forward and one backward for all its tasks; each task's loss is
        `loss_fns[task]` on its own sequences, normalised by its own counts (LossContext), so its
        adapter's gradient is exactly its single-task gradient. Then each task clips and steps its
        own AdamW; a task whose loss or gradient norm is not finite is skipped alone (its loss is
        left out of the backward, so no NaN reaches the others). Returns each stepped task's metrics
        (as train_step's)."""
        start = time.perf_counter()
        host = batch.to("cpu")
        by_task = self.task_sequences(host)
        unknown = sorted(set(by_task) - set(loss_fns))
        if unknown:
            raise ValueError(f"train_step_tasks: the batch has sequences of task(s) {unknown} without a loss function")
        self.model.train()
        micro, _ = self._micro_batches(batch)
        counts = {}
        for task, sequences in by_task.items():
            sub = host.select(sequences)
            counts[task] = (*loss_counts(sub.loss_mask, sub.cu_seqlens).to(self.device), sub.num_tokens)
        for state in self.tasks.values():
            state.optimizer.zero_grad(set_to_none=True)
        loss_sums = {task: torch.zeros((), device=self.device) for task in by_task}
        reports = {task: _MetricReports(self.device) for task in by_task}
        for mb in micro:
            logprobs, entropy = self._forward_logprobs(mb, temperature, with_entropy)
            bounds = mb.cu_seqlens.tolist()
            total = None
            for task, sequences in self.task_sequences(mb).items():
                rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in sequences]).to(logprobs.device)
                tokens, sequence_count, _ = counts[task]
                ctx = LossContext(tokens, sequence_count, temperature, None if entropy is None else entropy[rows], 1)
                loss, metrics = loss_fns[task](mb.select(sequences), logprobs[rows], ctx)
                loss_sums[task] += loss.detach().float()
                reports[task].add(metrics, float(mb.loss_mask[rows].sum()))
                if not bool(torch.isfinite(loss.detach())):
                    continue  # kept out of the backward: a NaN would reach every task's gradient
                total = loss if total is None else total + loss
            if total is not None:
                total.backward()

        out: dict[str, dict[str, float]] = {}
        for task in by_task:
            tokens, sequence_count, total_tokens = counts[task]
            metrics = {"loss": loss_sums[task].item(), **reports[task].reduced(self._all_reduce, tokens)}
            metrics.update(tokens=tokens.item(), sequences=sequence_count.item(), total_tokens=float(total_tokens),
                           micro_batches=len(micro))  # fmt: skip
            metrics.update(self._task_optimizer_step(self.tasks[task], metrics["loss"]))
            if advance_schedule:
                self.advance_schedule(task)
            metrics["optimizer_steps"] = self.tasks[task].optimizer_steps
            metrics["time_s"] = time.perf_counter() - start
            out[task] = metrics
        return out

    def _task_optimizer_step(self, state: TaskState, loss: float) -> dict[str, float]:
        """optimizer_step for one task: its own clipping, finiteness check and AdamW."""
        lr = state.optimizer.param_groups[0]["lr"]
        norm = clip_grad_norm(state.trainable, state.optim.max_grad_norm).item()
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped:
            state.optimizer.step()
            state.optimizer_steps += 1
        state.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "lr": lr, "skipped": float(skipped)}

    def _adapter_state(self, task: str | None):
        """(lora, optimizer, scheduler) of the one adapter, or of `task`'s."""
        if task is None:
            if self.tasks:
                raise ValueError(f"a multi-task trainer needs task= (one of {list(self.tasks)})")
            return self.lora, self.optimizer, self.scheduler
        state = self._task(task)
        return state.lora, state.optimizer, state.scheduler

    def _view(self, task: str | None):
        """The model as `task`'s single-adapter model (the model itself for one adapter)."""
        return contextlib.nullcontext() if task is None else task_view(self.model, task)

    # ---- adapters and checkpoints ---------------------------------------------------------------
    def _first_non_finite(self, optimizer_state: bool, optimizer=None) -> str | None:
        """This rank's first trainable parameter (or, with optimizer_state, AdamW state tensor of
        one) that holds NaN or inf, by name; None when all are finite."""
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            tensors = [(name, param)]
            if optimizer_state:
                state = (optimizer or self.optimizer).state.get(param, {})
                tensors += [(f"optimizer state {key!r} of {name}", value) for key, value in state.items()]
            for label, tensor in tensors:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if torch.is_tensor(local) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
                    return label
        return None

    @torch.no_grad()
    def check_finite(self, what: str, optimizer_state: bool = True, task: str | None = None) -> None:
        """Raise NonFiniteError on every rank when any rank's trainable parameters (or, with
        optimizer_state, their AdamW state) hold NaN or inf, naming the first such tensor. `what`
        says what was about to be written. With `task`: that task's adapter only."""
        _, optimizer, _ = self._adapter_state(task)
        with self._view(task):
            bad = self._first_non_finite(optimizer_state, optimizer)
        if not self._same_on_every_rank(bad is not None):
            return
        found = [bad]
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, bad)
        rank, label = next((r, b) for r, b in enumerate(found) if b is not None)
        raise NonFiniteError(
            f"refusing to write the {what}: {label!r} (rank {rank}) holds NaN or inf values; nothing was "
            "written and the earlier checkpoints and adapters are as they were"
        )

    def export_peft(
        self, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None, task: str | None = None
    ) -> Path:
        """Write the adapter (of `task`, in a multi-task trainer: an adapter that loads alone) in PEFT
        format (gathered from all shards; rank 0 writes). Refuses (NonFiniteError) an adapter with
        NaN or inf values."""
        from archon.lora.peft import save_peft_adapter

        lora, _, _ = self._adapter_state(task)
        if lora is None:
            raise ValueError("export_peft needs a LoRA model; this trainer trains every parameter")
        self.check_finite(f"PEFT adapter {str(out_dir)!r}", optimizer_state=False, task=task)
        with self._view(task):
            path = save_peft_adapter(
                self.model, self.converter, lora, out_dir,
                base_model_name_or_path or str(self.loaded.path), write=self.rank == 0,
            )
        if dist.is_initialized():
            dist.barrier()
        return path

    def checkpoint_state(self, task: str | None = None) -> dict[str, Any]:
        """The trainable parameters and optimizer state (of `task` alone, under its single-adapter
        names, in a multi-task trainer), as DCP state dicts (sharded where the model is)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        _, optimizer, _ = self._adapter_state(task)
        with self._view(task):
            model_state, optim_state = get_state_dict(
                self.model, optimizer, options=StateDictOptions(ignore_frozen_params=True)
            )
        return {"model": model_state, "optimizer": optim_state}

    def load_checkpoint_state(self, state: dict[str, Any], task: str | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        _, optimizer, _ = self._adapter_state(task)
        with self._view(task):
            set_state_dict(
                self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                # Frozen base weights are not in the checkpoint; dcp.load has already failed on any
                # trainable key missing from it.
                options=StateDictOptions(ignore_frozen_params=True, strict=False),
            )

    def save_checkpoint(self, manager, step: int, data_state: dict | None = None, task: str | None = None) -> Path:
        """Save a resume checkpoint for training step `step` (the RL step in the loop; it names the
        checkpoint) through a CheckpointManager. Refuses (NonFiniteError) a state with NaN or inf.
        In a multi-task trainer, `task`'s checkpoint: its adapter, optimizer and schedule alone
        (give each task its own manager, i.e. directory)."""
        from archon.checkpoint.resume import lora_settings

        lora, _, scheduler = self._adapter_state(task)
        self.check_finite(f"checkpoint for step {step}" + (f" of task {task!r}" if task else ""), task=task)
        # The schedule itself comes from the config; only its position is state.
        scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        optimizer_steps = self.optimizer_steps if task is None else self.tasks[task].optimizer_steps
        trainer_state = {
            "step": step, "optimizer_steps": optimizer_steps, "scheduler": scheduler_state, "data": data_state or {},
            "lora": lora_settings(lora),
        }  # fmt: skip
        return manager.save(step, self.checkpoint_state(task), trainer_state)

    def load_checkpoint(self, manager, path: str | os.PathLike | None = None, task: str | None = None) -> dict | None:
        """Resume from `path` (default: the manager's latest). Returns the whole trainer state
        (`step`, `optimizer_steps`, `scheduler`, `data`, `lora`), or None when there is no checkpoint.
        A checkpoint trained with another LoRA config (rank, alpha, targets, ...) is refused, naming
        the differences; dropout may change. With `task`: that task's checkpoint, into its adapter
        alone (the other tasks are untouched)."""
        from archon.checkpoint.resume import lora_settings

        path = manager.latest() if path is None else Path(path)
        if path is None:
            return None
        lora, _, scheduler = self._adapter_state(task)
        state = self.checkpoint_state(task)
        trainer_state = manager.load(path, state, expected={"lora": lora_settings(lora)})
        self.load_checkpoint_state(state, task)
        if task is None:
            self.optimizer_steps = trainer_state["optimizer_steps"]
        else:
            self.tasks[task].optimizer_steps = trainer_state["optimizer_steps"]
        scheduler.load_state_dict({**trainer_state["scheduler"], "lr_lambdas": [None]})
        return trainer_state


class _MetricReports:
    """A loss function's metrics over micro-batches: token-weighted sums of means, `*_max` / `*_min`
    extremes and `num_tokens` counts; `reduced` takes them over the data-parallel ranks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.minima: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for key, value in metrics.items():
            if key == "loss":  # the batch loss is the loss sum, summed exactly; not a per-token mean of it
                continue
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device).detach()
            if key == "num_tokens":
                self.sums[key] = self.sums.get(key, 0) + value
            elif key.endswith("_max"):
                self.maxima[key] = torch.maximum(self.maxima[key], value) if key in self.maxima else value
            elif key.endswith("_min"):
                self.minima[key] = torch.minimum(self.minima[key], value) if key in self.minima else value
            else:
                self.sums[key] = self.sums.get(key, 0) + value * weight

    def reduced(self, all_reduce, global_tokens: torch.Tensor) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self.sums.items():
            value = all_reduce(value.clone())
            out[key] = value.item() if key == "num_tokens" else value.item() / max(global_tokens.item(), 1.0)
        for key, value in self.maxima.items():
            out[key] = all_reduce(value.clone(), dist.ReduceOp.MAX).item()
        for key, value in self.minima.items():
            out[key] = all_reduce(value.clone(), dist.ReduceOp.MIN).item()
        return out
