"""`Trainer`: a built model ready to score and train; what the RL loop uses of it.

Its scoring (`logprobs`) and the forward that training shares are here; the train step is
archon.trainer.training, the checkpoints and PEFT export archon.trainer.checkpoints.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from archon import device as devices
from archon.batch import PackedBatch
from archon.build import build_model
from archon.distributed import true_on_any_rank
from archon.head import DEFAULT_CHUNK_SIZE, full_vocab_logits, label_logprobs, model_label_logprobs
from archon.load_balance import MoEConfig, routers
from archon.lora import LoRAConfig, adapter_disabled, adapter_routing, task_parameters
from archon.optim import AdapterOptimizer
from archon.parallel import init_distributed
from archon.parallel.context_parallel import TokenSlice, context_parallel_group
from archon.parallel.parallelize import DTYPES
from archon.routing_replay import replayed_routing
from archon.trainer.checkpoints import AdapterCheckpoints
from archon.trainer.config import ROUTED_EXPERTS_EXTRA, SINGLE_ADAPTER, TASK_EXTRA, TrainerConfig
from archon.trainer.training import TrainStep


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


class Trainer(TrainStep, AdapterCheckpoints):
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

    def _same_on_every_rank(self, flag: bool) -> bool:
        """True when `flag` is true on any rank of the job."""
        return true_on_any_rank(flag, self.device)
