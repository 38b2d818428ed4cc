"""Hybrid decoders of gated DeltaNet layers (`linear_attn`) and gated full-attention layers
(`self_attn`), mixed as `layer_types` says, with zero-centred norms (Qwen3.5 / Qwen3.6, Qwen3-Next),
and their tensor-parallel plan.

TP shards heads. Gated attention as any GQA attention (q_proj's rows are per head, query then gate,
so a head's gate stays with it), QK-norms on the local heads. Gated DeltaNet by key head, with the
value heads each key head serves (`gated_deltanet_plan`). The family's MLP plans say how its dense
MLPs and shared experts shard; routers, routed experts and the shared-expert gate stay whole on
every tensor-parallel rank (FSDP2 shards the experts on their expert dimension).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from archon.lora import LoRAConfig
from archon.models.common.args import FULL_ATTENTION, LINEAR_ATTENTION
from archon.models.common.attention import GatedAttention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.dense_parallel import vocab_parallel_plan
from archon.models.common.linear_attention import GatedDeltaNet, gated_deltanet_plan
from archon.models.common.moe import routed_experts
from archon.models.common.mtp import MTPLayer
from archon.models.common.norms import OffsetRMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.parallel import ParallelConfig, ParallelDims, attention_plan, parallelize_decoder, require_divisible


class HybridDecoderLayer(nn.Module):
    """h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)), with zero-centred
    norms, where the mixer is `linear_attn` (gated DeltaNet) or `self_attn` (gated attention) as
    `args.layer_types[layer_idx]` (or `layer_type`) says (Qwen3.5, Qwen3-Next)."""

    def __init__(
        self,
        args,
        layer_idx: int,
        mlp: nn.Module,
        lora: LoRAConfig | None,
        fused_projections: bool = False,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self.layer_type = args.layer_types[layer_idx] if layer_type is None else layer_type
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args, lora, fused_projections)
        else:
            self.self_attn = GatedAttention(args, lora)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        x = x + self.mixer(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoderLM(PackedDecoderLM):
    """A `PackedDecoderLM` of `HybridDecoderLayer`s: RoPE on the first `args.rotary_dim` features of
    each attention head, and a zero-centred final norm."""

    def __init__(self, args, layers) -> None:
        rotary = RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings)
        super().__init__(args, rotary, layers)
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)


def hybrid_mtp_layers(args, mlp: nn.Module, lora: LoRAConfig | None, fused_projections: bool = False) -> nn.ModuleList:
    """The MTP layers of a hybrid checkpoint (Qwen3.5, Qwen3-Next): `args.num_mtp_layers` (at most
    one) of models/common/mtp.py, whose block is a full-attention layer with `mlp` and, when
    `args.mtp_lora`, the model's `lora` (as `mlp` must be built), and whose norms are zero-centred.
    The checkpoint layout has one `mtp.fc` and one set of norms for all its MTP blocks, so more than
    one layer is refused."""
    if args.num_mtp_layers > 1:
        raise ValueError(
            f"the checkpoint has {args.num_mtp_layers} MTP layers (config.{args.mtp_config_field}); archon builds "
            "the one-layer MTP of released checkpoints"
        )
    return nn.ModuleList(
        MTPLayer(
            args.hidden_size,
            args.rms_norm_eps,
            HybridDecoderLayer(
                args, 0, mlp, lora if args.mtp_lora else None, fused_projections, layer_type=FULL_ATTENTION
            ),
            OffsetRMSNorm,
        )
        for _ in range(args.num_mtp_layers)
    )


def parallelize_hybrid_decoder(
    model: HybridDecoderLM,
    dims: ParallelDims,
    config: ParallelConfig,
    family: str,
    mlp_plan: Callable[[int], dict[str, ParallelStyle]],
    mlp_sizes: Mapping[str, int],
    fused_projections: bool = False,
) -> HybridDecoderLM:
    """TP plan of a `HybridDecoderLM`, then the generic AC / compile / FSDP2 pipeline.

    mlp_plan(layer_idx): the styles of that layer's MLP (names relative to the layer);
    mlp_sizes: the config fields those plans shard, which the TP degree must divide;
    fused_projections: the DeltaNet layers' input projections are fused (see `GatedDeltaNet`)."""
    args = model.args
    experts = routed_experts(model)
    if dims.tp_enabled:
        require_divisible(
            "tp",
            dims.tp,
            family,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            linear_num_key_heads=args.linear_num_key_heads,
            vocab_size=args.vocab_size,
            **mlp_sizes,
        )
    if dims.ep_enabled:
        if not experts:
            raise ValueError(f"ep={dims.ep} requested but this {family} model has no routed experts")
        require_divisible("ep", dims.ep, family, num_experts=args.num_experts)
    attention = attention_plan(qk_norm=("q_norm", "k_norm"))
    deltanet = gated_deltanet_plan(fused_projections=fused_projections)

    def block_plan(index: int, block: HybridDecoderLayer) -> dict[str, ParallelStyle]:
        mixer = deltanet if block.layer_type == LINEAR_ATTENTION else attention
        return {**mixer, **mlp_plan(index)}

    return parallelize_decoder(
        model,
        dims,
        config,
        blocks=list(model.layers),
        model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=block_plan,
        routed_experts=experts,
        num_experts=args.num_experts,
        context_parallel_heads=dict(
            num_attention_heads=args.num_attention_heads, linear_num_key_heads=args.linear_num_key_heads
        ),
        context_parallel_kv_heads=dict(num_key_value_heads=args.num_key_value_heads),
    )
