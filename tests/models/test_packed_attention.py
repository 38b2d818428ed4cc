"""Packed causal attention over many short sequences runs as one call over the sequences padded on
the right; its outputs and gradients equal one causal attention per sequence, computed whole with
an explicit [L, L] mask (float64, so that the comparison holds on any CPU). Long or very uneven
sequences keep one call per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_reporting

import archon.models.common.attention as attention_module
from archon.causal_attention import causal_mask
from archon.models.common.attention import MAX_PADDED_LENGTH, packed_attention


def _per_sequence(q, k, v, cu_seqlens, scale):
    """The oracle: each sequence alone, its causal mask built whole, heads repeated for GQA."""
    parts = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        repeat = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        mask = causal_mask(b - a, None, q.device)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(parts)


def _inputs(lengths, heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (
        torch.randn(T, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (heads, kv_heads, kv_heads)
    )
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu_seqlens


def _attention_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("lengths", [[9, 12, 1, 7, 12, 10], [40, 33, 64, 21]])
def test_padded_short_sequences_equal_one_attention_per_sequence(lengths, heads, kv_heads, monkeypatch):
    q, k, v, cu_seqlens = _inputs(lengths, heads, kv_heads)
    calls = _attention_calls(monkeypatch)
    out = packed_attention(q, k, v, cu_seqlens, max(lengths), 0.25)
    assert calls == [torch.Size([len(lengths), heads, max(lengths), 16])]  # one call, padded
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weights).sum(), [q, k, v])

    expected = _per_sequence(q, k, v, cu_seqlens, 0.25)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [q, k, v])
    assert_close_reporting(out, expected, 1e-12, "packed attention output")
    for name, got, want in zip("qkv", grads, expected_grads):
        assert_close_reporting(got, want, 1e-12, f"packed attention gradient of {name}")


@pytest.mark.parametrize(
    "lengths",
    [
        [MAX_PADDED_LENGTH + 1, 20],  # a sequence too long to pad
        [100, 3, 2, 4, 1, 2],  # padding to the longest would more than double the tokens
        [50],  # one sequence: nothing to batch
    ],
)
def test_long_or_uneven_sequences_keep_one_call_each(lengths, monkeypatch):
    q, k, v, cu_seqlens = _inputs(lengths, 4, 2)
    calls = _attention_calls(monkeypatch)
    out = packed_attention(q, k, v, cu_seqlens, max(lengths), 0.25)
    assert [c[2] for c in calls] == lengths
    assert_close_reporting(out, _per_sequence(q, k, v, cu_seqlens, 0.25), 1e-12, "packed attention output")
