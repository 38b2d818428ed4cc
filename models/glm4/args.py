from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf, partial_rotary_factor_from_hf


@dataclass
class Glm4Args(DecoderArgs):
    """GLM-4-0414 (dense) hyper-parameters, named as in the HF config.

    attention_bias: a bias on q/k/v_proj (o_proj never has one).
    partial_rotary_factor: the share of each head's features that RoPE rotates (the first ones, as
    interleaved pairs); HF's Glm4Config defaults it to 0.5 and keeps it in rope_parameters.
    """

    attention_bias: bool = True
    partial_rotary_factor: float = 0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config) -> "Glm4Args":
        fields = decoder_fields_from_hf(config)
        return cls(
            **fields,
            attention_bias=bool(config.attention_bias),
            partial_rotary_factor=partial_rotary_factor_from_hf(fields["rope_parameters"], fields["head_dim"]),
        )
