"""Expert parallelism: routed experts split over the `ep` ranks, token slots sent to them by all-to-all.

Each of the `ep` ranks of an expert-parallel group holds num_experts / ep consecutive experts (rank r
holds experts r*E_local .. (r+1)*E_local - 1) of every stacked expert parameter, base weights, biases
and LoRA factors alike, as DTensors with placements (Replicate(), Replicate(), Shard(0)) on the 3-D
mesh (dp_replicate, dp_shard_mod_ep, ep) (see `ParallelDims`). Full tensors (PEFT export, merged
sync, checkpoints) come from the DTensor layout with no special case.

A MoE layer routes its tokens on its own rank, sorts the token slots by expert, and then:
1. exchanges per-expert slot counts with the other ranks of its group (all_to_all_single);
2. sends each slot to the rank holding its expert (all_to_all_single with those split sizes);
3. sorts what it received by local expert and runs its experts (one grouped matmul per projection);
4. sends the results back along the same routes; the router weights and the sum over a token's
   k experts stay on the token's own rank.
The backward pass of a send is the reverse send (`all_to_all`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from archon.grouped_mm import ExpertGroups


class _AllToAll(torch.autograd.Function):
    """Rows of x split by `input_splits` go to the group's ranks in order; `output_splits` rows come
    back from each. Backward sends the gradient along the reverse routes."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(input_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single over dim 0 of x."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The ranks one MoE layer's experts are split over. Rank `rank` holds experts
    rank*num_local_experts .. (rank+1)*num_local_experts - 1."""

    group: dist.ProcessGroup
    size: int
    rank: int
    num_local_experts: int

    def run_experts(
        self,
        compute: Callable[[torch.Tensor, ExpertGroups], torch.Tensor],
        x_sorted: torch.Tensor,
        expert_of_slot: torch.Tensor,
        grouped: bool,
        task_of_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x_sorted: [N, dim] token slots of this rank sorted by (global) expert, expert_of_slot: [N]
        their experts -> [N, out], each slot's expert output computed on the rank holding the expert.
        task_of_slot: [N] each slot's task in a multi-task model (None otherwise); it travels with the
        slot.

        `compute(x [M, dim], groups, task_of_row)` runs the local experts on rows sorted by local
        expert (task_of_row: [M] or None)."""
        num_experts = self.size * self.num_local_experts
        counts = torch.bincount(expert_of_slot, minlength=num_experts)  # [E]: slots per global expert
        # received[s, e]: slots rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        counts, received = counts.view(self.size, -1), received.view(self.size, -1)  # [ep, E_local]
        # The only host sync: all_to_all_single takes its split sizes as Python ints.
        input_splits, output_splits = counts.sum(1).tolist(), received.sum(1).tolist()
        x_recv = all_to_all(x_sorted, output_splits, input_splits, self.group)  # [M, dim] by source rank

        local_experts = torch.arange(self.num_local_experts, device=x_sorted.device).repeat(self.size)
        # output_size: without it repeat_interleave reads the total back from the device (a second sync).
        rows = sum(output_splits)
        local_expert_of_row = local_experts.repeat_interleave(received.reshape(-1), output_size=rows)  # [M]
        order = torch.argsort(local_expert_of_row, stable=True)
        groups = ExpertGroups.from_sorted(local_expert_of_row[order], self.num_local_experts, grouped)
        task_of_row = None
        if task_of_slot is not None:
            task_of_row = all_to_all(task_of_slot, output_splits, input_splits, self.group)[order]
        y_local = compute(x_recv[order], groups, task_of_row)  # [M, out], sorted by local expert
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)  # back in arrival order
        return all_to_all(y_recv, input_splits, output_splits, self.group)


def shard_experts(experts: nn.Module, num_experts: int, expert_mesh) -> None:
    """Split every parameter of `experts` (each stacked on dim 0 over `num_experts`) over the `ep`
    dimension of `expert_mesh`, replicated over the others, and give the module its
    ExpertParallelGroup as `experts.expert_parallel`."""
    ep_mesh = expert_mesh["ep"]
    size = ep_mesh.size()
    ep_dim = expert_mesh.mesh_dim_names.index("ep")
    placements = [Shard(0) if i == ep_dim else Replicate() for i in range(expert_mesh.ndim)]
    for name, param in list(experts.named_parameters()):
        if param.shape[0] != num_experts:
            raise ValueError(
                f"expert parameter {name!r} of shape {tuple(param.shape)} is not stacked over the "
                f"{num_experts} experts on dim 0"
            )
        owner_path, _, leaf = name.rpartition(".")
        owner = experts.get_submodule(owner_path) if owner_path else experts
        sharded = distribute_tensor(param.data, expert_mesh, placements)
        owner.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.expert_parallel = ExpertParallelGroup(
        ep_mesh.get_group(), size, ep_mesh.get_local_rank(), num_experts // size
    )
