"""A process group outside torch.distributed's default group: a TCPStore plus the device's backend.

Trainer rank 0 (rank 0 here, hosting the store) and every rollout worker (ranks 1..N) join it; it
lives beside whatever groups either side already runs (FSDP on the trainer, TP inside vLLM).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def _make_backend(backend: str, store, rank: int, world_size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":
        try:
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except ImportError as e:
            raise RuntimeError("backend 'hccl' needs torch_npu, which is not importable here") from e
        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"unknown collective backend {backend!r}; expected gloo, nccl or hccl")


class StatelessGroup:
    """Rank 0 hosts the TCPStore. Create the store first (`host_store`) when the other ranks are
    started by a request that must already be under way before rank 0 blocks in `__init__`."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        store: dist.TCPStore | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a sync group needs at least 2 ranks, got world_size={world_size}")
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        self.store = store
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self.group = _make_backend(backend, dist.PrefixStore("archon_sync", store), rank, world_size, timeout)

    @staticmethod
    def host_store(host: str, port: int, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
        return dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self.group.broadcast([tensor], options).wait()
        return tensor
