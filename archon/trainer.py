"""The trainer: what the RL loop uses of a built model.

`Trainer` gives `logprobs` (policy, or reference with the adapter off) and `train_step`
(micro-batches by token budget, accumulation, clipping, AdamW, LR schedule, and skipping any
update whose loss or gradient is not finite), plus resume checkpoints and PEFT export, which
refuse to write NaN or inf.

With `TrainerConfig.tasks` it trains several adapters (multi-LoRA) on the one frozen base: each
task has its own LoRA config, AdamW, LR schedule and optimizer-step count (archon.optim). A packed
batch then mixes tasks (`extras["task"]`, each token's task index) and `train_step` takes one loss
function per task and steps each task's optimizer on its own (a non-finite task is skipped alone);
checkpoints and PEFT exports are per task (`task=`). One adapter is the case of one task.

Data layout: every data-parallel rank passes its own PackedBatch; the ranks of one tensor-parallel
group pass the same one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from archon import device as devices
from archon.batch import PackedBatch
from archon.build import build_model
from archon.checkpoint.resume import lora_settings
from archon.head import DEFAULT_CHUNK_SIZE, full_vocab_logits, label_logprobs, model_label_logprobs
from archon.load_balance import (
    MoEConfig,
    all_reduce_step_counts,
    drop_forward_records,
    load_balance_loss,
    load_imbalance,
    routers,
    update_correction_biases,
)
from archon.lora import (
    LoRAConfig,
    adapter_disabled,
    adapter_routing,
    task_parameters,
    task_view,
)
from archon.lora.peft import save_peft_adapter
from archon.loss_context import LossContext, LossFn, MetricReports, loss_counts
from archon.optim import AdapterOptimizer, OptimConfig
from archon.parallel import ParallelConfig, init_distributed, reduce_partial_grads
from archon.parallel.context_parallel import TokenSlice, context_parallel_group
from archon.parallel.parallelize import DTYPES, DTypeName
from archon.routing_replay import replayed_routing

SINGLE_ADAPTER = ""
"""The name of a single-adapter trainer's adapter (Trainer.adapters)."""


@dataclass
class TrainerTask:
    """One adapter of a multi-task trainer."""

    name: str
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


ROUTED_EXPERTS_EXTRA = "routed_experts"
"""PackedBatch.extras key of the expert ids to replay: [T, L_moe, k] (int16; -1 rows: the router's
own choice). A batch that carries it is scored and trained with every MoE router taking these ids
instead of its own top-k (archon.routing_replay.replayed_routing)."""

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
    """Base-weight dtype. LoRA factors are fp32, or fp64 under a float64 base (the arithmetic equality
    tests compare in, with archon.precision.fp32_islands_in_fp64). Use float32 on CPU."""
    quantized_base: Literal["keep", "dequantize"] = "keep"
    """For an FP8 or MXFP4 checkpoint: keep its weights quantized and frozen, dequantized per GEMM
    (keep), or dequantize them into `dtype` as they load (dequantize)."""
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
    mtp: bool = False
    """Build and load the checkpoint's multi-token-prediction layers (model.mtp; see docs/mtp.md)."""
    mtp_loss_weight: float = 0.0
    """> 0: train the MTP layer beside the loss function, with this weight on its cross-entropy of
    token t+2 from the hidden state at t and token t+1, at the loss-mask positions (`mtp_step_loss`);
    its blocks get the model's LoRA (full fine-tuning: all its weights train). Needs `mtp`."""


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------


@dataclass
class LogprobOutput:
    logprobs: torch.Tensor
    """[T] fp32: log p(labels[t]) at loss_mask positions, 0 elsewhere."""
    entropy: torch.Tensor | None = None
    """[T] fp32 entropy of the next-token distribution at loss_mask positions, 0 elsewhere."""


def mtp_step_loss(model, hidden: torch.Tensor, batch: PackedBatch, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """The MTP layer's auxiliary loss terms on a packed batch: at each position t whose next position
    is trained (loss_mask[t + 1], in the same sequence), the MTP layer predicts token t+2 (labels[t+1])
    from the main model's final hidden state at t and token t+1, with the hidden state, the embedding
    and the output head detached: the auxiliary loss trains the MTP layer, never the policy. Returns
    (sum of -log p over those targets, with gradient; top-1 hits; target count), the latter two
    without gradient. hidden: [T, D] `return_hidden` states."""
    T = batch.tokens.shape[0]
    starts = torch.zeros(T, dtype=torch.bool, device=hidden.device)
    starts[batch.cu_seqlens[:-1].long()] = True
    next_trained = torch.zeros(T, dtype=torch.bool, device=hidden.device)
    next_trained[:-1] = batch.loss_mask[1:].bool() & ~starts[1:]
    rows = next_trained.nonzero()[:, 0]
    targets = batch.labels[rows + 1]
    mtp_hidden = model.mtp_hidden(
        hidden.detach(),
        torch.roll(batch.tokens, -1),
        batch.positions,
        batch.cu_seqlens,
        batch.max_seqlen,
        embed=lambda ids: model.embed_tokens(ids).detach(),
    )[rows]
    output_weight = model.output_weight.detach()
    logprobs, _ = label_logprobs(mtp_hidden, output_weight, targets, 1.0, chunk_size)
    with torch.no_grad():
        hits = torch.zeros((), device=hidden.device)
        for start in range(0, rows.shape[0], chunk_size):
            chunk = slice(start, start + chunk_size)
            hits += (full_vocab_logits(mtp_hidden[chunk], output_weight).argmax(-1) == targets[chunk]).sum()
    return -logprobs.sum(), hits, torch.tensor(float(rows.shape[0]), device=hidden.device)


class NonFiniteError(RuntimeError):
    """A loss, gradient or trainable tensor is NaN or infinite where only a finite value will do."""


class Trainer:
    """A model ready to score and train, on this rank's share of the devices.

    Under torchrun the process group is started from the environment; a plain process runs alone.
    Every adapter (one, or one per TrainerConfig.tasks entry) has its own AdamW and LR schedule
    (`adapters`, by name; the single adapter's name is "").
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
        self._check_mtp_config(config)
        loaded = build_model(
            config.model_path,
            lora=config.lora,
            dtype=DTYPES[config.dtype],
            device=self.device,
            parallel=config.parallel,
            dims=self.dims,
            seed=config.seed,
            task_loras={task.name: task.lora for task in config.tasks} if config.tasks else None,
            quantized_base=config.quantized_base,
            mtp=config.mtp,
            mtp_lora=config.mtp_loss_weight > 0,
        )
        if (
            loaded.quant_format is not None
            and config.quantized_base == "keep"
            and config.lora is None
            and not config.tasks
        ):
            raise ValueError(
                f"{config.model_path!r} is a {loaded.quant_format} checkpoint, kept quantized and frozen "
                "(model.quantized_base='keep'), so full fine-tuning (lora=None) has nothing to train; train a LoRA "
                "adapter, or set model.quantized_base='dequantize'"
            )
        self.loaded = loaded
        self.model = loaded.model
        self.converter = loaded.converter
        self.lora = config.lora
        self.multi_task = bool(config.tasks)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.task_loras: dict[str, LoRAConfig] = {}
        self.adapters: dict[str, AdapterOptimizer] = {}
        """Each adapter's parameters, AdamW and schedule by name, in routing order."""
        for task in config.tasks:
            self.task_loras[task.name] = task.lora
            self.adapters[task.name] = AdapterOptimizer(
                list(task_parameters(self.model, task.name).values()), task.optim
            )
        if not config.tasks:
            self.adapters[SINGLE_ADAPTER] = AdapterOptimizer(self.trainable, config.optim)
        self.routers = routers(self.model)
        self._check_moe_config(config.moe)
        self.context_parallel = context_parallel_group(self.dims)

    # ---- the single adapter's optimizer state (a trainer without tasks) -------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._adapter(None)[1].optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self._adapter(None)[1].scheduler

    @property
    def optimizer_steps(self) -> int:
        return self._adapter(None)[1].steps

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
        if self.dims.cp_enabled and (moe.aux_loss_coef > 0 or moe.bias_update_rate > 0):
            # each context-parallel rank routes only its slice of the tokens
            raise ValueError(
                f"MoE load balancing (moe.aux_loss_coef, moe.bias_update_rate) is not supported with "
                f"parallel.cp={self.dims.cp}; leave both at 0"
            )

    def _check_mtp_config(self, config: TrainerConfig) -> None:
        weight = config.mtp_loss_weight
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"mtp_loss_weight={weight}: must be a finite number >= 0")
        if weight == 0:
            return
        if not config.mtp:
            raise ValueError(f"mtp_loss_weight={weight} trains the MTP layers, which are not loaded (mtp=False)")
        if config.tasks:
            raise ValueError(f"mtp_loss_weight={weight}: training the MTP layer is not supported with several tasks")
        if self.dims.cp > 1:
            raise ValueError(
                f"mtp_loss_weight={weight} with context parallelism (cp={self.dims.cp}): the MTP layer reads the token "
                "after each position, which may lie in another rank's slice; set parallel.cp to 1"
            )

    def _lora(self, name: str) -> LoRAConfig | None:
        """The LoRA config of adapter `name` (`lora` for a single-adapter trainer)."""
        return self.task_loras[name] if self.multi_task else self.lora

    def _adapter(self, task: str | None) -> tuple[str, AdapterOptimizer]:
        """(name, optimizer state) of `task`'s adapter; None names the single adapter of a trainer
        without tasks."""
        if task is None:
            if self.multi_task:
                raise ValueError(f"a multi-task trainer needs task= (one of {list(self.adapters)})")
            task = SINGLE_ADAPTER
        if task not in self.adapters:
            raise ValueError(f"unknown task {task!r}; the trainer's adapters are {list(self.adapters)}")
        return task, self.adapters[task]

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

    def _routing(self, batch: PackedBatch, tokens_of: TokenSlice | None = None):
        """Each token's adapter (of this rank's slice under context parallelism), for a multi-task
        model (nothing to do for one adapter)."""
        if not self.multi_task:
            return contextlib.nullcontext()
        if TASK_EXTRA not in batch.extras:
            raise ValueError(
                f"a multi-task trainer needs each token's task: PackedBatch.extras[{TASK_EXTRA!r}] ([T] task indices "
                f"into {list(self.adapters)})"
            )
        task_of_token = batch.extras[TASK_EXTRA]
        return adapter_routing(self.model, task_of_token if tokens_of is None else tokens_of.local(task_of_token))

    def _forward_logprobs(self, batch: PackedBatch, temperature: float, with_entropy: bool, mtp: bool = False):
        """[T] log-probs (and entropies) of the labels at the loss-mask positions, 0 elsewhere. With
        context parallelism this rank runs its slice of the tokens and the slices are gathered.
        mtp: also the MTP layer's (negative log-likelihood sum, top-1 hits, targets) on this batch
        (`mtp_step_loss`), returned third; else None."""
        tokens, positions, cu_seqlens, max_seqlen = batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen
        labels, loss_mask = batch.labels, batch.loss_mask
        tokens_of = None
        if self.context_parallel is not None:
            tokens_of = TokenSlice.of(cu_seqlens, self.context_parallel)
            tokens, labels, loss_mask = tokens_of.local(tokens), tokens_of.local(labels), tokens_of.local(loss_mask)
            positions, cu_seqlens, max_seqlen = (
                tokens_of.local_positions(positions),
                tokens_of.cu_seqlens,
                tokens_of.max_seqlen,
            )
        index = loss_mask.nonzero()[:, 0]
        experts = batch.extras.get(ROUTED_EXPERTS_EXTRA)
        if experts is not None and tokens_of is not None:
            experts = tokens_of.local(experts, fill=-1)
        mtp_terms = None
        with self._routing(batch, tokens_of), replayed_routing(self.model, experts):
            if mtp:
                hidden = self.model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
                lp, ent = label_logprobs(
                    hidden[index],
                    self.model.output_weight,
                    labels[index],
                    temperature,
                    self.config.head_chunk_size,
                    with_entropy,
                )
                mtp_terms = mtp_step_loss(self.model, hidden, batch, self.config.head_chunk_size)
            else:
                lp, ent = model_label_logprobs(
                    self.model,
                    tokens,
                    positions,
                    cu_seqlens,
                    max_seqlen,
                    index,
                    labels[index],
                    temperature,
                    self.config.head_chunk_size,
                    with_entropy,
                    context_parallel=self.context_parallel,
                )
        T = tokens.shape[0]
        logprobs = torch.zeros(T, dtype=lp.dtype, device=lp.device).index_copy(0, index, lp)
        entropy = None
        if with_entropy:
            entropy = torch.zeros(T, dtype=ent.dtype, device=lp.device).index_copy(0, index, ent)
        if tokens_of is not None:
            logprobs = tokens_of.gather(logprobs)
            entropy = None if entropy is None else tokens_of.gather(entropy)
        return logprobs, entropy, mtp_terms

    def sequences_by_adapter(self, batch: PackedBatch) -> dict[str, list[int]]:
        """The sequences of `batch` by the adapter that trains them (adapters with none left out):
        all of them for a single-adapter trainer; by `extras["task"]` in a multi-task one."""
        if not self.multi_task:
            return {SINGLE_ADAPTER: list(range(batch.num_sequences))}
        first_token_task = batch.extras[TASK_EXTRA][batch.cu_seqlens[:-1].long()].tolist()
        names = list(self.adapters)
        chosen: dict[str, list[int]] = {}
        for sequence, index in enumerate(first_token_task):
            chosen.setdefault(names[index], []).append(sequence)
        return chosen

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
        if not use_adapter and self.lora is None and not self.multi_task:
            raise ValueError("use_adapter=False needs a LoRA model; this trainer trains every parameter")
        micro, count = self._micro_batches(batch)
        was_training = self.model.training
        self.model.eval()
        lps, ents = [], []
        try:
            with contextlib.nullcontext() if use_adapter else adapter_disabled(self.model):
                for i in range(count):
                    lp, ent, _ = self._forward_logprobs(micro[min(i, len(micro) - 1)], temperature, with_entropy)
                    if i < len(micro):
                        lps.append(lp)
                        ents.append(ent)
        finally:
            self.model.train(was_training)
            if self.fsdp:
                self.model.reshard()
        return LogprobOutput(torch.cat(lps).cpu(), torch.cat(ents).cpu() if with_entropy else None)

    # ---- training -----------------------------------------------------------------------------
    def _losses_by_adapter(self, losses: LossFn | dict[str, LossFn]) -> dict[str, LossFn]:
        if isinstance(losses, dict):
            unknown = sorted(set(losses) - set(self.adapters))
            if unknown:
                raise ValueError(f"losses for unknown adapter(s) {unknown}; the trainer's are {list(self.adapters)}")
            return losses
        if self.multi_task:
            raise ValueError(
                f"a multi-task trainer takes one loss function per task: a dict over {list(self.adapters)}"
            )
        return {SINGLE_ADAPTER: losses}

    def forward_backward(
        self,
        batch: PackedBatch,
        losses: LossFn | dict[str, LossFn],
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> dict[str, Any]:
        """Accumulate the gradient of the whole batch's loss (no optimizer step).

        `losses`: the loss function (one adapter), or each adapter's by name. Every adapter's loss
        is its own function on its own sequences, normalised by its own counts over the batch on
        every data-parallel rank (LossContext), so its gradient is exactly its single-adapter
        gradient; one forward and one backward serve them all. In a multi-task trainer a loss that
        is not finite is replaced in the backward by a term with zero gradient (a NaN would reach
        every adapter's gradient; the backward itself must still run for FSDP's collectives), and
        that adapter's update is then skipped. Returns the metrics of the batch (one adapter) or of
        each adapter with sequences in it, by name."""
        loss_fns = self._losses_by_adapter(losses)
        self.model.train()
        micro, count = self._micro_batches(batch)
        host = batch.to("cpu")
        by_adapter = self.sequences_by_adapter(host)
        missing = sorted(set(by_adapter) - set(loss_fns))
        if missing:
            raise ValueError(f"the batch has sequences of task(s) {missing} without a loss function")
        # [adapters, 3]: loss tokens, sequences with any, all tokens; summed over the data-parallel ranks
        counts = torch.zeros(len(self.adapters), 3)
        for index, name in enumerate(self.adapters):
            if name in by_adapter:
                sub = host if not self.multi_task else host.select(by_adapter[name])
                counts[index, :2] = loss_counts(sub.loss_mask, sub.cu_seqlens)
                counts[index, 2] = float(sub.num_tokens)
        counts = self._all_reduce(counts.to(self.device))
        global_counts = {name: counts[index] for index, name in enumerate(self.adapters)}

        for adapter in self.adapters.values():
            adapter.zero_grad()
        for router in self.routers:
            router.routing.reset_step()
        loss_sums = {name: torch.zeros((), device=self.device) for name in loss_fns}
        reports = {name: MetricReports(self.device) for name in loss_fns}
        for i in range(count):
            real = i < len(micro)
            mb = micro[i] if real else min(micro, key=lambda b: b.num_tokens)
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == count - 1)
            mtp_weight = self.config.mtp_loss_weight
            logprobs, entropy, mtp_terms = self._forward_logprobs(mb, temperature, with_entropy, mtp=mtp_weight > 0)
            aux = load_balance_loss(self.routers) if self.routers else None
            total = None
            for name, sequences in self.sequences_by_adapter(mb).items():
                sub, lp, ent = mb, logprobs, entropy
                if self.multi_task:
                    bounds = mb.cu_seqlens.tolist()
                    rows = torch.cat([torch.arange(bounds[s], bounds[s + 1]) for s in sequences]).to(logprobs.device)
                    sub, lp, ent = mb.select(sequences), logprobs[rows], None if entropy is None else entropy[rows]
                tokens, sequence_count = global_counts[name][0].clone(), global_counts[name][1].clone()
                ctx = LossContext(tokens, sequence_count, temperature, ent, self.dims.dp)
                loss, metrics = loss_fns[name](sub, lp, ctx)
                if aux is not None:
                    loss, metrics = self._add_load_balance(sub, loss, metrics, aux, tokens)
                if mtp_terms is not None:
                    nll_sum, hits, targets = mtp_terms
                    loss = loss + mtp_weight * nll_sum / tokens.clamp(min=1.0)
                    count = targets.clamp(min=1.0)
                    metrics = {**metrics, "mtp_loss": nll_sum.detach() / count, "mtp_accuracy": hits / count}
                if not real:
                    # Keeps this rank's collectives in step with ranks that have more micro-batches.
                    loss = loss * 0.0
                else:
                    loss_sums[name] = loss_sums[name] + loss.detach().float()  # not in place: fp64 stays fp64
                    reports[name].add(metrics, float(sub.loss_mask.sum()))
                if self.multi_task and not bool(torch.isfinite(loss.detach())):
                    loss = lp.sum() * 0.0  # the backward still runs (FSDP's collectives), with no gradient
                total = loss if total is None else total + loss
            total.backward()
            if real:
                for router in self.routers:
                    router.routing.count_forward()
            drop_forward_records(self.routers)
        if self.fsdp:
            self.model.set_requires_gradient_sync(True)
        reduce_partial_grads(self.model)

        shared: dict[str, float] = {}
        if self.routers:
            all_reduce_step_counts(self.routers, self.dims.dp_group if self.dims.dp > 1 else None)
            shared["moe_load_imbalance"] = load_imbalance(self.routers)
        out: dict[str, dict[str, float]] = {}
        for name in loss_fns:  # the same on every rank: the collectives below run in step
            tokens = global_counts[name][0]
            if self.multi_task and tokens.item() == 0:
                continue  # no sequence of this task on any rank
            metrics = {"loss": self._all_reduce(loss_sums[name]).item()}
            metrics.update(reports[name].reduced(self._all_reduce, tokens))
            metrics.update(shared)
            metrics.update(
                tokens=tokens.item(),
                sequences=global_counts[name][1].item(),
                total_tokens=global_counts[name][2].item(),
                micro_batches=count,
            )
            out[name] = metrics
        return out if isinstance(losses, dict) else out[SINGLE_ADAPTER]

    def _add_load_balance(self, sub: PackedBatch, loss, metrics: dict, aux: torch.Tensor, global_tokens: torch.Tensor):
        """The routers' auxiliary loss of this micro-batch's forward, as the `moe_aux_loss` metric (a
        loss-token mean like the loss function's metrics) and, times moe.aux_loss_coef, added to the
        loss with the micro-batch's share of the batch's loss tokens."""
        coef = self.config.moe.aux_loss_coef
        if coef > 0:
            loss = loss + coef * aux * (sub.loss_mask.sum() / global_tokens.clamp(min=1.0))
        return loss, {**metrics, "moe_aux_loss": aux.detach()}

    def _same_on_every_rank(self, flag: bool) -> bool:
        """True when `flag` is true on any rank of the job."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def optimizer_step(self, loss: float | None = None, task: str | None = None) -> dict[str, float]:
        """Clip and step the AdamW of `task`'s adapter (the single adapter by default), unless `loss`
        (its global batch loss) or its global gradient norm is NaN or infinite: then the gradient is
        dropped and the parameters and the optimizer state (moments and AdamW's step count) stay as
        they were. Every rank takes the same decision. The LR schedule does not move here (see
        advance_schedule).

        Returns grad_norm (before clipping), the lr and skipped (1.0 for a skipped update).
        """
        _, adapter = self._adapter(task)
        lr = adapter.lr
        norm = adapter.clip()
        finite = math.isfinite(norm) and (loss is None or math.isfinite(loss))
        skipped = self._same_on_every_rank(not finite)
        if not skipped:
            adapter.step()
            if self.config.moe.bias_update_rate > 0:
                update_correction_biases(self.routers, self.config.moe.bias_update_rate)
        adapter.zero_grad()
        return {"grad_norm": norm, "lr": lr, "skipped": float(skipped)}

    def advance_schedule(self, task: str | None = None) -> None:
        """Move the LR schedule of `task`'s adapter (the single adapter by default) on by one
        training step, whether or not the step's updates were skipped (AdapterOptimizer.advance_schedule)."""
        self._adapter(task)[1].advance_schedule()

    def train_step(
        self,
        batch: PackedBatch,
        losses: LossFn | dict[str, LossFn],
        temperature: float = 1.0,
        with_entropy: bool = False,
        advance_schedule: bool = True,
    ) -> dict[str, Any]:
        """One optimizer step on `batch` (this rank's share) of every adapter with sequences in it,
        each skipped alone when its loss or gradient norm is not finite (see optimizer_step).

        `losses`: loss_fn(micro_batch, logprobs[T], ctx) -> (loss, metrics) for the single adapter,
        or one per adapter by name (a multi-task batch says each token's task in extras["task"]).
        logprobs carry the gradient and are 0 outside micro_batch.loss_mask; the loss is the
        micro-batch's share of the batch loss (see LossContext). Metrics are per-micro-batch token
        means (weighted by loss tokens in the report), `*_max` / `*_min` extremes, or `num_tokens`
        (summed).

        advance_schedule=False leaves the LR schedules where they are, for a training step made of
        several updates (the RL loop's minibatches and PPO epochs); call advance_schedule() after
        the last one.

        Returns loss, grad_norm, lr, skipped, tokens (loss tokens), sequences, total_tokens,
        micro_batches, optimizer_steps, time_s and the loss function's metrics, all over the global
        batch: of the single adapter, or of each adapter stepped, by name.
        """
        start = time.perf_counter()
        out = self.forward_backward(batch, losses, temperature, with_entropy)
        by_adapter = out if isinstance(losses, dict) else {SINGLE_ADAPTER: out}
        for name, metrics in by_adapter.items():
            metrics.update(self.optimizer_step(metrics["loss"], name))
            if advance_schedule:
                self.advance_schedule(name)
            metrics["optimizer_steps"] = self.adapters[name].steps
            metrics["time_s"] = time.perf_counter() - start
        return out

    def _view(self, task: str | None):
        """The model as `task`'s single-adapter model (the model itself for one adapter)."""
        return task_view(self.model, task) if self.multi_task else contextlib.nullcontext()

    # ---- adapters and checkpoints ---------------------------------------------------------------
    def _first_non_finite(self, optimizer_state: bool, optimizer) -> str | None:
        """This rank's first trainable parameter (or, with optimizer_state, AdamW state tensor of
        one) that holds NaN or inf, by name; None when all are finite."""
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            tensors = [(name, param)]
            if optimizer_state:
                state = optimizer.state.get(param, {})
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
        name, adapter = self._adapter(task)
        with self._view(name):
            bad = self._first_non_finite(optimizer_state, adapter.optimizer)
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
        self,
        out_dir: str | os.PathLike,
        base_model_name_or_path: str | None = None,
        task: str | None = None,
        model_card: str | None = None,
    ) -> Path:
        """Write the adapter (of `task`, in a multi-task trainer: an adapter that loads alone) in PEFT
        format (gathered from all shards; rank 0 writes), with `model_card` as its README.md when
        given (rank 0's). Refuses (NonFiniteError) an adapter with NaN or inf values."""
        name, _ = self._adapter(task)
        lora = self._lora(name)
        if lora is None:
            raise ValueError("export_peft needs a LoRA model; this trainer trains every parameter")
        self.check_finite(f"PEFT adapter {str(out_dir)!r}", optimizer_state=False, task=task)
        with self._view(name):
            path = save_peft_adapter(
                self.model,
                self.converter,
                lora,
                out_dir,
                base_model_name_or_path or str(self.loaded.path),
                write=self.rank == 0,
                model_card=model_card,
            )
        if dist.is_initialized():
            dist.barrier()
        return path

    def checkpoint_state(self, task: str | None = None) -> dict[str, Any]:
        """The trainable parameters and optimizer state (of `task` alone, under its single-adapter
        names, in a multi-task trainer), as DCP state dicts (sharded where the model is)."""
        name, adapter = self._adapter(task)
        with self._view(name):
            model_state, optim_state = get_state_dict(
                self.model, adapter.optimizer, options=StateDictOptions(ignore_frozen_params=True)
            )
        return {"model": model_state, "optimizer": optim_state}

    def load_checkpoint_state(self, state: dict[str, Any], task: str | None = None) -> None:
        name, adapter = self._adapter(task)
        with self._view(name):
            set_state_dict(
                self.model,
                adapter.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                # Frozen base weights are not in the checkpoint; dcp.load has already failed on any
                # trainable key missing from it.
                options=StateDictOptions(ignore_frozen_params=True, strict=False),
            )

    def save_checkpoint(self, manager, step: int, data_state: dict | None = None, task: str | None = None) -> Path:
        """Save a resume checkpoint for training step `step` (the RL step in the loop; it names the
        checkpoint) through a CheckpointManager. Refuses (NonFiniteError) a state with NaN or inf.
        In a multi-task trainer, `task`'s checkpoint: its adapter, optimizer and schedule alone
        (give each task its own manager, i.e. directory)."""
        name, adapter = self._adapter(task)
        self.check_finite(f"checkpoint for step {step}" + (f" of task {task!r}" if task else ""), task=task)
        trainer_state = {
            "step": step,
            "optimizer_steps": adapter.steps,
            "scheduler": adapter.schedule_state(),
            "data": data_state or {},
            "lora": lora_settings(self._lora(name)),
        }
        return manager.save(step, self.checkpoint_state(task), trainer_state)

    def load_checkpoint(self, manager, path: str | os.PathLike | None = None, task: str | None = None) -> dict | None:
        """Resume from `path` (default: the manager's latest). Returns the whole trainer state
        (`step`, `optimizer_steps`, `scheduler`, `data`, `lora`), or None when there is no checkpoint.
        A checkpoint trained with another LoRA config (rank, alpha, targets, ...) is refused, naming
        the differences; dropout may change. With `task`: that task's checkpoint, into its adapter
        alone (the other tasks are untouched)."""
        path = manager.latest() if path is None else Path(path)
        if path is None:
            return None
        name, adapter = self._adapter(task)
        state = self.checkpoint_state(task)
        trainer_state = manager.load(path, state, expected={"lora": lora_settings(self._lora(name))})
        self.load_checkpoint_state(state, task)
        adapter.steps = trainer_state["optimizer_steps"]
        adapter.load_schedule_state(trainer_state["scheduler"])
        return trainer_state
