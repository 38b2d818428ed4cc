"""Parallel degrees, the DeviceMesh they make, and process-group start-up.

Mesh dimensions, outermost first: dp_replicate, dp_shard_mod_ep, ep, cp, tp, where
dp_shard = dp_shard_mod_ep x ep. Data-parallel ranks (dp_replicate x dp_shard) see different data;
the ranks of one context-parallel or tensor-parallel group see the same data (context-parallel
ranks each run a slice of its tokens, archon/parallel/context_parallel.py). Expert-parallel ranks are data-parallel
ranks too: `ep` is carved out of `dp_shard`, so EP adds no ranks of its own.

Flattened dimensions the rest of the code uses:
- dp_shard = (dp_shard_mod_ep, ep): FSDP2 shards every non-expert parameter over it; with cp > 1,
  dp_shard_cp = (dp_shard_mod_ep, ep, cp) instead (context-parallel ranks hold the same parameters
  and their gradients are summed like data-parallel ones).
- dp = (dp_replicate, dp_shard_mod_ep, ep): all data-parallel ranks (loss and metric reductions).
Routed experts under EP live on the (dp_replicate, dp_shard_mod_ep, ep[, cp]) part of the mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from archon import device as devices

MESH_DIM_NAMES = ("dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


@dataclass
class ParallelDims:
    """Parallel degrees of a run. `dp_shard=-1` takes whatever the other degrees leave of the world.

    dp_replicate: replicas of the sharded model (HSDP when dp_shard > 1 too).
    dp_shard: FSDP2 sharding degree.
    tp: tensor-parallel degree.
    cp: context-parallel degree: each packed batch is split along its tokens over `cp` ranks, which
        trade the token split for a head split inside each token mixer (Ulysses). It must divide
        every mixer's heads per tensor-parallel rank (the family checks).
    ep: expert-parallel degree. It must divide dp_shard: the routed experts (and their LoRA factors)
        are split over `ep` data-parallel ranks, each holding num_experts / ep of them as DTensor
        shards (Shard(0) on the `ep` mesh dimension), and tokens travel to their experts by
        all-to-all. Expert parameters are not FSDP-sharded: they are replicated over the
        dp_replicate x dp_shard / ep ranks that hold the same shard, whose gradients are summed
        (placements (Replicate(), Replicate(), Shard(0)) on `expert_mesh`, gradients Partial ->
        Replicate).
        Everything else (attention, router, shared experts, dense MLPs, embeddings) is FSDP-sharded
        over all of dp_shard as without EP. Tensor-parallel ranks see the same tokens, so under TP
        each keeps a whole copy of its EP shard and runs the same dispatch.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("world_size", "dp_replicate", "tp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name}={value!r} must be a positive integer")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp = "
                    f"{self.dp_replicate}*{self.cp}*{self.tp} = {rest}, so dp_shard=-1 cannot fill it; "
                    f"choose degrees whose product is {self.world_size}"
                )
            self.dp_shard = self.world_size // rest
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"parallel degree dp_shard={self.dp_shard!r} must be a positive integer or -1")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} "
                f"x tp={self.tp} "
                f"= {product}, but the world size is {self.world_size}; their product must equal the world size "
                f"(set dp_shard=-1 to let it take the remainder)"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"parallel degree ep={self.ep} does not divide dp_shard={self.dp_shard}: expert-parallel ranks "
                f"are taken from the FSDP ranks (dp_shard = world size {self.world_size} / (dp_replicate="
                f"{self.dp_replicate} x tp={self.tp})); choose an ep that divides dp_shard"
            )

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks (ranks that see different data)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.dp_replicate > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP ranks per expert-parallel rank: how many data-parallel ranks share one expert shard
        within a replica."""
        return self.dp_shard // self.ep

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @cached_property
    def mesh(self):
        """The 5-D DeviceMesh (dp_replicate, dp_shard_mod_ep, ep, cp, tp) with the flattened
        dimensions dp_shard (dp_shard_cp with cp > 1) and dp; None for a single process."""
        if not self.distributed:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        if self.cp_enabled:
            self._flat_dp_shard_mesh = mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("dp_shard_cp")
        else:
            self._flat_dp_shard_mesh = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        self._flat_dp_mesh = mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        self._flat_same_data_mesh = mesh["cp", "tp"]._flatten("cp_tp")
        return mesh

    @property
    def tp_mesh(self):
        return None if self.mesh is None else self.mesh["tp"]

    @property
    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: 1-D (dp_shard, or dp_shard_cp) or 2-D (dp_replicate,
        dp_shard[_cp]) for HSDP."""
        if self.mesh is None:
            return None
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard_cp" if self.cp_enabled else "dp_shard"]
        return self._flat_dp_shard_mesh

    @property
    def cp_mesh(self):
        return None if self.mesh is None else self.mesh["cp"]

    @property
    def ep_mesh(self):
        return None if self.mesh is None else self.mesh["ep"]

    @property
    def expert_mesh(self):
        """The mesh (dp_replicate, dp_shard_mod_ep, ep[, cp]) routed experts live on: sharded over ep,
        replicated over the data-parallel (and context-parallel) ranks that hold the same shard."""
        if self.mesh is None:
            return None
        if self.cp_enabled:
            return self.mesh["dp_replicate", "dp_shard_mod_ep", "ep", "cp"]
        return self.mesh["dp_replicate", "dp_shard_mod_ep", "ep"]

    @property
    def dp_mesh(self):
        """All data-parallel ranks of this rank's tp coordinate, flattened to 1-D."""
        return None if self.mesh is None else self._flat_dp_mesh

    @property
    def dp_group(self):
        return None if self.mesh is None else self.dp_mesh.get_group()

    @property
    def tp_group(self):
        return None if self.mesh is None or not self.tp_enabled else self.tp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.dp_mesh.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return 0 if self.mesh is None else self.tp_mesh.get_local_rank()

    @property
    def same_data_size(self) -> int:
        """Ranks that are given the same data: the cp x tp ranks of one data-parallel rank."""
        return self.cp * self.tp

    @property
    def same_data_group(self):
        return None if self.mesh is None or self.same_data_size == 1 else self._flat_same_data_mesh.get_group()

    @property
    def same_data_rank(self) -> int:
        return 0 if self.mesh is None else self._flat_same_data_mesh.get_local_rank()


def init_distributed(device_kind: str = "auto") -> tuple[torch.device, int, int]:
    """Start the default process group when launched by torchrun (WORLD_SIZE > 1).

    Returns (this rank's device, rank, world size); a plain single process gets (device, 0, 1).
    """
    device = devices.local_device(device_kind)
    devices.set_local_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=devices.collective_backend(device.type))
    if dist.is_initialized():
        return device, dist.get_rank(), dist.get_world_size()
    return device, 0, 1


def require_divisible(degree_name: str, degree: int, family: str, **sizes: int) -> None:
    """Fail naming every model size (a config field) that `degree` does not divide."""
    bad = [f"{name}={size}" for name, size in sizes.items() if size % degree]
    if bad:
        raise ValueError(
            f"{degree_name}={degree} does not divide {', '.join(bad)} of this {family} model; "
            f"choose a {degree_name} degree that divides each of them"
        )
