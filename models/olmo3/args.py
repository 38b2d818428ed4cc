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
    """OLMo 3 hyper-parameters, named as in the HF config.

    layer_types: HF's default slides three layers of every four over `sliding_window` tokens and
    gives every fourth full attention. rope_parameters: one entry per layer type (the released
    configs scale only "full_attention" with YaRN).
    """

    attention_bias: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "Olmo3Args":
        attention_dropout = getattr(config, "attention_dropout", 0.0)
        if attention_dropout:
            raise ValueError(
                f"config.attention_dropout={attention_dropout} is not supported by the olmo3 family "
                "(attention without dropout only)"
            )
        layer_types = list(config.layer_types)
        rope_parameters = layer_type_rope_parameters(config.rope_parameters, layer_types)
        return cls(
            **decoder_fields_from_hf(config, rope_parameters=rope_parameters),
            sliding_window=config.sliding_window,
            layer_types=layer_types,
            attention_bias=bool(config.attention_bias),
        )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def layer_type_rope_parameters(rope_parameters: dict, layer_types: list[str]) -> dict[str, dict]:
    """The rope parameters of each layer type in `layer_types`, as HF's Olmo3RotaryEmbedding reads
    them (`rope_parameters[layer_type]`; top-level keys beside those are not read by HF). A layer type
    other than full or sliding attention is left to SlidingWindowDecoderArgs to refuse by name."""
    by_layer_type = {}
    for layer_type in sorted(set(layer_types) & {FULL_ATTENTION, SLIDING_ATTENTION}):
        params = (rope_parameters or {}).get(layer_type)
        field = f"config.rope_parameters[{layer_type!r}]"
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
        by_layer_type[layer_type] = dict(params)
    return by_layer_type

