"""MiniMax-M2 / M2.1 (minimax_m2) on packed sequences.

GQA without biases; q_norm and k_norm are RMSNorms over the whole q and k projections (every head at
once, before the split into heads); RoPE on the first `rotary_dim` features of each head. Every
layer's MLP is a sparse MoE: sigmoid scores, the top k of scores + e_score_correction_bias chosen,
the unbiased scores of the chosen renormalised to sum to one; stacked SwiGLU experts, no shared
expert. Module names follow HF's in-memory model (`mlp.gate`, `mlp.experts`).
"""

from __future__ import annotations

from archon.lora import LoRAConfig
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.moe import GroupedExperts, SigmoidGroupTopKRouter, SparseMoE
from archon.models.common.rope import RotaryEmbedding
from archon.models.minimax_m2.args import MinimaxM2Args


def minimax_m2_moe(args: MinimaxM2Args, lora: LoRAConfig | None) -> SparseMoE:
    """HF keeps e_score_correction_bias on the MoE block (`mlp.e_score_correction_bias`); archon keeps it
    on the router, as the other sigmoid-routed families do, and the converter maps the name.

    The router's logits are computed in fp32 whatever the model dtype, as vLLM's MiniMax-M2 gate
    computes them; HF's computes them in the weight's dtype, which is the same function in fp32 and
    fp64 but rounds them to bf16 in a bf16 model."""
    router = SigmoidGroupTopKRouter(
        args.hidden_size,
        args.num_local_experts,
        args.num_experts_per_tok,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    return SparseMoE(router, GroupedExperts(args.num_local_experts, args.hidden_size, args.intermediate_size, lora))


class MinimaxM2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: MinimaxM2Args, lora: LoRAConfig | None) -> None:
        self_attn = Attention.from_args(
            args, lora, qkv_bias=False, o_bias=False, qk_norm_eps=args.rms_norm_eps, qk_norm_over_projection=True
        )
        # HF's MiniMax-M2 RMSNorm casts the normalised values back before the weight (OLMo's scales in fp32).
        self_attn.q_norm.scale_in_fp32 = self_attn.k_norm.scale_in_fp32 = False
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, minimax_m2_moe(args, lora))


class MinimaxM2Model(PackedDecoderLM):
    def __init__(self, args: MinimaxM2Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings),
            (MinimaxM2DecoderLayer(args, lora) for _ in range(args.num_hidden_layers)),
        )
