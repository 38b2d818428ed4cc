"""The generation cache: one prompt's keys/values shared by its group of samples.

The cache is a table of `num_blocks` blocks of `group_size` rows. A block holds one prompt, whose
keys/values are stored once (the block's prefix, [num_blocks, Hkv, max_prompt_len, D] per layer)
and read by all its rows; each row is one sample, with the keys/values of its own generated tokens
(its suffix, [num_rows, Hkv, max_new_tokens, D]). Row r belongs to block r // group_size.

A step is one of two kinds, announced by the engine before the forward:
- `begin_prefill`: the packed prompts of newly admitted blocks. Each layer stores their keys/values
  in the blocks' prefixes and attends over the packed prompts as in training (`attention` returns
  None). A recurrent layer (linear attention) copies the state it reached at the end of the prompt
  to every row of the block.
- `begin_decode`: one token for each of the first `num_rows` rows, in row order. Each layer writes
  the token's key/value at its suffix position, and attends over the block's prefix (one batched
  product per block for all its rows: the prefix is read once per group) and the row's suffix,
  with one softmax over both. Nothing is gathered or copied per token: prefix and suffix are read
  in place, masked by each row's lengths.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        group_size: int,
        max_prompt_len: int,
        max_new_tokens: int,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.group_size = num_blocks, group_size
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.device = device
        self._layers = [LayerKVCache(self) for _ in range(num_layers)]
        self.decoding = False
        # prefill: each packed token's block and position, each packed prompt's block
        self.token_blocks: torch.Tensor | None = None
        self.token_positions: torch.Tensor | None = None
        self.prompt_blocks: torch.Tensor | None = None
        # decode: rows in the step, and the key spans read (upper bounds; the masks do the rest)
        self.num_rows = 0
        self.prefix_span = 0
        self.suffix_span = 0
        self.suffix_positions: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None
        self.row_prompt_lens: torch.Tensor | None = None
        self._masks: dict[int | None, torch.Tensor] = {}

    @property
    def num_rows_total(self) -> int:
        return self.num_blocks * self.group_size

    def layer(self, index: int) -> "LayerKVCache":
        return self._layers[index]

    def begin_prefill(self, blocks: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """blocks, prompt_lens: [N] for the N prompts packed (in this order) in the next forward."""
        if int(prompt_lens.max()) > self.max_prompt_len:
            raise ValueError(f"a prompt of {int(prompt_lens.max())} tokens exceeds the cache's {self.max_prompt_len}")
        self.decoding = False
        self.prompt_blocks = blocks.to(self.device)
        self.token_blocks = torch.repeat_interleave(blocks, prompt_lens).to(self.device)
        self.token_positions = torch.cat([torch.arange(n) for n in prompt_lens.tolist()]).to(self.device)

    def begin_decode(
        self,
        num_rows: int,
        suffix_positions: torch.Tensor,
        row_prompt_lens: torch.Tensor,
        prefix_span: int,
        suffix_span: int,
    ) -> None:
        """The next forward holds one token for each of rows 0..num_rows-1 (a multiple of group_size).

        suffix_positions [num_rows]: where each row's token goes in its suffix (its index among the
            row's generated tokens); row_prompt_lens [num_rows]: the length of the row's prompt.
        prefix_span, suffix_span: how many prefix / suffix keys the step reads, at least the longest
            prompt of the blocks in the step and the largest suffix position + 1.
        """
        if num_rows % self.group_size or num_rows > self.num_rows_total:
            raise ValueError(f"a decode step covers whole blocks: {num_rows} rows for groups of {self.group_size}")
        if suffix_span > self.max_new_tokens or prefix_span > self.max_prompt_len:
            raise ValueError(f"spans ({prefix_span}, {suffix_span}) exceed the cache ({self.max_prompt_len}, {self.max_new_tokens})")
        self.decoding = True
        self.num_rows, self.prefix_span, self.suffix_span = num_rows, prefix_span, suffix_span
        self.suffix_positions = suffix_positions
        self.row_prompt_lens = row_prompt_lens
        self.query_positions = row_prompt_lens + suffix_positions
        self._masks = {}

    def visible_keys(self, sliding_window: int | None) -> torch.Tensor:
        """[num_rows, prefix_span + suffix_span] bool: which prefix keys, then which suffix keys,
        each row's query sees (made once per step and window size, shared by the layers)."""
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


class LayerKVCache:
    """One layer's cache: prefix and suffix keys/values (attention), or each row's conv window and
    recurrent state (a recurrent layer), allocated at the layer's first use."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.prefix_k: torch.Tensor | None = None  # [num_blocks, Hkv, max_prompt_len, Dk]
        self.prefix_v: torch.Tensor | None = None  # [num_blocks, Hkv, max_prompt_len, Dv]
        self.suffix_k: torch.Tensor | None = None  # [num_rows_total, Hkv, max_new_tokens, Dk]
        self.suffix_v: torch.Tensor | None = None
        self.conv_window: torch.Tensor | None = None  # [num_rows_total, ...]
        self.recurrent: torch.Tensor | None = None

    # ---- recurrent layers ------------------------------------------------------------------------
    def recurrent_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv windows [N, ...], recurrent states [N, ...]) the step's N packed sequences start
        from: (None, None) at a prefill (zero), else the first num_rows rows' states, read in place."""
        c = self.cache
        if not c.decoding or self.recurrent is None:
            return None, None
        return self.conv_window[: c.num_rows], self.recurrent[: c.num_rows]

    def store_recurrent_state(self, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Keep the step's conv windows / recurrent states [N, ...]: a prefill's (one per prompt)
        go to every row of the prompt's block, a decode step's to its rows."""
        c = self.cache
        if self.recurrent is None:
            self.conv_window = conv_window.new_zeros(c.num_rows_total, *conv_window.shape[1:])
            self.recurrent = recurrent.new_zeros(c.num_rows_total, *recurrent.shape[1:])
        conv_window, recurrent = conv_window.detach(), recurrent.detach()
        if c.decoding:
            self.conv_window[: c.num_rows] = conv_window
            self.recurrent[: c.num_rows] = recurrent
            return
        rows = self._rows_of(c.prompt_blocks)
        self.conv_window[rows] = conv_window.repeat_interleave(c.group_size, dim=0).to(self.conv_window.dtype)
        self.recurrent[rows] = recurrent.repeat_interleave(c.group_size, dim=0).to(self.recurrent.dtype)

    def _rows_of(self, blocks: torch.Tensor) -> torch.Tensor:
        g = self.cache.group_size
        return (blocks[:, None] * g + torch.arange(g, device=blocks.device)).reshape(-1)

    # ---- attention layers ------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor | None:
        """Store the step's k [T, Hkv, Dk] and v [T, Hkv, Dv]. At a prefill return None (attend over
        the packed prompts as usual); at a decode step return the attention output [T, H, Dv] of
        q [T, H, Dk] over each row's prompt and generated tokens.

        sinks: [H] sink logits that join every softmax denominator (GPT-OSS), or None.
        sliding_window: a query sees itself and the sliding_window - 1 keys before it, or None.
        """
        c = self.cache
        if self.prefix_k is None:
            hkv = k.shape[1]
            self.prefix_k = k.new_zeros(c.num_blocks, hkv, c.max_prompt_len, k.shape[2])
            self.prefix_v = v.new_zeros(c.num_blocks, hkv, c.max_prompt_len, v.shape[2])
            self.suffix_k = k.new_zeros(c.num_rows_total, hkv, c.max_new_tokens, k.shape[2])
            self.suffix_v = v.new_zeros(c.num_rows_total, hkv, c.max_new_tokens, v.shape[2])
        k, v = k.detach(), v.detach()
        if not c.decoding:
            self.prefix_k[c.token_blocks, :, c.token_positions] = k.to(self.prefix_k.dtype)
            self.prefix_v[c.token_blocks, :, c.token_positions] = v.to(self.prefix_v.dtype)
            return None
        rows = torch.arange(c.num_rows, device=q.device)
        self.suffix_k[rows, :, c.suffix_positions] = k.to(self.suffix_k.dtype)
        self.suffix_v[rows, :, c.suffix_positions] = v.to(self.suffix_v.dtype)
        return self._decode_attention(q, scale, sinks, sliding_window)

    def _decode_attention(self, q, scale, sinks, sliding_window) -> torch.Tensor:
        """q [R, H, Dk] -> [R, H, Dv]: softmax over [prefix keys | suffix keys (| sink)] per row."""
        c = self.cache
        R, H, Dk = q.shape
        G, nb = c.group_size, R // c.group_size
        hkv = self.prefix_k.shape[1]
        rep = H // hkv  # query head h reads kv head h // rep
        Lp, Ls = c.prefix_span, c.suffix_span
        prefix_k, prefix_v = self.prefix_k[:nb, :, :Lp], self.prefix_v[:nb, :, :Lp]  # [nb, Hkv, Lp, D]
        suffix_k, suffix_v = self.suffix_k[:R, :, :Ls], self.suffix_v[:R, :, :Ls]  # [R, Hkv, Ls, D]
        q = q.to(prefix_k.dtype)
        # the G rows of a block query its prefix together: [nb, Hkv, G * rep, Dk]
        q_blocks = q.view(nb, G, hkv, rep, Dk).transpose(1, 2).reshape(nb, hkv, G * rep, Dk)
        prefix_scores = (q_blocks @ prefix_k.transpose(-1, -2)).view(nb, hkv, G, rep, Lp)
        prefix_scores = prefix_scores.transpose(1, 2).reshape(R, hkv, rep, Lp)
        suffix_scores = q.view(R, hkv, rep, Dk) @ suffix_k.transpose(-1, -2)  # [R, Hkv, rep, Ls]
        scores = torch.cat([prefix_scores, suffix_scores], dim=-1).float() * scale
        scores = scores.masked_fill(~c.visible_keys(sliding_window)[:, None, None, :], float("-inf"))
        if sinks is not None:
            sink_logits = sinks.float().view(1, hkv, rep, 1).expand(R, hkv, rep, 1)
            probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = probs.to(prefix_v.dtype)
        prefix_probs = probs[..., :Lp].reshape(nb, G, hkv, rep, Lp).transpose(1, 2).reshape(nb, hkv, G * rep, Lp)
        Dv = prefix_v.shape[-1]
        out = (prefix_probs @ prefix_v).view(nb, hkv, G, rep, Dv).transpose(1, 2).reshape(R, hkv, rep, Dv)
        out = out + probs[..., Lp:] @ suffix_v
        return out.reshape(R, H, Dv)
