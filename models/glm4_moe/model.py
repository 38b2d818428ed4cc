"""GLM-4.5 (glm4_moe) on packed sequences.

GQA with optional q/k/v bias (o_proj has none) and optional per-head QK RMSNorm; RoPE on the first
`partial_rotary_factor` of each head; dense MLP in the first `first_k_dense_replace` layers, then
group-limited sigmoid routing over stacked experts plus shared experts. Module names follow HF.
"""

from __future__ import annotations

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.moe import group_limited_moe_mlp
from archon.models.common.rope import RotaryEmbedding
from archon.models.glm4_moe.args import Glm4MoeArgs


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: Glm4MoeArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=False,
            qk_norm_eps=args.rms_norm_eps if args.use_qk_norm else None,
        )
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, group_limited_moe_mlp(args, layer_idx, lora))


class Glm4MoeModel(PackedDecoderLM):
    def __init__(self, args: Glm4MoeArgs, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings),
            (Glm4MoeDecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
