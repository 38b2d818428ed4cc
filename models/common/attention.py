"""Causal attention over packed sequences, and the GQA attention block used by the dense families."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from archon.causal_attention import attention_with_sinks, causal_attention_after_prefix
from archon.lora import LoRAConfig, linear
from archon.models.common.norms import OffsetRMSNorm, ProjectionRMSNorm, RMSNorm
from archon.models.common.rope import apply_rotary
from archon.parallel.context_parallel import (
    ContextParallelGroup,
    heads_of_rank,
    heads_to_tokens,
    kv_heads_for,
    tokens_to_heads,
)
from archon.parallel.tensor_parallel import local_tensor


def _flash_varlen_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


@functools.cache
def _varlen_takes_enable_gqa() -> bool:
    """torch 2.12 added `enable_gqa` to varlen_attn and wants GQA asked for with it; earlier
    releases (2.11 among them) have no such argument, and their flash kernel takes fewer key/value
    heads than query heads as they come."""
    from torch.nn.attention import varlen

    return "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters


def _flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, window_size):
    """q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, Dv] -> [T, H, Dv] through the flash varlen kernel."""
    from torch.nn.attention import varlen

    cu = cu_seqlens.to(torch.int32)
    gqa = {"enable_gqa": q.shape[1] != k.shape[1]} if _varlen_takes_enable_gqa() else {}
    return varlen.varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=window_size, **gqa)


# Sliding-window attention (without the flash kernel) runs this many queries at a time at least, each
# block against only the keys its window reaches, so its memory grows with T x window, not T^2.
MIN_WINDOW_QUERY_BLOCK = 256


def windowed_attention(q, k, v, scale: float, sinks: torch.Tensor | None, sliding_window: int) -> torch.Tensor:
    """One sequence, q: [H, L, D], k: [Hkv, L, D], v: [Hkv, L, Dv] -> [H, L, Dv], in blocks of
    max(2 x window, MIN_WINDOW_QUERY_BLOCK) queries, each attending to the keys its window reaches."""
    length = q.shape[1]
    block = max(2 * sliding_window, MIN_WINDOW_QUERY_BLOCK)
    outputs = []
    for start in range(0, length, block):
        end = min(start + block, length)
        first_key = max(0, start - sliding_window + 1)
        outputs.append(
            causal_attention_after_prefix(
                q[:, start:end], k[:, first_key:end], v[:, first_key:end], scale, sinks, sliding_window
            )
        )
    return torch.cat(outputs, dim=1)


# Many short sequences run as one padded batch: one attention call instead of one per sequence,
# whose per-call cost dominates at RL lengths (tens of tokens), and only where the padding costs
# little. On a 2-core CPU (fp32, forward and backward, 4 query and 2 key/value heads of 32) the one
# call was 1.9-3.1x as fast at 16 tokens, 1.2-1.4x at 64, 1.05x at 128, and 0.75x for 16 sequences
# of 100-300 tokens.
MAX_PADDED_LENGTH = 128
MAX_PADDING_FACTOR = 2.0


def _pads_cheaply(lengths: list[int]) -> bool:
    longest = max(lengths, default=0)
    padded = len(lengths) * longest
    return len(lengths) > 1 and longest <= MAX_PADDED_LENGTH and padded <= MAX_PADDING_FACTOR * sum(lengths)


def _right_padded_attention(q, k, v, cu_seqlens, lengths: list[int], scale: float) -> torch.Tensor:
    """packed_attention without sinks or a window, as one causal call over the sequences padded on
    the right to the longest: q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, Dv] -> [T, H, Dv].

    Under the causal mask a real query sees only keys before it, never the padding after its
    sequence, so no other mask is needed; the padded queries' outputs are dropped, and with them
    their gradients (zero), so the real tokens' values and gradients are those of per-sequence calls."""
    T, longest = q.shape[0], max(lengths)
    cu_seqlens = cu_seqlens.to(q.device)
    sequence = torch.repeat_interleave(  # no host-to-device copy: the lengths come from cu_seqlens
        torch.arange(len(lengths), device=q.device), cu_seqlens[1:] - cu_seqlens[:-1], output_size=T
    )
    position = torch.arange(T, device=q.device) - cu_seqlens[:-1][sequence]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [N, h, L, d]
        out = x.new_zeros(len(lengths), longest, *x.shape[1:])
        out = out.index_put((sequence, position), x)
        return out.transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # [N, H, L, Dv]
    return out.transpose(1, 2)[sequence, position]


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    context_parallel: ContextParallelGroup | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence, never across boundaries.

    q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, Dv], cu_seqlens: [N+1] -> [T, H, Dv].
    sinks: [H], a learned logit per head that joins every softmax denominator and attends to
        nothing (GPT-OSS attention sinks), or None.
    sliding_window: each query sees itself and the `sliding_window - 1` tokens before it (the HF
        convention), or None for full causal attention.
    context_parallel: with a group, q, k, v hold this rank's slice of the tokens (T/cp of them) and
        cu_seqlens describes the whole batch; attention runs on every token of this rank's heads
        (Ulysses) and returns this rank's slice, [T/cp, H, Dv].
    """
    if context_parallel is not None:
        cp = context_parallel
        q, k, v = (
            tokens_to_heads(q, cp),
            tokens_to_heads(kv_heads_for(k, cp), cp),
            tokens_to_heads(kv_heads_for(v, cp), cp),
        )
        sinks = None if sinks is None else heads_of_rank(sinks, cp)
        out = packed_attention(q, k, v, cu_seqlens, max_seqlen, scale, sinks, sliding_window)
        return heads_to_tokens(out, cp)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    # The flash kernel has no sink term, and its log-sum-exp output carries no gradient.
    if sinks is None and _flash_varlen_usable(q):
        window_size = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
        return _flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, window_size)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if sliding_window is None and sinks is None and _pads_cheaply(lengths):
        return _right_padded_attention(q, k, v, cu_seqlens, lengths, scale)
    outputs = []
    # split (not per-sequence slicing): its backward is one concatenation rather than a
    # zero-filled [T, ...] gradient per sequence.
    for q_seq, k_seq, v_seq in zip(*(t.split(lengths) for t in (q, k, v))):
        q_seq, k_seq, v_seq = q_seq.transpose(0, 1), k_seq.transpose(0, 1), v_seq.transpose(0, 1)
        if sliding_window is not None:
            out = windowed_attention(q_seq, k_seq, v_seq, scale, sinks, sliding_window)
        elif sinks is not None:
            out = attention_with_sinks(q_seq, k_seq, v_seq, scale, sinks, sliding_window)
        else:
            # With a batch dimension CPU runs its fused (flash) kernel, forward and backward; 3-D
            # inputs fall back to the unfused math path (about 2x slower).
            out = F.scaled_dot_product_attention(
                q_seq[None],
                k_seq[None],
                v_seq[None],
                is_causal=True,
                scale=scale,
                enable_gqa=n_heads != n_kv_heads,
            )[0]
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


class Attention(nn.Module):
    """Grouped-query attention with optional per-head QK RMSNorm (Qwen3) and q/k/v/o bias.

    attention_sinks: a learned per-head sink logit, `sinks` [H] (GPT-OSS).
    sliding_window: attend only to the last `sliding_window` tokens (this one included).
    qk_norm_over_projection: the QK norms (with qk_norm_eps) normalize the whole q and k projections,
        [T, H * D], before they split into heads (OLMo 2/3), rather than each head.
    softmax_scale: the factor on q.k, head_dim**-0.5 when None (Gemma 3: query_pre_attn_scalar**-0.5).
    zero_centred_qk_norm: the QK-norms scale by (1 + weight) (OffsetRMSNorm, Gemma 3).
    interleaved_rotary: RoPE rotates pairs of adjacent features (GLM-4's layout; see apply_rotary).
    rotary: False for a family without RoPE (its model passes rotary=None to PackedDecoderLM, so cos
        and sin are None); with True, missing tables are an error rather than unrotated attention.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        lora: LoRAConfig | None,
        attention_sinks: bool = False,
        sliding_window: int | None = None,
        qk_norm_over_projection: bool = False,
        softmax_scale: float | None = None,
        zero_centred_qk_norm: bool = False,
        interleaved_rotary: bool = False,
        rotary: bool = True,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(
                f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.q_proj = linear(dim, n_heads * head_dim, qkv_bias, "q_proj", lora)
        self.k_proj = linear(dim, n_kv_heads * head_dim, qkv_bias, "k_proj", lora)
        self.v_proj = linear(dim, n_kv_heads * head_dim, qkv_bias, "v_proj", lora)
        self.o_proj = linear(n_heads * head_dim, dim, o_bias, "o_proj", lora)
        self.qk_norm_over_projection = qk_norm_over_projection
        if qk_norm_eps is not None and qk_norm_over_projection:
            self.q_norm = ProjectionRMSNorm(n_heads * head_dim, qk_norm_eps)
            self.k_norm = ProjectionRMSNorm(n_kv_heads * head_dim, qk_norm_eps)
        elif qk_norm_eps is not None:
            norm_cls = OffsetRMSNorm if zero_centred_qk_norm else RMSNorm
            self.q_norm = norm_cls(head_dim, qk_norm_eps)
            self.k_norm = norm_cls(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(n_heads)) if attention_sinks else None
        self.sliding_window = sliding_window
        self.interleaved_rotary = interleaved_rotary
        self.rotary = rotary

    @classmethod
    def from_args(
        cls,
        args,
        lora: LoRAConfig | None,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None = None,
        attention_sinks: bool = False,
        sliding_window: int | None = None,
        qk_norm_over_projection: bool = False,
        softmax_scale: float | None = None,
        zero_centred_qk_norm: bool = False,
        interleaved_rotary: bool = False,
        rotary: bool = True,
    ) -> "Attention":
        """Sized by the DecoderArgs fields hidden_size, num_attention_heads, num_key_value_heads, head_dim."""
        return cls(
            dim=args.hidden_size,
            n_heads=args.num_attention_heads,
            n_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm_eps=qk_norm_eps,
            lora=lora,
            attention_sinks=attention_sinks,
            sliding_window=sliding_window,
            qk_norm_over_projection=qk_norm_over_projection,
            softmax_scale=softmax_scale,
            zero_centred_qk_norm=zero_centred_qk_norm,
            interleaved_rotary=interleaved_rotary,
            rotary=rotary,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        cache=None,
        context_parallel: ContextParallelGroup | None = None,
    ) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. `cache`: a layer's KV cache during generation (see
        archon/rollout/kv_cache.py), or None. context_parallel: see packed_attention."""
        T = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm_over_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = q.view(T, -1, self.head_dim)
        k = k.view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_over_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            if cos is None or sin is None:
                raise ValueError(
                    "Attention got no RoPE tables (cos/sin None): the model was built with rotary=None; a family "
                    "without RoPE builds its Attention with rotary=False"
                )
            q = apply_rotary(q, cos, sin, self.interleaved_rotary)
            k = apply_rotary(k, cos, sin, self.interleaved_rotary)
        # Under tensor parallelism the sinks are sharded with the q heads; this rank's shard matches its heads.
        sinks = None if self.sinks is None else local_tensor(self.sinks)
        out = None if cache is None else cache.attention(q, k, v, self.scale, sinks, self.sliding_window)
        if out is None:  # training, or a prefill (the cache has stored k and v)
            out = packed_attention(
                q, k, v, cu_seqlens, max_seqlen, self.scale, sinks, self.sliding_window, context_parallel
            )
        return self.o_proj(out.reshape(T, -1))


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate, QK-norm and partial rotary; HF name `self_attn`.

    q_proj: [H * 2 * head_dim, dim], each head's query rows then its gate rows. `args` needs the HF
    fields hidden_size, head_dim, num_attention_heads, num_key_value_heads, attention_bias and
    rms_norm_eps (Qwen3.5, Qwen3-Next).
    """

    def __init__(self, args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        n_heads, n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        if n_heads % n_kv_heads:
            raise ValueError(
                f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})"
            )
        bias = args.attention_bias
        self.head_dim = hd
        self.scale = hd**-0.5
        self.q_proj = linear(dim, n_heads * 2 * hd, bias, "q_proj", lora)
        self.k_proj = linear(dim, n_kv_heads * hd, bias, "k_proj", lora)
        self.v_proj = linear(dim, n_kv_heads * hd, bias, "v_proj", lora)
        self.o_proj = linear(n_heads * hd, dim, bias, "o_proj", lora)
        self.q_norm = OffsetRMSNorm(hd, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, args.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. `cache`: a layer's KV cache during generation, or None.
        context_parallel: see packed_attention."""
        T, hd = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(T, -1, 2 * hd).split(hd, dim=-1)  # [T, H, hd] each
        k = self.k_proj(x).view(T, -1, hd)
        v = self.v_proj(x).view(T, -1, hd)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        out = None if cache is None else cache.attention(q, k, v, self.scale)
        if out is None:  # training, or a prefill (the cache has stored k and v)
            out = packed_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, context_parallel=context_parallel)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(T, -1))
