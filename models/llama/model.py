"""Llama 3 on packed sequences: GQA without QK-norm, optional biases, SwiGLU MLP, RoPE (llama3 scaling)."""

from __future__ import annotations

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.rope import RotaryEmbedding
from archon.models.llama.args import LlamaArgs


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: LlamaArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(args, lora, qkv_bias=args.attention_bias, o_bias=args.attention_bias)
        mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias, lora=lora)
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, mlp)


class LlamaModel(PackedDecoderLM):
    def __init__(self, args: LlamaArgs, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (LlamaDecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
