"""OLMo 3 on packed sequences: post-norm layers, QK-norm over the whole q and k projections, sliding
windows and RoPE per layer type, SwiGLU MLP.

Module names follow HF (`layers.0.self_attn.q_norm`, `layers.0.post_feedforward_layernorm`, ...)
without the `model.` prefix, so the state-dict converter is a rename.
"""

from __future__ import annotations

import torch
from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import LayerTypeRotaryEmbedding
from archon.models.olmo3.args import Olmo3Args


class Olmo3DecoderLayer(nn.Module):
    """Post-norm: h = x + post_attention_layernorm(self_attn(x)); out = h + post_feedforward_layernorm(mlp(h)).

    There is no norm on a block's input; every norm scales in fp32 before the cast back, as HF's.
    """

    def __init__(self, args: Olmo3Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm_eps=args.rms_norm_eps,
            sliding_window=args.layer_sliding_window(layer_idx),
            qk_norm_over_projection=True,
        )
        self.mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]; cos/sin: [T, head_dim], the tables of this layer's type."""
        attn = self.self_attn(x, cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo3Model(PackedDecoderLM):
    def __init__(self, args: Olmo3Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            LayerTypeRotaryEmbedding(
                args.rope_parameters, args.head_dim, args.max_position_embeddings, fp32_tables=True
            ),
            (Olmo3DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
            norm=RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True),
        )
