"""Small collectives every part of a run shares: which rank is the first, whether a flag is true on
any rank, a sum (or max) of a few numbers over a group, and work done by rank 0 alone whose result
every rank receives. Each is a no-op on a single process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_first_rank() -> bool:
    """Rank 0 of the run (a single process is); before the process group starts, as torchrun's RANK
    says."""
    return (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0


def _spans_ranks(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def true_on_any_rank(flag: bool, device, group=None) -> bool:
    """Whether `flag` is true on any rank of `group` (None: every rank of the run)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    if _spans_ranks(group):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item() > 0


def reduce_floats(values, device, group, op=dist.ReduceOp.SUM) -> list[float]:
    """`values` summed (or reduced by another `op`) over the ranks of `group`, in float64; the values
    themselves where `group` is None or holds this rank alone."""
    reduced = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None and _spans_ranks(group):
        dist.all_reduce(reduced, op=op, group=group)
    return reduced.tolist()


def first_rank_then_broadcast(work: Callable[[], T]) -> T:
    """`work()` run on rank 0 alone (on a single process, there), and its result sent to every rank;
    an Exception it raises is raised on every rank instead (rank 0's other BaseExceptions, such as
    KeyboardInterrupt, leave at once)."""
    outcome: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome[0] = work()
        except Exception as error:  # every rank must learn of it, or the others wait in the broadcast
            outcome[0] = error
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
