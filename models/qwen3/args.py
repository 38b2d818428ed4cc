from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import SlidingWindowDecoderArgs, is_sparse_layer, sliding_window_fields_from_hf


@dataclass
class Qwen3Args(SlidingWindowDecoderArgs):
    """Qwen3 (dense) and Qwen3-MoE hyper-parameters, named as in the HF config; dense Qwen3 has
    Qwen2's per-layer sliding windows."""

    attention_bias: bool = False
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(layer_idx, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @classmethod
    def from_hf_config(cls, config) -> "Qwen3Args":
        if getattr(config, "use_sliding_window", False) and getattr(config, "layer_types", None) is None:
            # Qwen3-MoE's config has no layer_types: HF slides every layer of it
            raise ValueError(
                f"config.use_sliding_window=True is not supported for {config.model_type!r} "
                "(a config without layer_types)"
            )
        return cls(
            **sliding_window_fields_from_hf(config),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            num_experts=getattr(config, "num_experts", 0) or 0,
            num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            decoder_sparse_step=getattr(config, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(getattr(config, "mlp_only_layers", None) or []),
        )
