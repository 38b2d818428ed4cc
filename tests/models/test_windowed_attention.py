"""Sliding-window attention in query blocks (each against the keys its window reaches) equals
attention over the whole sequence with the full [L, L] window mask: outputs and gradients, with
and without attention sinks, grouped-query heads, windows shorter and longer than a block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archon.causal_attention import attention_with_sinks, causal_mask
from archon.models.common.attention import MIN_WINDOW_QUERY_BLOCK, packed_attention


def _whole_sequence(q, k, v, scale, sinks, window):
    """The oracle: one [L, L] masked softmax per head, built whole."""
    if sinks is not None:
        return attention_with_sinks(q, k, v, scale, sinks, window)
    mask = causal_mask(q.shape[1], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0])


@pytest.mark.parametrize("window", [8, 300])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_windowed_attention_in_blocks_equals_the_whole_mask(window, with_sinks):
    g = torch.Generator().manual_seed(0)
    lengths = [3 * MIN_WINDOW_QUERY_BLOCK + 37, 5, window + 1]  # several blocks, one short, one just past the window
    T = sum(lengths)
    q = torch.randn(T, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(T, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(T, 2, 16, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True) if with_sinks else None
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = packed_attention(q, k, v, cu_seqlens, max(lengths), 0.25, sinks, window)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), [q, k, v] + ([sinks] if with_sinks else []))

    parts = [
        _whole_sequence(*(t[a:b].transpose(0, 1) for t in (q, k, v)), 0.25, sinks, window).transpose(0, 1)
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    ]
    expected = torch.cat(parts)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v] + ([sinks] if with_sinks else []))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
