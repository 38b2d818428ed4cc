"""GPT-OSS on packed sequences.

Module names follow HF (`layers.0.self_attn.sinks`, `mlp.router`, `mlp.experts.gate_up_proj`, ...)
without the `model.` prefix, and the experts keep HF's stored layout, so the state-dict converter is a
plain rename.
"""

from __future__ import annotations

import torch
from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.moe import ClampedSwiGLUExperts, TopKSoftmaxRouter
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.models.gpt_oss.args import GptOssArgs


class GptOssMoE(nn.Module):
    """Biased top-k router (HF name `router`), then clamped-SwiGLU experts; every GPT-OSS layer has one."""

    def __init__(self, args: GptOssArgs, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.router = TopKSoftmaxRouter(args.hidden_size, args.num_local_experts, args.num_experts_per_tok, bias=True)
        self.experts = ClampedSwiGLUExperts(
            args.num_local_experts,
            args.hidden_size,
            args.intermediate_size,
            alpha=args.swiglu_alpha,
            limit=args.swiglu_limit,
            lora=lora,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]."""
        top_weights, top_indices = self.router(x)
        return self.experts(x, top_weights, top_indices)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: GptOssArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            attention_sinks=True,
            sliding_window=args.layer_sliding_window(layer_idx),
        )
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, GptOssMoE(args, lora))
        # HF's GptOssRMSNorm scales in fp32 and casts back after (the order shows in bf16).
        self.input_layernorm.scale_in_fp32 = self.post_attention_layernorm.scale_in_fp32 = True


class GptOssModel(PackedDecoderLM):
    def __init__(self, args: GptOssArgs, lora: LoRAConfig | None = None) -> None:
        # HF's GPT-OSS rotary pairs dimension i with i + head_dim/2, the layout apply_rotary uses.
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (GptOssDecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
            norm=RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True),
        )
