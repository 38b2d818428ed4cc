"""Qwen3-Next on packed sequences: a hybrid of gated DeltaNet layers (`linear_attn`) and gated
full-attention layers (`self_attn`) as `layer_types` says, zero-centred RMSNorms, RoPE on the first
`partial_rotary_factor` of each attention head, and per layer either a sparse MLP (softmax top-k
routed experts plus a shared expert gated by sigmoid(shared_expert_gate x)) or a dense SwiGLU MLP
(`mlp_only_layers`, `decoder_sparse_step`).

The mixers are those of Qwen3.5 (models/common/linear_attention.py, models/common/attention.py);
Qwen3-Next's DeltaNet fuses its input projections as HF stores them: `in_proj_qkvz` (per key head,
q | k | v | z) and `in_proj_ba` (per key head, b | a). Layout difference from HF (the state-dict
converter maps it): the conv channels are ordered per key head, [q_h, k_h, v of h's value heads],
as the rows they convolve, so that a contiguous shard holds whole heads (tensor parallelism).
"""

from __future__ import annotations

from torch import nn

from archon.lora import LoRAConfig
from archon.models.common.hybrid import HybridDecoderLayer, HybridDecoderLM, hybrid_mtp_layers
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import SharedExpertMoE
from archon.models.common.mtp import MultiTokenPredictionLM
from archon.models.qwen3_next.args import Qwen3NextArgs


def qwen3_next_mlp(args: Qwen3NextArgs, layer_idx: int, lora: LoRAConfig | None) -> nn.Module:
    if args.is_moe_layer(layer_idx):
        return SharedExpertMoE(args, lora, norm_topk_prob=args.norm_topk_prob)
    return SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)


class Qwen3NextModel(MultiTokenPredictionLM, HybridDecoderLM):
    """The hybrid decoder, plus `args.num_mtp_layers` MTP layers (`hybrid_mtp_layers`), whose block
    has the MLP of layer 0 (as vLLM builds it)."""

    def __init__(self, args: Qwen3NextArgs, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            (
                HybridDecoderLayer(args, i, qwen3_next_mlp(args, i, lora), lora, fused_projections=True)
                for i in range(args.num_hidden_layers)
            ),
        )
        self.mtp = (
            hybrid_mtp_layers(
                args, qwen3_next_mlp(args, 0, lora if args.mtp_lora else None), lora, fused_projections=True
            )
            if args.num_mtp_layers
            else nn.ModuleList()
        )
