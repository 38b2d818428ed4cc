"""A key/value cache for generation on packed sequences.

Each sequence owns a slot; its keys and values sit at their absolute positions. Before each
forward the engine says which slot and position every packed token has (`set_step`); each
attention layer then stores its new k/v and gets back the context every query token sees.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, device: torch.device) -> None:
        self.num_slots, self.max_len, self.device = num_slots, max_len, device
        self._layers = [LayerKVCache(self) for _ in range(num_layers)]
        self.slots: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.context_len = 0
        self.prefill_from_empty = False

    def set_step(self, slots: torch.Tensor, positions: torch.Tensor, prefill_from_empty: bool) -> None:
        """slots, positions: [T] for the packed tokens of the next forward.

        prefill_from_empty: every sequence in the step starts at position 0 and is contiguous in
        the packed batch, so attention over the step's own tokens is the whole context.
        """
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}")
        self.slots, self.positions = slots.to(self.device), positions.to(self.device)
        self.context_len = max(self.context_len, int(positions.max()) + 1 if positions.numel() else 0)
        self.prefill_from_empty = prefill_from_empty

    def layer(self, index: int) -> "LayerKVCache":
        return self._layers[index]


class LayerKVCache:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Store k [T, Hkv, Dk] and v [T, Hkv, Dv] at each token's (slot, position).

        Returns None when the step is a prefill from empty slots (attend over the packed step as
        usual). Otherwise returns (k_ctx [T, S, Hkv, Dk], v_ctx [T, S, Hkv, Dv], positions [T]):
        the keys/values of each token's slot, where key j sits at position j and a query at
        position p may see keys j <= p.
        """
        c = self.cache
        if self.k is None:
            self.k = k.new_zeros(c.num_slots, c.max_len, *k.shape[1:])
            self.v = v.new_zeros(c.num_slots, c.max_len, *v.shape[1:])
        self.k[c.slots, c.positions] = k.detach().to(self.k.dtype)
        self.v[c.slots, c.positions] = v.detach().to(self.v.dtype)
        if c.prefill_from_empty:
            return None
        length = c.context_len
        return self.k[c.slots, :length], self.v[c.slots, :length], c.positions
