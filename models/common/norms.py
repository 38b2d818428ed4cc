import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from archon.parallel.tensor_parallel import ShardedParameters, local_tensor


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled after casting back (the HF order of operations)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class _SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over a process group; its gradient is summed over the group as well, since each
    rank's loss sees the sum only through its own shard."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole attention projection x [T, heads * head_dim], every head's features in
    one mean of squares, with a weight per feature (MiniMax-M2's q_norm and k_norm).

    Under tensor parallelism (`projection_sharded_norm()`) x and the weight hold this rank's heads:
    the sum of squares is summed over the tensor-parallel group before the mean, so every rank
    normalises by the statistic of the whole projection.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.dim = dim
        self.tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return super().forward(x)
        dtype = x.dtype
        h = x.float()
        sum_of_squares = _SumOverGroup.apply(h.pow(2).sum(-1, keepdim=True), self.tp_group)
        h = h * torch.rsqrt(sum_of_squares / self.dim + self.eps)
        return local_tensor(self.weight) * h.to(dtype)


class ProjectionShardedNorm(ShardedParameters):
    """A `ProjectionRMSNorm` on a column-parallel projection: its weight sharded as the projection's
    features (Shard(0)), its statistic reduced over the tensor-parallel group."""

    def __init__(self) -> None:
        super().__init__({"weight": Shard(0)})

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, ProjectionRMSNorm):
            raise TypeError(f"ProjectionShardedNorm applies to ProjectionRMSNorm, not {type(module).__name__}")
        super()._apply(module, device_mesh)
        module.tp_group = device_mesh.get_group()
        return module


def projection_sharded_norm() -> ProjectionShardedNorm:
    return ProjectionShardedNorm()


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
    """weight * RMSNorm(x), cast back to x's dtype, times silu(gate) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
