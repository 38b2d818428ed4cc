"""Qwen3.5 / Qwen3.6 (dense and MoE) on packed sequences: a hybrid of gated DeltaNet layers
(`linear_attn`) and gated full-attention layers (`self_attn`), as `layer_types` says.

Gated DeltaNet, per value head with state S [dk, dv] and for each token t:
    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
after a short causal depthwise conv (then silu) over the fused q/k/v projection, L2-normed q and k,
q scaled by dk^-0.5, beta = sigmoid(in_proj_b x), g = -exp(A_log) * softplus(in_proj_a x + dt_bias),
and the output gated-RMSNormed with silu(in_proj_z x) before out_proj. Key heads serve
`linear_num_value_heads / linear_num_key_heads` value heads each. The recurrent state and the conv
window start from zero at every packed sequence (or from the generation cache).

Gated attention: q_proj yields each head's query and an output gate side by side; the attention
output is multiplied by sigmoid(gate) before o_proj. QK-norm per head, RoPE on the first
`partial_rotary_factor` of each head.

Layout differences from HF (the state-dict converter maps them): `in_proj_qkv` rows and the conv
channels are ordered per key head, [q_h, k_h, v of h's value heads] for h = 0, 1, ..., so that a
contiguous shard of them (tensor parallelism) holds whole heads. Module names otherwise follow HF.
"""

from __future__ import annotations

from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.hybrid import HybridDecoderLayer, HybridDecoderLM, hybrid_mtp_layers
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import SharedExpertMoE
from archon.models.common.mtp import MultiTokenPredictionLM
from archon.models.qwen3_5.args import Qwen3_5Args


def qwen3_5_mlp(args: Qwen3_5Args, lora: LoRAConfig | None) -> nn.Module:
    """Every layer's MLP: routed experts plus the gated shared expert (MoE), or a SwiGLU MLP (dense)."""
    if args.num_experts:
        return SharedExpertMoE(args, lora)
    return SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)


class Qwen3_5Model(MultiTokenPredictionLM, HybridDecoderLM):
    """The hybrid decoder, plus `args.num_mtp_layers` MTP layers (`hybrid_mtp_layers`)."""

    def __init__(self, args: Qwen3_5Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args, (HybridDecoderLayer(args, i, qwen3_5_mlp(args, lora), lora) for i in range(args.num_hidden_layers))
        )
        mtp_lora = lora if args.mtp_lora else None
        self.mtp = (
            hybrid_mtp_layers(args, qwen3_5_mlp(args, mtp_lora), lora) if args.num_mtp_layers else nn.ModuleList()
        )
