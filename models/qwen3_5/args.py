from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import DecoderArgs, language_model_fields_from_hf

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass
class Qwen3_5Args(DecoderArgs):
    """Qwen3.5 / Qwen3.6 (dense and MoE) hyper-parameters, named as in the HF text config.

    layer_types: per layer, "linear_attention" (gated DeltaNet) or "full_attention" (gated attention).
    vision_language: the checkpoint is a vision-language composite (`text_config` and
        `vision_config`; language-model weights under `model.language_model.`), of which archon
        builds and trains the language model only.
    """

    layer_types: list[str] = field(default_factory=list)
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (num_experts == 0 means dense): every layer's MLP is routed experts plus a gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    vision_language: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @classmethod
    def from_hf_config(cls, config) -> "Qwen3_5Args":
        """`config`: a text config (qwen3_5_text, qwen3_5_moe_text) or a composite one (qwen3_5,
        qwen3_5_moe) whose `text_config` is read, but for `tie_word_embeddings`, read at the top
        level as HF's vision-language model reads it."""
        text = config.get_text_config()
        fields = language_model_fields_from_hf(config)
        args = cls(
            **fields,
            layer_types=list(text.layer_types),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            partial_rotary_factor=float(fields["rope_parameters"].get("partial_rotary_factor", 1.0)),
            linear_conv_kernel_dim=text.linear_conv_kernel_dim,
            linear_key_head_dim=text.linear_key_head_dim,
            linear_value_head_dim=text.linear_value_head_dim,
            linear_num_key_heads=text.linear_num_key_heads,
            linear_num_value_heads=text.linear_num_value_heads,
            num_experts=getattr(text, "num_experts", 0) or 0,
            num_experts_per_tok=getattr(text, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(text, "moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=getattr(text, "shared_expert_intermediate_size", 0) or 0,
            vision_language=text is not config,
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
        if self.num_experts == 0 and self.intermediate_size <= 0:
            raise ValueError("a dense Qwen3.5 config needs intermediate_size > 0")
