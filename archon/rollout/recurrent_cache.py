"""One layer's cache for a recurrent token mixer (linear attention, archon.recurrent): instead of
keys and values, each row's conv window and recurrent state after its tokens, and each slot's state
at the end of its prompt, which the rows starting the prompt's samples copy.

A part of archon/rollout/kv_cache.py's LayerKVCache, which holds the tables (`conv_window`,
`recurrent`, `slot_conv_window`, `slot_recurrent`, allocated at the layer's first use) and its
cache's step (`cache`).
"""

from __future__ import annotations

import torch


class RecurrentLayerCache:
    """The recurrent-layer methods of LayerKVCache (archon/rollout/kv_cache.py)."""

    def recurrent_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv windows [N, ...], recurrent states [N, ...]) the step's N packed sequences start
        from: at a prefill (None, None) (zero), or when prompts continue kept states, those states
        (zero for the other prompts); at a decode step the first num_rows rows' states, read in place."""
        c = self.cache
        if self.recurrent is None:
            return None, None
        if c.decoding and c.tokens_per_row > 1:
            raise ValueError(
                "a recurrent (linear-attention) layer cannot verify several tokens per row: its state "
                "cannot be rolled back to the accepted ones (speculative decoding does not support this model)"
            )
        if not c.decoding:
            if c.prompt_offsets is None:
                return None, None
            kept = c.prompt_offsets > 0
            slots = c.prompt_slots
            return _where_rows(kept, self.slot_conv_window[slots], 0.0), _where_rows(
                kept, self.slot_recurrent[slots], 0.0
            )
        return self.conv_window[: c.num_rows], self.recurrent[: c.num_rows]

    def _allocate_recurrent(self, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The row and slot tables for states like conv_window [...] and recurrent [...] (one sequence's)."""
        c = self.cache
        self.conv_window = conv_window.new_zeros(c.num_rows_total, *conv_window.shape)
        self.recurrent = recurrent.new_zeros(c.num_rows_total, *recurrent.shape)
        self.slot_conv_window = conv_window.new_zeros(c.num_slots, *conv_window.shape)
        self.slot_recurrent = recurrent.new_zeros(c.num_slots, *recurrent.shape)

    def store_recurrent_state(self, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the step's conv windows / recurrent states [N, ...]: a prefill's (one per prompt)
        go to the prompt's slot, a decode step's to its rows."""
        c = self.cache
        if self.recurrent is None:
            self._allocate_recurrent(conv_window[0], recurrent[0])
        conv_window, recurrent = conv_window.detach(), recurrent.detach()
        if c.decoding:
            if c.live_rows is not None:
                conv_window = _where_rows(c.live_rows, conv_window, self.conv_window[: c.num_rows])
                recurrent = _where_rows(c.live_rows, recurrent, self.recurrent[: c.num_rows])
            self.conv_window[: c.num_rows] = conv_window
            self.recurrent[: c.num_rows] = recurrent
            return
        self.slot_conv_window[c.prompt_slots] = conv_window.to(self.slot_conv_window.dtype)
        self.slot_recurrent[c.prompt_slots] = recurrent.to(self.slot_recurrent.dtype)

    def start_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows [N] start from the recurrent state their slots [N] reached at the end of the prompt."""
        if self.recurrent is not None:
            self.conv_window[rows] = self.slot_conv_window[slots]
            self.recurrent[rows] = self.slot_recurrent[slots]


def _where_rows(keep: torch.Tensor, x: torch.Tensor, other) -> torch.Tensor:
    """x [N, ...] where keep [N] is true, else `other` (a tensor like x, or a number)."""
    return torch.where(keep.view(-1, *[1] * (x.dim() - 1)), x, other)
