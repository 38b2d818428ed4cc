"""The train step of a trainer's adapters: the gradient of a batch accumulated over micro-batches
(`forward_backward`), then clipping and AdamW with non-finite updates skipped (`optimizer_step`), and
the LR schedule (`advance_schedule`); `train_step` runs the three.

`TrainStep` is a part of `Trainer` (archon.trainer.trainer): it reads the trainer's model, config,
device, dims, routers and adapters, and runs its forward (`_forward_logprobs`, `_micro_batches`,
`sequences_by_adapter`, `_all_reduce`, `_same_on_every_rank`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from archon.batch import PackedBatch
from archon.load_balance import (
    all_reduce_step_counts,
    drop_forward_records,
    load_balance_loss,
    load_imbalance,
    update_correction_biases,
)
from archon.loss_context import LossContext, LossFn, MetricReports, loss_counts
from archon.parallel import reduce_partial_grads
from archon.trainer.config import SINGLE_ADAPTER


class TrainStep:
    """Training methods of `Trainer`."""

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
        global_counts = self._global_counts(batch.to("cpu"), loss_fns)

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
            self._micro_batch_backward(mb, real, loss_fns, global_counts, temperature, with_entropy, loss_sums, reports)
        if self.fsdp:
            self.model.set_requires_gradient_sync(True)
        reduce_partial_grads(self.model)
        out = self._batch_metrics(loss_fns, global_counts, loss_sums, reports, count)
        return out if isinstance(losses, dict) else out[SINGLE_ADAPTER]

    def _global_counts(self, host: PackedBatch, loss_fns: dict[str, LossFn]) -> dict[str, torch.Tensor]:
        """Each adapter's counts over the batch on every data-parallel rank, [3]: loss tokens,
        sequences with any, all tokens. `host`: this rank's batch, on the CPU."""
        by_adapter = self.sequences_by_adapter(host)
        missing = sorted(set(by_adapter) - set(loss_fns))
        if missing:
            raise ValueError(f"the batch has sequences of task(s) {missing} without a loss function")
        counts = torch.zeros(len(self.adapters), 3)
        for index, name in enumerate(self.adapters):
            if name in by_adapter:
                sub = host if not self.multi_task else host.select(by_adapter[name])
                counts[index, :2] = loss_counts(sub.loss_mask, sub.cu_seqlens)
                counts[index, 2] = float(sub.num_tokens)
        counts = self._all_reduce(counts.to(self.device))
        return {name: counts[index] for index, name in enumerate(self.adapters)}

    def _micro_batch_backward(
        self,
        mb: PackedBatch,
        real: bool,
        loss_fns: dict[str, LossFn],
        global_counts: dict[str, torch.Tensor],
        temperature: float,
        with_entropy: bool,
        loss_sums: dict[str, torch.Tensor],
        reports: dict[str, MetricReports],
    ) -> None:
        """One forward and one backward of micro-batch `mb` for every adapter with sequences in it,
        each loss added to `loss_sums` and its metrics to `reports`. A micro-batch that is not `real`
        (a rank with fewer micro-batches than another runs a copy of one) adds nothing."""
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
                loss, metrics = self._add_mtp_loss(loss, metrics, mtp_terms, tokens)
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

    def _batch_metrics(
        self,
        loss_fns: dict[str, LossFn],
        global_counts: dict[str, torch.Tensor],
        loss_sums: dict[str, torch.Tensor],
        reports: dict[str, MetricReports],
        micro_batches: int,
    ) -> dict[str, dict[str, float]]:
        """Each adapter's metrics over the global batch, by name (adapters with no sequence on any
        rank left out in a multi-task trainer)."""
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
                micro_batches=micro_batches,
            )
            out[name] = metrics
        return out

    def _add_load_balance(self, sub: PackedBatch, loss, metrics: dict, aux: torch.Tensor, global_tokens: torch.Tensor):
        """The routers' auxiliary loss of this micro-batch's forward, as the `moe_aux_loss` metric (a
        loss-token mean like the loss function's metrics) and, times moe.aux_loss_coef, added to the
        loss with the micro-batch's share of the batch's loss tokens."""
        coef = self.config.moe.aux_loss_coef
        if coef > 0:
            loss = loss + coef * aux * (sub.loss_mask.sum() / global_tokens.clamp(min=1.0))
        return loss, {**metrics, "moe_aux_loss": aux.detach()}

    def _add_mtp_loss(self, loss, metrics: dict, mtp_terms: tuple, global_tokens: torch.Tensor):
        """The MTP layer's loss terms of this micro-batch's forward (`mtp_step_loss`), times
        mtp_loss_weight over the batch's loss tokens, added to the loss; its mean loss and top-1
        accuracy over its targets as the `mtp_loss` and `mtp_accuracy` metrics."""
        nll_sum, hits, targets = mtp_terms
        loss = loss + self.config.mtp_loss_weight * nll_sum / global_tokens.clamp(min=1.0)
        count = targets.clamp(min=1.0)
        return loss, {**metrics, "mtp_loss": nll_sum.detach() / count, "mtp_accuracy": hits / count}

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
