"""GLM-4-0414 (glm4) on packed sequences.

GQA with q/k/v bias (`attention_bias`; o_proj has none); RoPE on the first `partial_rotary_factor`
of each head's features, taken as interleaved pairs; a SwiGLU MLP whose gate and up projections
are one fused `gate_up_proj` (gate rows, then up rows), as HF stores and PEFT adapts it; four
RMSNorms per layer (sandwich: before and after attention, before and after the MLP). Module names
follow HF without the `model.` prefix, so the state-dict converter is a rename.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.models.glm4.args import Glm4Args


class Glm4MLP(nn.Module):
    """down(silu(gate) * up), gate and up the two halves of gate_up_proj(x) ([T, 2 * hidden])."""

    def __init__(self, dim: int, hidden_dim: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = linear(dim, 2 * hidden_dim, False, "gate_up_proj", lora)
        self.down_proj = linear(hidden_dim, dim, False, "down_proj", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class Glm4DecoderLayer(nn.Module):
    """h = x + post_self_attn_layernorm(self_attn(input_layernorm(x)));
    out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))."""

    def __init__(self, args: Glm4Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention.from_args(
            args, lora, qkv_bias=args.attention_bias, o_bias=False, interleaved_rotary=True
        )
        self.post_self_attn_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = Glm4MLP(dim, args.intermediate_size, lora)
        self.post_mlp_layernorm = RMSNorm(dim, eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        """x: [T, dim] -> [T, dim]."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        x = x + self.post_self_attn_layernorm(attn)
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4Model(PackedDecoderLM):
    def __init__(self, args: Glm4Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings),
            (Glm4DecoderLayer(args, lora) for _ in range(args.num_hidden_layers)),
        )
