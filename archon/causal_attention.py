"""Causal attention of one sequence against keys that may begin before its queries: the masks
(causal, sliding window), attention with per-head sinks, and the attention of queries that follow
a prefix of kept keys. Training attention (models/common/attention.py) and the generation cache
(archon/rollout/kv_cache.py) share them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def causal_mask(
    seqlen: int, sliding_window: int | None, device: torch.device, num_keys: int | None = None
) -> torch.Tensor:
    """[L, num_keys (default L)] bool, True where query i may attend to key j; the L queries are the
    last L of the num_keys positions."""
    num_keys = seqlen if num_keys is None else num_keys
    i = torch.arange(num_keys - seqlen, num_keys, device=device)[:, None]
    j = torch.arange(num_keys, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    return allowed


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence, q: [H, L, D], k: [Hkv, Lk, D], v: [Hkv, Lk, Dv] -> [H, L, Dv], the L queries
    being the last L of the Lk positions (Lk = L but after a kept prefix).

    softmax over [scores, sink] per query row, then the sink column is dropped, so the sink only
    takes probability mass away from the real keys.
    """
    n_heads, seqlen = q.shape[0], q.shape[1]
    group = n_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2)).float() * scale
    scores = scores.masked_fill(~causal_mask(seqlen, sliding_window, q.device, k.shape[1]), float("-inf"))
    sink_logits = sinks.float()[:, None, None].expand(n_heads, seqlen, 1)
    probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def causal_attention_after_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence whose L queries follow a prefix of keys already computed: q [H, L, D],
    k [Hkv, Lk, D], v [Hkv, Lk, Dv] (the prefix's Lk - L keys, then the queries' own) -> [H, L, Dv].
    Query i sits at position Lk - L + i and sees the keys up to it (within the sliding window).
    key_mask: [L, Lk] bool, the keys each query may read besides (a sparse-attention selection), or None."""
    if key_mask is not None:
        if sinks is not None:
            raise ValueError("a key mask (sparse attention) with attention sinks is not implemented")
        mask = causal_mask(q.shape[1], sliding_window, q.device, k.shape[1]) & key_mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0])
    if sinks is not None:
        return attention_with_sinks(q, k, v, scale, sinks, sliding_window)
    gqa = q.shape[0] != k.shape[0]
    if sliding_window is None:
        # a lower-right causal bias lets CUDA's flash kernel run without an [L, Lk] mask in memory
        mask = causal_lower_right(q.shape[1], k.shape[1])
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa)[0]
    mask = causal_mask(q.shape[1], sliding_window, q.device, k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
