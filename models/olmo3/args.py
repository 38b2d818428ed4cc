from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SlidingWindowDecoderArgs,
    decoder_fields_from_hf,
)


@dataclass
class Olmo3Args(SlidingWindowDecoderArgs):
    """OLMo 3 and OLMo 2 hyper-parameters, named as in the HF config.

    layer_types: OLMo 3's default slides three layers of every four over `sliding_window` tokens and
    gives every fourth full attention; OLMo 2 has neither field, and every layer is full attention.
    rope_parameters: one entry per layer type (OLMo 3's released configs scale only "full_attention"
    with YaRN); OLMo 2's single set is its full-attention layers'.
    """

    attention_bias: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "Olmo3Args":
        if config.model_type == "olmo2":  # no windows, one set of rope parameters
            layer_types = [FULL_ATTENTION] * config.num_hidden_layers
            sliding_window = None
            rope_parameters = {FULL_ATTENTION: checked_rope_parameters(config.rope_parameters, "config.rope_parameters")}
        else:
            layer_types = list(config.layer_types)
            sliding_window = config.sliding_window
            rope_parameters = {
                layer_type: checked_rope_parameters(
                    (config.rope_parameters or {}).get(layer_type), f"config.rope_parameters[{layer_type!r}]"
                )
                # another layer type is refused by name in __post_init__
                for layer_type in sorted(set(layer_types) & {FULL_ATTENTION, SLIDING_ATTENTION})
            }
        return cls(
            **decoder_fields_from_hf(config, rope_parameters=rope_parameters),
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=bool(config.attention_bias),
        )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def checked_rope_parameters(params, field: str) -> dict:
    """One layer type's rope parameters (HF's Olmo3RotaryEmbedding reads `rope_parameters[layer_type]`;
    top-level keys beside the layer types are not read), refused by `field` unless archon implements them."""
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"{field} must be a dict holding rope_theta, got {params!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{field}['rope_type']={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    partial_rotary_factor = params.get("partial_rotary_factor", 1.0)
    if partial_rotary_factor != 1.0:
        raise ValueError(
            f"{field}['partial_rotary_factor']={partial_rotary_factor} is not supported by the olmo3 family "
            "(every feature of a head rotates)"
        )
    return dict(params)
