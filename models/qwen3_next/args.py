from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import FULL_ATTENTION, LINEAR_ATTENTION, DecoderArgs, decoder_fields_from_hf


@dataclass
class Qwen3NextArgs(DecoderArgs):
    """Qwen3-Next hyper-parameters, named as in the HF config.

    layer_types: per layer, "linear_attention" (gated DeltaNet) or "full_attention" (gated attention);
        HF derives it from `full_attention_interval` (every n-th layer full) unless the config lists it.
    Layer i has a sparse MLP (routed experts plus a gated shared expert) when num_experts > 0, i is not
    in mlp_only_layers and (i + 1) is a multiple of decoder_sparse_step; otherwise a dense SwiGLU MLP
    of intermediate_size.
    """

    layer_types: list[str] = field(default_factory=list)
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, config) -> "Qwen3NextArgs":
        fields = decoder_fields_from_hf(config)
        partial_rotary_factor = float(fields["rope_parameters"].get("partial_rotary_factor", 1.0))
        args = cls(
            **fields,
            layer_types=list(config.layer_types),
            attention_bias=bool(config.attention_bias),
            partial_rotary_factor=partial_rotary_factor,
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
            num_experts=config.num_experts or 0,
            num_experts_per_tok=config.num_experts_per_tok or 0,
            moe_intermediate_size=config.moe_intermediate_size or 0,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size or 0,
            norm_topk_prob=bool(config.norm_topk_prob),
            decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers or []),
        )
        args.validate()
        return args

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(
                f"config.layer_types holds {unknown}; supported: {LINEAR_ATTENTION!r}, {FULL_ATTENTION!r}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"config.linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"config.linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"rope_parameters.partial_rotary_factor={self.partial_rotary_factor} with head_dim={self.head_dim} "
                f"gives {self.rotary_dim} rotary features; it must be a positive even number"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"config.decoder_sparse_step={self.decoder_sparse_step} must be at least 1")
        out_of_range = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if out_of_range:
            raise ValueError(f"config.mlp_only_layers holds {out_of_range}, outside 0..{self.num_hidden_layers - 1}")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"config.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"config.num_experts={self.num_experts}"
            )
        dense_layers = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense_layers and self.intermediate_size <= 0:
            raise ValueError(
                f"layers {dense_layers} have a dense MLP (mlp_only_layers, decoder_sparse_step or num_experts=0) "
                f"but config.intermediate_size={self.intermediate_size}"
            )
