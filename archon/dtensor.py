"""DTensor helpers: what the rest of archon needs of a tensor that FSDP2 or TP may have sharded."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the whole value, gathering DTensor shards (FSDP/TP) when needed."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t
