"""Peak bytes of tensor storage allocated while a block of code runs (CPU included).

Every tensor an op returns is charged to its storage until the last such tensor is freed; tensors
that existed before the block are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocated(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.current = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [nbytes, 1]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out
