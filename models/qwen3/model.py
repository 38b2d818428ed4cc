"""Qwen3 (per-layer sliding windows as Qwen2) and Qwen3-MoE on packed sequences.

Module names follow HF (`layers.0.self_attn.q_proj`, `mlp.experts.gate_up_proj`, ...) without the
`model.` prefix, so the state-dict converter is a rename plus expert stacking.
"""

from __future__ import annotations

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import GroupedExperts, SoftmaxTopKRouter, SparseMoE
from archon.models.common.rope import RotaryEmbedding
from archon.models.qwen3.args import Qwen3Args


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: Qwen3Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm_eps=args.rms_norm_eps,
            sliding_window=args.layer_sliding_window(layer_idx),
        )
        if args.is_moe_layer(layer_idx):
            mlp = SparseMoE(
                SoftmaxTopKRouter(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob),
                GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size, lora),
            )
        else:
            mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, mlp)


class Qwen3Model(PackedDecoderLM):
    def __init__(self, args: Qwen3Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (Qwen3DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
