"""Qwen2 / Qwen2.5 on packed sequences: GQA with q/k/v bias (none on o_proj), per-layer sliding
window, SwiGLU MLP without bias."""

from __future__ import annotations

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.rope import RotaryEmbedding
from archon.models.qwen2.args import Qwen2Args


class Qwen2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: Qwen2Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(
            args, lora, qkv_bias=True, o_bias=False, sliding_window=args.layer_sliding_window(layer_idx)
        )
        mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, mlp)


class Qwen2Model(PackedDecoderLM):
    def __init__(self, args: Qwen2Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (Qwen2DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
