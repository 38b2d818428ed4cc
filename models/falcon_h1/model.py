"""Falcon-H1 on packed sequences: every layer runs a Mamba2 mixer and attention side by side on the
same normed input, adds both to the residual, then a SwiGLU MLP behind its own norm. Module names
follow HF (`layers.<i>.mamba`, `.self_attn`, `.feed_forward`, `.input_layernorm`, `.pre_ff_layernorm`;
the final norm is HF's `final_layernorm`, archon's `norm`).

    h = input_layernorm(x)
    x = x + ssm_out * mamba(h) + attn_out * self_attn(attn_in * h)
    x = x + feed_forward(pre_ff_layernorm(x))

The muP multipliers are plain factors (args.py); the key multiplier scales q.k, so it is folded into
the attention's softmax scale, and the LM-head multiplier scales the logits, so it is applied to the
final hidden states (the unembedding is linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.head import full_vocab_logits
from archon.lora import LoRAConfig, linear
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.mamba2 import Mamba2Mixer, Mamba2Settings
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.models.falcon_h1.args import FalconH1Args


def mamba2_settings(args: FalconH1Args) -> Mamba2Settings:
    low, high = args.time_step_limit
    return Mamba2Settings(
        hidden_size=args.hidden_size,
        num_heads=args.mamba_n_heads,
        head_dim=args.mamba_d_head,
        n_groups=args.mamba_n_groups,
        state_size=args.mamba_d_state,
        conv_kernel=args.mamba_d_conv,
        use_conv_bias=args.mamba_conv_bias,
        in_proj_bias=args.mamba_proj_bias,
        out_proj_bias=args.projectors_bias,
        rms_norm_eps=args.rms_norm_eps,
        gated_norm=args.mamba_rms_norm,
        norm_before_gate=args.mamba_norm_before_gate,
        dt_min=low,
        dt_max=high,
        in_multiplier=args.ssm_in_multiplier,
        projection_multipliers=args.ssm_multipliers,
    )


class FalconH1MLP(nn.Module):
    """down_proj(up_proj(x) * silu(gate_proj(x) * gate_multiplier)) * down_multiplier (HF `FalconH1MLP`);
    biases when mlp_bias."""

    def __init__(self, args: FalconH1Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = linear(dim, hidden, bias, "gate_proj", lora)
        self.up_proj = linear(dim, hidden, bias, "up_proj", lora)
        self.down_proj = linear(hidden, dim, bias, "down_proj", lora)
        self.gate_multiplier, self.down_multiplier = args.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(h) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, args: FalconH1Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mamba = Mamba2Mixer(mamba2_settings(args), lora)
        # q.(key_multiplier k) = key_multiplier (q.k): the multiplier joins the softmax scale.
        self.self_attn = Attention.from_args(
            args,
            lora,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            softmax_scale=args.head_dim**-0.5 * args.key_multiplier,
        )
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = FalconH1MLP(args, lora)
        self.ssm_out_multiplier = args.ssm_out_multiplier
        self.attention_in_multiplier = args.attention_in_multiplier
        self.attention_out_multiplier = args.attention_out_multiplier

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        h = self.input_layernorm(x)
        ssm = self.mamba(h, cos, sin, cu_seqlens, max_seqlen, cache, context_parallel) * self.ssm_out_multiplier
        attn_in = h * self.attention_in_multiplier
        attn = self.self_attn(attn_in, cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        x = x + (ssm + attn * self.attention_out_multiplier)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1Model(PackedDecoderLM):
    def __init__(self, args: FalconH1Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings),
            (FalconH1DecoderLayer(args, lora) for _ in range(args.num_hidden_layers)),
            embedding_scale=args.embedding_multiplier,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        return_hidden: bool = False,
        cache=None,
        logits_rows: torch.Tensor | None = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """As PackedDecoderLM.forward; the final hidden states come times lm_head_multiplier, so that
        whoever unembeds them (the logits here, the trainer's chunked head) gets HF's scaled logits."""
        h = super().forward(tokens, positions, cu_seqlens, max_seqlen, True, cache, logits_rows, context_parallel)
        h = h * self.args.lm_head_multiplier
        return h if return_hidden else full_vocab_logits(h, self.output_weight)
