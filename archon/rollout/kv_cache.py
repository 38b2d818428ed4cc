"""The generation cache: one prompt's keys/values shared by its group of samples.

The cache has `num_slots` prefix slots and `num_rows` rows. A slot holds one prompt, whose
keys/values are stored once ([num_slots, Hkv, max_prompt_len, D] per layer) and read by all the
samples of its group; a row holds one sample, with the keys/values of its own generated tokens (its
suffix, [num_rows, Hkv, max_new_tokens, D]). Rows and slots are not tied: a row points at the slot
of the prompt it samples from (`row_slot`) and takes one of the slot's `group_size` sample places
(`row_place`; `slot_rows` maps the places back to rows). A row that ends a sample can start another
one at once, of any prefilled prompt (`start_rows`), while the slot keeps its prompt until its
group's last sample ends. There are more slots than rows / group_size, so that rows freed early can
start the samples of the next prompts while a prompt's longest sample still runs.

A step is one of two kinds, announced by the engine before the forward:
- `begin_prefill`: the packed prompts of newly admitted groups. Each layer stores their keys/values
  in the slots' prefixes and attends over the packed prompts as in training (`attention` returns
  None). A recurrent layer (linear attention) keeps the state it reached at the end of the prompt in
  the slot, and the rows starting the prompt's samples copy it (`start_rows`).
  A prompt may continue a kept state (`KeptState`: what an earlier generation left for a prefix of
  the prompt, `load_kept` puts it in the slot first): only the prompt's remaining tokens are packed,
  at positions `offset`, `offset + 1`, ...; an attention layer then stores their keys/values after
  the kept ones and returns the attention of the new queries over [kept keys ; new keys] (causal at
  those positions, sliding windows and sinks included); a recurrent layer starts from the kept conv
  window and state (`recurrent_state`) instead of zeros. A chunked prefill continues the same way
  from what the slot holds after the prefill's previous forward: its prompts' first tokens.
- `begin_decode`: one token for each of the first `num_rows` rows, in row order. Each layer writes
  the token's key/value at its suffix position, and attends over the row's slot's prefix (one
  batched product per slot for the queries of all its rows, gathered to the slot's sample places:
  the prefix is read once per group) and the row's suffix, with one softmax over both. No key or
  value is gathered or copied per token: prefix and suffix are read in place, masked by each row's
  lengths. A row that is done keeps its recurrent state: it stays the one reached after the row's
  tokens (all but its last sampled one) until the row starts another sample.

A sparse-attention layer (DeepSeek-V3.2's indexer) also stores one indexer key per token beside its
keys and values (`index_keys`, in prefix and suffix tables like theirs), selects the keys each query
reads over the keys that call returns, and hands the selection to `attention` (`selected=`).

`row_state` copies out what one row holds for its prompt and all but its last generated token (the
last has not been through the model), to be kept for the sequence's next turn.

A recurrent layer's part of the layer cache (its conv windows and states) is in
archon/rollout/recurrent_cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archon.causal_attention import causal_attention_after_prefix, causal_mask
from archon.rollout.recurrent_cache import RecurrentLayerCache


@dataclass
class KeptLayerState:
    """One layer's kept state for a sequence of L tokens: keys [Hkv, L, Dk] and values [Hkv, L, Dv]
    (attention), or the conv window and recurrent state after the L tokens (a recurrent layer)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None  # [L, Di]: a sparse-attention indexer's keys
    conv_window: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None


@dataclass
class KeptState:
    """What the cache held for one sequence after a generation: `tokens` went through the model, and
    `layers` hold each layer's state after them."""

    tokens: list[int]
    layers: list[KeptLayerState]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_rows: int,
        group_size: int,
        max_prompt_len: int,
        max_new_tokens: int,
        device: torch.device,
    ) -> None:
        self.num_slots, self.num_rows_total, self.group_size = num_slots, num_rows, group_size
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.device = device
        self._layers = [LayerKVCache(self) for _ in range(num_layers)]
        self.decoding = False
        # which slot each row reads its prompt from, and which of the slot's group_size sample
        # places it takes; slot_rows is the inverse map (num_rows_total where a place has no row)
        self.row_slot = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.row_place = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.slot_rows = torch.full((num_slots, group_size), num_rows, dtype=torch.long, device=device)
        self.row_slot_on_host: list[int | None] = [None] * num_rows
        """row_slot as the host knows it (None: a free row), without reading the device."""
        self.rows_read_own_slots = False
        """Whether in this decode step every row r reads slot r, alone (see begin_decode)."""
        # prefill: each packed token's slot and position, each packed prompt's slot
        self.token_slots: torch.Tensor | None = None
        self.token_positions: torch.Tensor | None = None
        self.prompt_slots: torch.Tensor | None = None
        # prefill after kept prefixes: each packed prompt's offset (None when all are 0) and length
        self.prompt_offsets: torch.Tensor | None = None
        self.prompt_lens: list[int] = []
        # decode: rows and slots in the step, and the key spans read (upper bounds; the masks do the rest)
        self.num_rows = 0
        self.num_step_slots = 0
        self.prefix_span = 0
        self.suffix_span = 0
        self.suffix_positions: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None
        self.row_prompt_lens: torch.Tensor | None = None
        self.live_rows: torch.Tensor | None = None
        # a decode step of several tokens per row (speculative decoding): tokens per row, and each
        # query's row and suffix position [num_rows * tokens_per_row]
        self.tokens_per_row = 1
        self.query_rows: torch.Tensor | None = None
        self.query_suffix_positions: torch.Tensor | None = None
        self._masks: dict[int | None, torch.Tensor] = {}
        self._hidden: dict[int | None, torch.Tensor] = {}

    def layer(self, index: int) -> "LayerKVCache":
        return self._layers[index]

    def begin_prefill(
        self, slots: torch.Tensor, prompt_lens: torch.Tensor, offsets: torch.Tensor | None = None
    ) -> None:
        """slots, prompt_lens: [N] for the N prompts packed (in this order) in the next forward.
        offsets: [N] how many tokens of each prompt its slot already holds (`load_kept`, or an
            earlier forward of a chunked prefill), which the packed tokens follow; None: none."""
        if offsets is not None and not bool(offsets.any()):
            offsets = None
        ends = prompt_lens if offsets is None else offsets + prompt_lens
        if int(ends.max()) > self.max_prompt_len:
            raise ValueError(f"a prompt of {int(ends.max())} tokens exceeds the cache's {self.max_prompt_len}")
        self.decoding = False
        self.prompt_slots = slots.to(self.device)
        self.prompt_lens = prompt_lens.tolist()
        self.prompt_offsets = None if offsets is None else offsets.to(self.device)
        self.token_slots = torch.repeat_interleave(slots, prompt_lens).to(self.device)
        starts = [0] * len(self.prompt_lens) if offsets is None else offsets.tolist()
        self.token_positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, self.prompt_lens)]).to(
            self.device
        )

    def load_kept(self, slot: int, kept: KeptState) -> None:
        """Put a kept state in `slot` (its prefix's first len(kept.tokens) keys/values, or the
        recurrent state after them), for a prefill that continues it (begin_prefill's offsets)."""
        for layer, state in zip(self._layers, kept.layers):
            layer.load_kept(slot, state)

    def start_rows(self, rows: list[int], slots: list[int], places: list[int]) -> None:
        """Rows `rows` start new samples of the prompts in `slots` (prefilled), as sample places
        `places` of those slots: they point at the slots' prefixes, and a recurrent layer's rows
        take the state their slot reached at the end of its prompt."""
        dev = self.device
        rows_t, slots_t, places_t = (torch.tensor(x, dtype=torch.long, device=dev) for x in (rows, slots, places))
        self.row_slot[rows_t], self.row_place[rows_t] = slots_t, places_t
        self.slot_rows[slots_t, places_t] = rows_t
        for row, slot in zip(rows, slots):
            self.row_slot_on_host[row] = slot
        for layer in self._layers:
            layer.start_rows(rows_t, slots_t)

    def release_rows(self, rows: list[int], slots: list[int], places: list[int]) -> None:
        """Rows `rows`, sample places `places` of `slots`, are free again (their samples ended); a
        free row points at slot 0 (a decode step reads it, and masks it)."""
        dev = self.device
        self.slot_rows[torch.tensor(slots, device=dev), torch.tensor(places, device=dev)] = self.num_rows_total
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        self.row_slot[rows_t], self.row_place[rows_t] = 0, 0
        for row in rows:
            self.row_slot_on_host[row] = None

    def row_state(self, row: int, slot: int, prompt_len: int, generated: int) -> list[KeptLayerState]:
        """Each layer's state of `row` after its slot's prompt (prompt_len tokens) and its first
        `generated` generated tokens (copies)."""
        return [layer.row_state(row, slot, prompt_len, generated) for layer in self._layers]

    def begin_decode(
        self,
        num_rows: int,
        num_slots: int,
        suffix_positions: torch.Tensor,
        row_prompt_lens: torch.Tensor,
        prefix_span: int,
        suffix_span: int,
        live_rows: torch.Tensor | None = None,
    ) -> None:
        """The next forward holds one token for each of rows 0..num_rows-1, in row order; every
        row that holds a sample reads a slot among 0..num_slots-1, and every such slot's rows are
        among the num_rows.

        suffix_positions [num_rows]: where each row's token goes in its suffix (its index among the
            row's generated tokens); or [num_rows, T]: T tokens per row (speculative decoding: the
            tokens a draft proposed, verified in one forward), row after row, each query seeing the
            row's suffix keys up to its own position. A row's positions may repeat (the same token
            at the same position, written twice). Rows continue the cache like a chunked prefill
            continues a prompt; keys stored past the row's accepted tokens are never read (the masks
            stop at each query's position) and are overwritten by the row's next tokens.
            A recurrent layer's state then holds every token fed; speculative decoding rolls it back
            to the kept ones (recurrent_cache.RecurrentRollback).
        row_prompt_lens [num_rows]: the length of the row's prompt.
        prefix_span, suffix_span: how many prefix / suffix keys the step reads, at least the longest
            prompt of the slots in the step and the largest suffix position + 1.
        live_rows [num_rows] bool: the rows still generating; the others keep their recurrent state
            (None: every row updates it).
        """
        if num_rows > self.num_rows_total or num_slots > self.num_slots:
            raise ValueError(
                f"a decode step over {num_rows} rows and {num_slots} slots "
                f"exceeds the cache's {self.num_rows_total} and {self.num_slots}"
            )
        if suffix_span > self.max_new_tokens or prefix_span > self.max_prompt_len:
            raise ValueError(
                f"spans ({prefix_span}, {suffix_span}) exceed the cache ({self.max_prompt_len}, {self.max_new_tokens})"
            )
        self.decoding = True
        self.num_rows, self.num_step_slots = num_rows, num_slots
        self.prefix_span, self.suffix_span = prefix_span, suffix_span
        self.live_rows = live_rows
        self._masks, self._hidden = {}, {}
        # one sample per prompt, row r on slot r: the step reads each row's prefix without gathering
        # queries to slots and scores back to rows (a free row r reads slot r's prefix, unused)
        self.rows_read_own_slots = (
            self.group_size == 1
            and num_slots == num_rows
            and all(slot in (None, row) for row, slot in enumerate(self.row_slot_on_host[:num_rows]))
        )
        if suffix_positions.dim() == 2:
            self.tokens_per_row = suffix_positions.shape[1]
            self.query_rows = torch.arange(num_rows, device=self.device).repeat_interleave(self.tokens_per_row)
            suffix_positions = suffix_positions.reshape(-1)
            row_prompt_lens = row_prompt_lens.repeat_interleave(self.tokens_per_row)
        else:
            self.tokens_per_row, self.query_rows = 1, None
        self.suffix_positions = suffix_positions
        self.row_prompt_lens = row_prompt_lens
        self.query_positions = row_prompt_lens + suffix_positions

    def visible_keys(self, sliding_window: int | None) -> torch.Tensor:
        """[num_rows * tokens_per_row, prefix_span + suffix_span] bool: which prefix keys, then which
        suffix keys, each query sees (made once per step and window size, shared by the layers)."""
        if sliding_window not in self._masks:
            prefix = torch.arange(self.prefix_span, device=self.device)[None, :]
            suffix = torch.arange(self.suffix_span, device=self.device)[None, :]
            prompt_lens, suffix_pos = self.row_prompt_lens[:, None], self.suffix_positions[:, None]
            prefix_seen, suffix_seen = prefix < prompt_lens, suffix <= suffix_pos
            if sliding_window is not None:
                query = self.query_positions[:, None]
                prefix_seen &= prefix > query - sliding_window
                suffix_seen &= prompt_lens + suffix > query - sliding_window
            self._masks[sliding_window] = torch.cat([prefix_seen, suffix_seen], dim=1)
        return self._masks[sliding_window]

    def hidden_keys(self, sliding_window: int | None) -> torch.Tensor:
        """~visible_keys(sliding_window), made once per step and window size."""
        if sliding_window not in self._hidden:
            self._hidden[sliding_window] = ~self.visible_keys(sliding_window)
        return self._hidden[sliding_window]


class LayerKVCache(RecurrentLayerCache):
    """One layer's cache: prefix and suffix keys/values (attention), or each row's conv window and
    recurrent state (a recurrent layer: its methods in archon/rollout/recurrent_cache.py), allocated
    at the layer's first use."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.prefix_k: torch.Tensor | None = None  # [num_slots, Hkv, max_prompt_len, Dk]
        self.prefix_v: torch.Tensor | None = None  # [num_slots, Hkv, max_prompt_len, Dv]
        self.suffix_k: torch.Tensor | None = None  # [num_rows_total, Hkv, max_new_tokens, Dk]
        self.suffix_v: torch.Tensor | None = None
        self.conv_window: torch.Tensor | None = None  # [num_rows_total, ...]
        self.recurrent: torch.Tensor | None = None
        # the state each slot's prompt ended in, which the rows starting its samples copy
        self.slot_conv_window: torch.Tensor | None = None  # [num_slots, ...]
        self.slot_recurrent: torch.Tensor | None = None
        # a sparse-attention indexer's keys (DeepSeek-V3.2): one per token, [.., max_len, Di]
        self.prefix_index_k: torch.Tensor | None = None  # [num_slots, max_prompt_len, Di]
        self.suffix_index_k: torch.Tensor | None = None  # [num_rows_total, max_new_tokens, Di]

    @property
    def decoding(self) -> bool:
        return self.cache.decoding

    # ---- kept states -----------------------------------------------------------------------------
    def load_kept(self, slot: int, state: KeptLayerState) -> None:
        if state.recurrent is not None:
            if self.recurrent is None:
                self._allocate_recurrent(state.conv_window, state.recurrent)
            self.slot_conv_window[slot] = state.conv_window
            self.slot_recurrent[slot] = state.recurrent
        if state.keys is not None:
            if self.prefix_k is None:
                self._allocate(state.keys, state.values)
            length = state.keys.shape[1]
            self.prefix_k[slot, :, :length] = state.keys
            self.prefix_v[slot, :, :length] = state.values
        if state.index_keys is not None:
            if self.prefix_index_k is None:
                self._allocate_index_keys(state.index_keys)
            self.prefix_index_k[slot, : state.index_keys.shape[0]] = state.index_keys

    def row_state(self, row: int, slot: int, prompt_len: int, generated: int) -> KeptLayerState:
        state = KeptLayerState()
        if self.recurrent is not None:
            state.conv_window, state.recurrent = self.conv_window[row].clone(), self.recurrent[row].clone()
        if self.prefix_k is not None:
            state.keys = torch.cat([self.prefix_k[slot, :, :prompt_len], self.suffix_k[row, :, :generated]], dim=1)
            state.values = torch.cat([self.prefix_v[slot, :, :prompt_len], self.suffix_v[row, :, :generated]], dim=1)
        if self.prefix_index_k is not None:
            state.index_keys = torch.cat([self.prefix_index_k[slot, :prompt_len], self.suffix_index_k[row, :generated]])
        return state

    # ---- a sparse-attention indexer's keys -------------------------------------------------------
    def _allocate_index_keys(self, keys: torch.Tensor) -> None:
        c = self.cache
        self.prefix_index_k = keys.new_zeros(c.num_slots, c.max_prompt_len, keys.shape[-1])
        self.suffix_index_k = keys.new_zeros(c.num_rows_total, c.max_new_tokens, keys.shape[-1])

    def index_keys(
        self, keys: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | tuple[torch.Tensor, torch.Tensor] | None:
        """Store the step's indexer keys [T, Di] (one per token, next to its keys and values) and
        return those each query may select from:
        - a prefill from empty slots: None (the packed prompts' own keys, as in training);
        - a prefill after kept prefixes: one (keys [offset + L, Di], visible [L, offset + L] bool)
          per prompt, its kept keys then its own, visible causally;
        - a decode step: (keys [R, prefix_span + suffix_span, Di], visible [R, prefix_span + suffix_span]),
          each row's prefix keys then its suffix keys.
        """
        c = self.cache
        if self.prefix_index_k is None:
            self._allocate_index_keys(keys)
        keys = keys.detach()
        if not c.decoding:
            self.prefix_index_k[c.token_slots, c.token_positions] = keys.to(self.prefix_index_k.dtype)
            if c.prompt_offsets is None:
                return None
            context = []
            for slot, offset, length in zip(c.prompt_slots.tolist(), c.prompt_offsets.tolist(), c.prompt_lens):
                visible = causal_mask(length, None, keys.device, offset + length)
                context.append((self.prefix_index_k[slot, : offset + length], visible))
            return context
        rows = torch.arange(c.num_rows, device=keys.device) if c.query_rows is None else c.query_rows
        self.suffix_index_k[rows, c.suffix_positions] = keys.to(self.suffix_index_k.dtype)
        prefix = self.prefix_index_k[c.row_slot[: c.num_rows], : c.prefix_span]
        context = torch.cat([prefix, self.suffix_index_k[: c.num_rows, : c.suffix_span]], dim=1)
        if c.query_rows is not None:  # each query reads its row's keys
            context = context[c.query_rows]
        return context, c.visible_keys(None)

    # ---- attention layers ------------------------------------------------------------------------
    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prefix and suffix tables for keys like k [Hkv, L, Dk] and values v [Hkv, L, Dv]."""
        c = self.cache
        hkv, dk, dv = k.shape[0], k.shape[-1], v.shape[-1]
        self.prefix_k = k.new_zeros(c.num_slots, hkv, c.max_prompt_len, dk)
        self.prefix_v = v.new_zeros(c.num_slots, hkv, c.max_prompt_len, dv)
        self.suffix_k = k.new_zeros(c.num_rows_total, hkv, c.max_new_tokens, dk)
        self.suffix_v = v.new_zeros(c.num_rows_total, hkv, c.max_new_tokens, dv)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
        selected=None,
    ) -> torch.Tensor | None:
        """Store the step's k [T, Hkv, Dk] and v [T, Hkv, Dv]. At a prefill return None (attend over
        the packed prompts as usual), or, when prompts continue kept states, the attention output
        [T, H, Dv] of q [T, H, Dk] over each prompt's kept and new keys; at a decode step the
        attention output over each row's prompt and generated tokens.

        sinks: [H] sink logits that join every softmax denominator (GPT-OSS), or None.
        sliding_window: a query sees itself and the sliding_window - 1 keys before it, or None.
        selected: the keys a sparse-attention indexer lets each query read, over those `index_keys`
            returned: [R, prefix_span + suffix_span] bool at a decode step, one [L, offset + L] per
            prompt at a prefill after kept prefixes; a prefill from empty slots ignores it.
        """
        c = self.cache
        if self.prefix_k is None:
            self._allocate(k.transpose(0, 1), v.transpose(0, 1))
        k, v = k.detach(), v.detach()
        if not c.decoding:
            self.prefix_k[c.token_slots, :, c.token_positions] = k.to(self.prefix_k.dtype)
            self.prefix_v[c.token_slots, :, c.token_positions] = v.to(self.prefix_v.dtype)
            if c.prompt_offsets is None:
                return None
            return self._prefill_attention(q, scale, sinks, sliding_window, selected)
        rows = torch.arange(c.num_rows, device=q.device) if c.query_rows is None else c.query_rows
        self.suffix_k[rows, :, c.suffix_positions] = k.to(self.suffix_k.dtype)
        self.suffix_v[rows, :, c.suffix_positions] = v.to(self.suffix_v.dtype)
        if c.tokens_per_row > 1:
            return self._multi_token_attention(q, scale, sinks, sliding_window, selected)
        return self._decode_attention(q, scale, sinks, sliding_window, selected)

    def _multi_token_attention(self, q, scale, sinks, sliding_window, selected=None) -> torch.Tensor:
        """q [R * T, H, Dk] (T tokens per row, row after row) -> [R * T, H, Dv]: each query over its
        row's prefix and suffix keys, one softmax over both, masked at its own position. The prefix
        keys are gathered per row (this step verifies a few tokens per row; the one-token step reads
        each slot's prefix once for its group instead)."""
        c = self.cache
        R, T = c.num_rows, c.tokens_per_row
        H, Dk = q.shape[1], q.shape[2]
        hkv = self.prefix_k.shape[1]
        rep = H // hkv
        Lp, Ls = c.prefix_span, c.suffix_span
        slots = c.row_slot[:R]
        keys = torch.cat([self.prefix_k[slots, :, :Lp], self.suffix_k[:R, :, :Ls]], dim=2)  # [R, Hkv, Lk, Dk]
        values = torch.cat([self.prefix_v[slots, :, :Lp], self.suffix_v[:R, :, :Ls]], dim=2)  # [R, Hkv, Lk, Dv]
        queries = q.to(keys.dtype).view(R, T, hkv, rep, Dk).permute(0, 2, 1, 3, 4).reshape(R, hkv, T * rep, Dk)
        scores = (queries @ keys.transpose(-1, -2)).float().view(R, hkv, T, rep, Lp + Ls) * scale
        visible = c.visible_keys(sliding_window) if selected is None else c.visible_keys(sliding_window) & selected
        scores = scores.masked_fill(~visible.view(R, 1, T, 1, Lp + Ls), float("-inf"))
        if sinks is not None:
            sink_logits = sinks.float().view(1, hkv, 1, rep, 1).expand(R, hkv, T, rep, 1)
            probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = probs.to(values.dtype).view(R, hkv, T * rep, Lp + Ls) @ values  # [R, Hkv, T * rep, Dv]
        Dv = values.shape[-1]
        return out.view(R, hkv, T, rep, Dv).permute(0, 2, 1, 3, 4).reshape(R * T, H, Dv)

    def _prefill_attention(self, q, scale, sinks, sliding_window, selected=None) -> torch.Tensor:
        """q [T, H, Dk] of the packed prompts -> [T, H, Dv]: each prompt's queries over its slot's
        prefix keys up to its last token (the kept ones, then its own), causally at their positions.
        Under a sliding window only the keys from the window of the first query on are read."""
        c = self.cache
        offsets = c.prompt_offsets.tolist()
        outputs = []
        prompts = zip(q.split(c.prompt_lens), c.prompt_slots.tolist(), offsets, c.prompt_lens)
        for i, (q_seq, slot, offset, length) in enumerate(prompts):
            first = 0 if sliding_window is None else max(0, offset - sliding_window + 1)
            k_seq = self.prefix_k[slot, :, first : offset + length]
            v_seq = self.prefix_v[slot, :, first : offset + length]
            key_mask = None if selected is None else selected[i][:, first:]
            out = causal_attention_after_prefix(
                q_seq.transpose(0, 1).to(k_seq.dtype), k_seq, v_seq, scale, sinks, sliding_window, key_mask
            )
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs, dim=0)

    def _decode_attention(self, q, scale, sinks, sliding_window, selected=None) -> torch.Tensor:
        """q [R, H, Dk] -> [R, H, Dv]: softmax over [prefix keys | suffix keys (| sink)] per row.

        The prefix is read once per slot: the queries of a slot's rows (up to group_size, at their
        sample places, zero where a place has no row) multiply its keys in one product, and each
        row takes its scores back from its place; the probabilities go the same way for the values.
        When every row r reads slot r alone (`rows_read_own_slots`) the products run on the rows as
        they are, the same products without the gathers."""
        c = self.cache
        R, H, Dk = q.shape
        S = c.num_step_slots
        hkv = self.prefix_k.shape[1]
        rep = H // hkv  # query head h reads kv head h // rep
        Lp, Ls = c.prefix_span, c.suffix_span
        prefix_k, prefix_v = self.prefix_k[:S, :, :Lp], self.prefix_v[:S, :, :Lp]  # [S, Hkv, Lp, D]
        suffix_k, suffix_v = self.suffix_k[:R, :, :Ls], self.suffix_v[:R, :, :Ls]  # [R, Hkv, Ls, D]
        q = q.to(prefix_k.dtype)
        if c.rows_read_own_slots:
            prefix_scores = q.view(R, hkv, rep, Dk) @ prefix_k.transpose(-1, -2)  # [R, Hkv, rep, Lp]
        else:
            prefix_scores = self._slot_products(q.view(R, hkv, rep, Dk), prefix_k.transpose(-1, -2))
        suffix_scores = q.view(R, hkv, rep, Dk) @ suffix_k.transpose(-1, -2)  # [R, Hkv, rep, Ls]
        scores = torch.cat([prefix_scores, suffix_scores], dim=-1).float()  # a new tensor: scaled in place
        scores.mul_(scale)
        hidden = c.hidden_keys(sliding_window) if selected is None else ~(c.visible_keys(sliding_window) & selected)
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        if sinks is not None:
            sink_logits = sinks.float().view(1, hkv, rep, 1).expand(R, hkv, rep, 1)
            probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = probs.to(prefix_v.dtype)
        if c.rows_read_own_slots:
            out = probs[..., :Lp] @ prefix_v  # [R, Hkv, rep, Dv]
        else:
            out = self._slot_products(probs[..., :Lp], prefix_v)
        out += probs[..., Lp:] @ suffix_v
        return out.reshape(R, H, -1)

    def _slot_products(self, per_row: torch.Tensor, per_slot: torch.Tensor) -> torch.Tensor:
        """per_row [R, Hkv, rep, K] (each row's), per_slot [S, Hkv, K, N] (each slot's) -> [R, Hkv, rep, N]:
        each row's product with its slot's matrix, one product per slot for the rows at its sample
        places (zero rows where a place has no row), each row's taken back from its place."""
        c = self.cache
        R, hkv, rep, K = per_row.shape
        S, G, N = per_slot.shape[0], c.group_size, per_slot.shape[-1]
        places = c.slot_rows[:S].clamp(max=R)  # [S, G]: row R is a zero row (a place without a row)
        at_places = torch.cat([per_row, per_row.new_zeros(1, hkv, rep, K)])[places]  # [S, G, Hkv, rep, K]
        by_slot = at_places.transpose(1, 2).reshape(S, hkv, G * rep, K)
        products = (by_slot @ per_slot).view(S, hkv, G, rep, N).transpose(1, 2)  # [S, G, Hkv, rep, N]
        return products[c.row_slot[:R], c.row_place[:R]]
