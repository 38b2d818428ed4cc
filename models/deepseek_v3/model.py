"""DeepSeek-V3 / Kimi K2 (deepseek_v3) on packed sequences.

Multi-head latent attention (MLA) computed in its expanded form (every head's keys and values made
from the latent), dense MLP in the first `first_k_dense_replace` layers, then group-limited sigmoid
routing over stacked experts plus shared experts. Module names follow HF.
"""

from __future__ import annotations

from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.mla import MultiHeadLatentAttention
from archon.models.common.moe import group_limited_moe_mlp
from archon.models.common.mtp import MTPLayer, MultiTokenPredictionLM
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.models.deepseek_v3.args import DeepseekV3Args


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: DeepseekV3Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__(
            args.hidden_size,
            args.rms_norm_eps,
            MultiHeadLatentAttention(args, lora),
            group_limited_moe_mlp(args, layer_idx, lora),
        )


class DeepseekV3Model(MultiTokenPredictionLM, PackedDecoderLM):
    """The decoder, plus `args.num_mtp_layers` MTP layers (models/common/mtp.py) whose blocks are
    decoder layers numbered after the last one (so MoE from `first_k_dense_replace` on), with the
    model's LoRA only when they are trained (`args.mtp_lora`); their embedding at position 0 is
    zeroed, as vLLM runs them."""

    def __init__(self, args: DeepseekV3Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.qk_rope_head_dim, args.max_position_embeddings),
            (DeepseekV3DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
        self.mtp = nn.ModuleList(
            MTPLayer(
                args.hidden_size,
                args.rms_norm_eps,
                DeepseekV3DecoderLayer(args, args.num_hidden_layers + i, lora if args.mtp_lora else None),
                RMSNorm,
                zero_first_position=True,
            )
            for i in range(args.num_mtp_layers)
        )
