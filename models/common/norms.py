from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from archon.parallel.tensor_parallel import local_tensor


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled after casting back (the HF order of operations).

    scale_in_fp32: scale the fp32 normalized values, then cast back (OLMo 2/3's order).
    """

    def __init__(self, dim: int, eps: float = 1e-6, scale_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole attention projection, [T, H * D] (OLMo 2/3's q_norm and k_norm, not per
    head), scaled in fp32 and then cast back; with `scale_in_fp32=False` cast back, then scaled
    (MiniMax-M2's).

    Under tensor parallelism the column-parallel projection leaves each rank the columns of its
    heads, and the weight is sharded with them (a DTensor, Shard(0)): the mean of squares is then
    the sum over every rank's columns (an all-reduce over the weight's mesh) divided by the full
    width. Without it the weight is a plain tensor and the norm is the usual one.
    """

    def __init__(self, dim: int, eps: float, scale_in_fp32: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim], or [T, dim / tp] (this rank's columns) when the weight is sharded."""
        h = x.float()
        sum_of_squares = h.pow(2).sum(-1, keepdim=True)
        if isinstance(self.weight, DTensor) and self.weight.placements[0].is_shard():
            # differentiable: the backward sums the gradient over the group as well
            sum_of_squares = funcol.all_reduce(sum_of_squares, "sum", self.weight.device_mesh.get_group())
        full_width = self.weight.shape[0]  # the global width, a DTensor's too
        h = h * torch.rsqrt(sum_of_squares / full_width + self.eps)
        if not self.scale_in_fp32:
            return local_tensor(self.weight) * h.to(x.dtype)
        return (local_tensor(self.weight) * h).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight) in fp32, then cast back (a zero-centred norm: Qwen3.5, Qwen3-Next)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """weight * RMSNorm(x), cast back to x's dtype, times activation(gate) in fp32.

    gate_activation: silu (Qwen3.5, Qwen3-Next) or sigmoid (Kimi Linear's output gate)."""

    def __init__(self, dim: int, eps: float, gate_activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.eps = eps
        self.gate_activation = gate_activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * self.gate_activation(gate.float())).to(x.dtype)
