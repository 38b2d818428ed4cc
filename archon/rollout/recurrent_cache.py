"""One layer's cache for a recurrent token mixer (linear attention, archon.recurrent): instead of
keys and values, each row's conv window and recurrent state after its tokens, and each slot's state
at the end of its prompt, which the rows starting the prompt's samples copy.

A part of archon/rollout/kv_cache.py's LayerKVCache, which holds the tables (`conv_window`,
`recurrent`, `slot_conv_window`, `slot_recurrent`, allocated at the layer's first use) and its
cache's step (`cache`).

Speculative decoding (archon/rollout/speculative.py) verifies several tokens per row in one
forward, after which a recurrent state holds every verified token, the rejected drafts included.
`RecurrentRollback` rolls it back: during the verify forward it keeps each recurrent mixer's input
and its rows' states from before it; after the acceptance, for the rows that kept fewer tokens than
they verified, it restores those states and runs the mixer again on the kept tokens' inputs alone.
A mixer's input at a kept token depends only on the tokens up to it, so the state it reaches is the
one plain decoding of those tokens reaches.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from archon.recurrent import RecurrentTokenMixer


class RecurrentLayerCache:
    """The recurrent-layer methods of LayerKVCache (archon/rollout/kv_cache.py)."""

    def recurrent_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv windows [N, ...], recurrent states [N, ...]) the step's N packed sequences start
        from: at a prefill (None, None) (zero), or when prompts continue kept states, those states
        (zero for the other prompts); at a decode step the first num_rows rows' states, read in place."""
        c = self.cache
        if self.recurrent is None:
            return None, None
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


_MIXERS: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()
"""A model's recurrent mixers, found once (a rollback is made at every speculative round)."""


class RecurrentRollback:
    """Rolls the recurrent states of `model`'s mixers back to the tokens each row keeps after a
    verify forward of several tokens per row (see the module docstring).

        with rollback.capture():
            model(...)          # the verify forward: T tokens for each of rows 0..R-1
        rollback.rewind(kept)   # kept [R]: tokens each row keeps, 1..T (T: nothing to undo)
    """

    def __init__(self, model: nn.Module) -> None:
        if model not in _MIXERS:
            _MIXERS[model] = [m for m in model.modules() if isinstance(m, RecurrentTokenMixer)]
        self.mixers = _MIXERS[model]
        self.captured: list[tuple[nn.Module, object, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def capture(self):
        """Keep, for each recurrent mixer the forward runs, (mixer, its layer cache, its input x
        [R * T, D], its rows' conv windows [R, ...] and states [R, ...] from before it)."""
        self.captured = []

        def keep(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            cache = args[5] if len(args) > 5 else kwargs.get("cache")
            if cache is None or cache.recurrent is None:
                return
            R = cache.cache.num_rows
            self.captured.append(
                (module, cache, x.detach(), cache.conv_window[:R].clone(), cache.recurrent[:R].clone())
            )

        handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in self.mixers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def rewind(self, kept: torch.Tensor) -> None:
        """kept [R]: the tokens each row keeps of the T it verified (the first kept[r]). The rows with
        0 < kept < T go back to their state before the forward, then through their kept tokens."""
        for mixer, cache, x, conv_window, recurrent in self.captured:
            R = conv_window.shape[0]
            T = x.shape[0] // R
            redo = ((kept > 0) & (kept < T)).nonzero()[:, 0]
            if redo.numel() == 0:
                continue
            lens = kept[redo]
            rows_x = x.view(R, T, -1)[redo]  # [N, T, D]
            packed = rows_x[torch.arange(T, device=x.device)[None, :] < lens[:, None]]  # [sum(lens), D]
            cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
            replay = _ReplayCache(cache, redo, conv_window[redo], recurrent[redo])
            mixer(packed, None, None, cu_seqlens, int(lens.max()), replay, None)


class _ReplayCache:
    """What a recurrent mixer asks of its layer cache, for a re-run over rows `rows` [N] of `cache`
    from the states given: they start from conv_window [N, ...] and recurrent [N, ...] and the
    states they reach are written to their rows of `cache`."""

    def __init__(self, cache, rows: torch.Tensor, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.cache, self.rows = cache, rows
        self.start = (conv_window, recurrent)

    def recurrent_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.start

    def store_recurrent_state(self, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.cache.conv_window[self.rows] = conv_window.detach().to(self.cache.conv_window.dtype)
        self.cache.recurrent[self.rows] = recurrent.detach().to(self.cache.recurrent.dtype)
