"""Gemma 3's language model (gemma3_text, or the text part of the gemma3 composite) on packed sequences.

Embeddings scaled by sqrt(hidden_size); zero-centred (1 + weight) RMSNorms everywhere, four per
layer (sandwich: a norm before and after attention and before and after the MLP); per-head QK-norm;
a GeGLU MLP (gelu with the tanh approximation); softmax scale query_pre_attn_scalar**-0.5; sliding
and full-attention layers (layer_types), each type with its own RoPE parameters. Module names follow
HF without the `model.` prefix, so the state-dict converter is a rename.
"""

from __future__ import annotations

from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.mlp import GeGLUMLP
from archon.models.common.norms import OffsetRMSNorm
from archon.models.common.rope import LayerTypeRotaryEmbedding
from archon.models.gemma3.args import Gemma3Args


class Gemma3DecoderLayer(nn.Module):
    """h = x + post_attention_layernorm(self_attn(input_layernorm(x)));
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""

    def __init__(self, args: Gemma3Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(dim, eps)
        self.self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm_eps=eps,
            sliding_window=args.layer_sliding_window(layer_idx),
            softmax_scale=args.query_pre_attn_scalar**-0.5,
            zero_centred_qk_norm=True,
        )
        self.post_attention_layernorm = OffsetRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(dim, eps)
        self.mlp = GeGLUMLP(dim, args.intermediate_size, bias=False, lora=lora)
        self.post_feedforward_layernorm = OffsetRMSNorm(dim, eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        """x: [T, dim] -> [T, dim]."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(PackedDecoderLM):
    def __init__(self, args: Gemma3Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            LayerTypeRotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (Gemma3DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
            norm=OffsetRMSNorm(args.hidden_size, args.rms_norm_eps),
            embedding_scale=args.hidden_size**0.5,
        )
