from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import (
    GroupLimitedMoEArgs,
    group_limited_moe_fields_from_hf,
    partial_rotary_factor_from_hf,
)


@dataclass
class Glm4MoeArgs(GroupLimitedMoEArgs):
    """GLM-4.5 / GLM-4.6 (MoE) hyper-parameters, named as in the HF config.

    partial_rotary_factor: the share of each head's features that RoPE rotates (the first ones);
    HF reads it from rope_parameters.
    """

    attention_bias: bool = False
    use_qk_norm: bool = False
    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config) -> "Glm4MoeArgs":
        fields = group_limited_moe_fields_from_hf(config)
        return cls(
            **fields,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            use_qk_norm=bool(getattr(config, "use_qk_norm", False)),
            partial_rotary_factor=partial_rotary_factor_from_hf(fields["rope_parameters"], fields["head_dim"]),
        )
