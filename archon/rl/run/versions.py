"""Adapter versions on the trainer side: the staleness bound and the recent adapters kept for
measuring how far the trainer has moved from the version that sampled.

Version v is the adapter after v RL steps; the rollouts of RL step s (0-based) are trained at
trainer version s. With rollout.max_staleness N a sample made with version v may be trained on only
while s <= v + N.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from archon.lora import lora_parameters
from archon.parallel.tensor_parallel import local_tensor


def stale_groups(versions: list[int], group_size: int, trainer_version: int, max_staleness: int) -> list[int]:
    """Indices of the prompt groups (consecutive runs of `group_size` samples) holding a sample made
    with a version older than trainer_version - max_staleness: these are dropped and sampled again."""
    oldest = trainer_version - max_staleness
    groups = len(versions) // group_size
    return [g for g in range(groups) if min(versions[g * group_size : (g + 1) * group_size]) < oldest]


class AdapterHistory:
    """The LoRA factors of the last `keep` published versions, as this rank holds them (local
    shards under FSDP/TP), so that the trainer can score a batch under the version that sampled it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._versions: dict[int, dict[str, torch.Tensor]] = {}

    def __contains__(self, version: int) -> bool:
        return version in self._versions

    def record(self, model: nn.Module | dict[str, nn.Parameter], version: int) -> None:
        """Keep the adapter of `model` (or the LoRA parameters given by name) as `version`."""
        self._versions[version] = {name: local_tensor(p).detach().clone() for name, p in _lora(model).items()}
        for old in sorted(self._versions)[: -self.keep]:
            del self._versions[old]

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module | dict[str, nn.Parameter], version: int):
        """The model (or the LoRA parameters given by name) holds adapter `version` inside the block,
        its own factors again after it."""
        params = _lora(model)
        current = {name: local_tensor(p).detach().clone() for name, p in params.items()}
        try:
            with torch.no_grad():
                for name, tensor in self._versions[version].items():
                    local_tensor(params[name]).copy_(tensor)
            yield
        finally:
            with torch.no_grad():
                for name, tensor in current.items():
                    local_tensor(params[name]).copy_(tensor)


def _lora(model: nn.Module | dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    return model if isinstance(model, dict) else lora_parameters(model)
