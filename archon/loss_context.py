"""What a loss function is given beside its micro-batch (LossContext), and how its metrics are
gathered over micro-batches and data-parallel ranks (MetricReports)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from archon.batch import PackedBatch


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


LossFn = Callable[[PackedBatch, torch.Tensor, LossContext], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


class MetricReports:
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
            value = torch.as_tensor(value, device=self.device).detach()
            value = value.to(torch.promote_types(value.dtype, torch.float32))  # fp32, or fp64 for fp64 values
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
