"""Gradient norm and clipping over parameters that may be plain tensors or DTensor shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sharded_mesh_dims(grad: DTensor) -> tuple[int, ...]:
    dims = []
    for i, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                "a gradient is still a partial sum (placements "
                f"{grad.placements}); reduce it (archon.parallel.reduce_partial_grads) before taking its norm"
            )
        # Any non-replicated placement splits the tensor across this mesh dim (FSDP under TP uses
        # _StridedShard, which is not a Shard subclass).
        if not placement.is_replicate():
            dims.append(i)
    return tuple(dims)


@torch.no_grad()
def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of all gradients (0-dim; float32, or float64 when the gradients are),
    summing squares across the shards of every DTensor gradient; replicated placements are counted
    once. Squares are summed in at least float32, so bf16 gradients do not round the sum and
    float64 gradients keep their precision."""
    device = None
    plain_sq = None
    sharded: dict[tuple, list] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            mesh_dims = _sharded_mesh_dims(grad)
            local = grad.to_local()
            key = (id(grad.device_mesh), mesh_dims)
            sum_dtype = torch.promote_types(local.dtype, torch.float32)
            total_sq = torch.zeros((), dtype=sum_dtype, device=local.device)
            entry = sharded.setdefault(key, [grad.device_mesh, mesh_dims, total_sq])
            entry[2] = entry[2] + local.to(sum_dtype).pow(2).sum()
            device = local.device
        else:
            sq = grad.to(torch.promote_types(grad.dtype, torch.float32)).pow(2).sum()
            plain_sq = sq if plain_sq is None else plain_sq + sq
            device = grad.device
    if device is None:
        return torch.zeros(())
    total = torch.zeros((), device=device) if plain_sq is None else plain_sq
    for mesh, mesh_dims, sq in sharded.values():
        for dim in mesh_dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (None: only measure). Returns the
    norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    if max_norm is None or max_norm <= 0:
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for param in params:
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
    return norm
