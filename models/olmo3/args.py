from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import (
    FULL_ATTENTION,
    SlidingWindowDecoderArgs,
    checked_rope_parameters,
    decoder_fields_from_hf,
    rope_parameters_by_layer_type,
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
            rope_parameters = {
                FULL_ATTENTION: checked_rope_parameters(config.rope_parameters, "config.rope_parameters", "olmo3")
            }
        else:
            layer_types = list(config.layer_types)
            sliding_window = config.sliding_window
            rope_parameters = rope_parameters_by_layer_type(config, "olmo3")
        return cls(
            **decoder_fields_from_hf(config, rope_parameters=rope_parameters),
            sliding_window=sliding_window,
            layer_types=layer_types,
            attention_bias=bool(config.attention_bias),
        )
