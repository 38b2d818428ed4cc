"""MoE load balancing: what the routers chose, the auxiliary load-balance loss, and the aux-loss-free
correction-bias update.

A family's routers subclass `Router` and call `self.routing.record(probs, top_indices)` in their
forward in training mode (scoring and generation record nothing). The trainer reads the records after
each micro-batch's forward, and drops them after its backward (`drop_forward_records`):
- `load_balance_loss`: the Switch Transformer loss as HF transformers computes it
  (`load_balancing_loss_func`): E * sum_e f_e * P_e, where f_e is the number of top-k choices of
  expert e per row and P_e the mean routing probability of e, both pooled over the rows of every
  MoE layer. A metric always; added to the training loss (times `MoEConfig.aux_loss_coef`) when the
  coefficient is positive.
- the per-expert token counts of a training step (`RoutingStats.step_counts`, summed over the
  data-parallel ranks), which `update_correction_biases` uses for DeepSeek-V3's aux-loss-free
  balancing: each expert's score-correction bias moves by `bias_update_rate` towards balance,
  bias_e += rate * sign(mean load - load_e).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class MoEConfig:
    """Load balancing of MoE routers while training. Both are off by default (RL post-training keeps
    the routing of the base model)."""

    aux_loss_coef: float = 0.0
    """Weight of the auxiliary load-balance loss added to the training loss (0: only reported, as the
    `moe_aux_loss` metric). HF's `router_aux_loss_coef` (0.001 for Qwen3-MoE) is a usual value."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing for routers with a score-correction bias (DeepSeek-V3, Kimi K2,
    GLM-4.5): after each optimizer step the bias of every overloaded expert drops by this much and
    that of every underloaded one rises (0: the biases stay as loaded). DeepSeek-V3 used 0.001.
    The biases belong to the base model: resume checkpoints keep them, a PEFT adapter does not."""

    def __post_init__(self) -> None:
        for name in ("aux_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"moe.{name}={value!r} must be >= 0")


class RoutingStats:
    """What one router chose. Per forward: `counts` [E] (top-k choices per expert), `probs_sum` [E]
    (routing probabilities summed over the rows; it carries the gradient while training) and `rows`.
    Over a training step: `step_counts` [E], the choices of the micro-batches that were counted."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None
        self.probs_sum: torch.Tensor | None = None
        self.rows = 0
        self.step_counts = torch.zeros(num_experts)

    def record(self, probs: torch.Tensor, top_indices: torch.Tensor) -> None:
        """probs: [T, E] fp32 routing probabilities (rows summing to 1), top_indices: [T, k]."""
        self.counts = torch.bincount(top_indices.reshape(-1), minlength=self.num_experts).float()
        self.probs_sum = probs.sum(dim=0)
        self.rows = probs.shape[0]

    def count_forward(self) -> None:
        """Add the last forward's choices to the step's counts."""
        self.step_counts = self.step_counts.to(self.counts.device) + self.counts

    def reset_step(self) -> None:
        self.step_counts = torch.zeros(self.num_experts)

    def drop_forward(self) -> None:
        """Forget the last forward's record (its `probs_sum` holds that forward's autograd graph)."""
        self.counts = self.probs_sum = None
        self.rows = 0


class Router(nn.Module):
    """Base of MoE routers: `routing` records each forward's choices. Routers whose choice adds a
    per-expert bias (`correction_bias`) can be balanced by `update_correction_biases`."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.routing = RoutingStats(num_experts)
        self.replayed_experts: torch.Tensor | None = None
        """[T, k] expert ids the next forwards use instead of the router's own top-k (-1 rows: the
        router's own choice); set by archon.routing_replay.replayed_routing."""
        self.chosen_experts: list[torch.Tensor] | None = None
        """While recording (archon.routing_replay.recorded_routing): each forward's [T, k] choice."""

    @property
    def correction_bias(self) -> torch.Tensor | None:
        """The [E] bias added to the scores for the choice only (not to the weights), or None."""
        return None


def routers(model: nn.Module) -> list[Router]:
    """The model's MoE routers, in layer order; those of multi-token-prediction layers (`mtp.*`),
    which the model's forward does not run, are not among them."""
    return [
        module for name, module in model.named_modules() if isinstance(module, Router) and not name.startswith("mtp.")
    ]


def load_balance_loss(model_routers: list[Router]) -> torch.Tensor:
    """HF's load_balancing_loss_func over the last forward of every router: E * sum_e f_e * P_e
    (f_e: choices of expert e per row, P_e: mean probability of e, pooled over all layers' rows)."""
    stats = [router.routing for router in model_routers]
    rows = sum(s.rows for s in stats)
    counts = torch.stack([s.counts for s in stats]).sum(0)  # [E]
    probs = torch.stack([s.probs_sum for s in stats]).sum(0)  # [E]
    return stats[0].num_experts * torch.sum((counts / rows) * (probs / rows))


def drop_forward_records(model_routers: list[Router]) -> None:
    """Called after each backward pass. Activation checkpointing runs the forward again inside the
    backward pass, so the routers record once more, and that record would keep the recomputed
    forward's graph (the block's activations up to the router) alive until the next forward."""
    for router in model_routers:
        router.routing.drop_forward()


@torch.no_grad()
def all_reduce_step_counts(model_routers: list[Router], group=None) -> None:
    """Sum every router's step counts over the data-parallel ranks (`group`; None: no reduction)."""
    if group is None or not model_routers:
        return
    counts = torch.stack([router.routing.step_counts for router in model_routers])  # [L, E]
    dist.all_reduce(counts, group=group)
    for router, layer_counts in zip(model_routers, counts):
        router.routing.step_counts = layer_counts


def load_imbalance(model_routers: list[Router]) -> float:
    """The most-loaded expert's step count over the mean count, the largest over the layers (1.0 is
    perfect balance)."""
    worst = 0.0
    for router in model_routers:
        counts = router.routing.step_counts
        if counts.sum() > 0:
            worst = max(worst, (counts.max() / counts.mean()).item())
    return worst


@torch.no_grad()
def update_correction_biases(model_routers: list[Router], rate: float) -> None:
    """Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e) from the step's counts
    (summed over the data-parallel ranks first, so every rank applies the same update)."""
    for router in model_routers:
        bias = router.correction_bias
        counts = router.routing.step_counts.to(bias.device)
        bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)
