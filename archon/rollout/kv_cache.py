"""A key/value cache for generation on packed sequences.

Each sequence owns a slot; its keys and values sit at their absolute positions. Before each
forward the engine says which slot and position every packed token has (`set_step`); each
attention layer then stores its new k/v and gets back the context every query token sees.
A recurrent layer (linear attention) keeps instead, per slot, the conv window and the recurrent
state it reached at the end of the slot's tokens so far.
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
    """One layer's cache: keys and values (attention) or conv window and recurrent state (a
    recurrent layer), allocated at the layer's first use."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.conv_window: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None

    def recurrent_state(
        self, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """For the step's N packed sequences (cu_seqlens [N+1]), each one a run of tokens of one slot:
        (slots [N], conv windows [N, ...], recurrent states [N, ...]) to continue from, or
        (slots, None, None) when the step is a prefill from empty slots (start from zero)."""
        c = self.cache
        slots = c.slots[cu_seqlens[:-1]]
        if c.prefill_from_empty or self.recurrent is None:
            return slots, None, None
        return slots, self.conv_window[slots], self.recurrent[slots]

    def store_recurrent_state(self, slots: torch.Tensor, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep each sequence's conv window [N, ...] and recurrent state [N, ...] in its slot."""
        if self.recurrent is None:
            n = self.cache.num_slots
            self.conv_window = conv_window.new_zeros(n, *conv_window.shape[1:])
            self.recurrent = recurrent.new_zeros(n, *recurrent.shape[1:])
        self.conv_window[slots] = conv_window.detach().to(self.conv_window.dtype)
        self.recurrent[slots] = recurrent.detach().to(self.recurrent.dtype)

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
