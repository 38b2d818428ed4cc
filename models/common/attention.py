"""Causal attention over packed sequences, and the GQA attention block used by the dense families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary


def _flash_varlen_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence, never across boundaries.

    q: [T, H, D], k: [T, Hkv, D], v: [T, Hkv, Dv], cu_seqlens: [N+1] -> [T, H, Dv].
    """
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if _flash_varlen_usable(q):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(torch.int32)
        return varlen_attn(
            q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0),
            enable_gqa=n_heads != n_kv_heads,
        )
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=n_heads != n_kv_heads,
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


class Attention(nn.Module):
    """Grouped-query attention with optional per-head QK RMSNorm (Qwen3) and q/k/v/o bias."""

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
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = linear(dim, n_heads * head_dim, qkv_bias, "q_proj", lora)
        self.k_proj = linear(dim, n_kv_heads * head_dim, qkv_bias, "k_proj", lora)
        self.v_proj = linear(dim, n_kv_heads * head_dim, qkv_bias, "v_proj", lora)
        self.o_proj = linear(n_heads * head_dim, dim, o_bias, "o_proj", lora)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]."""
        T = x.shape[0]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = packed_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        return self.o_proj(out.reshape(T, -1))
