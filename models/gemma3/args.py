from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import (
    SlidingWindowDecoderArgs,
    language_model_fields_from_hf,
    rope_parameters_by_layer_type,
)

# The MLP gate's activation, HF's `hidden_activation` (gelu with the tanh approximation).
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"


@dataclass
class Gemma3Args(SlidingWindowDecoderArgs):
    """Gemma 3 text hyper-parameters, named as in HF's Gemma3TextConfig.

    rope_parameters is keyed by layer type ({"sliding_attention": {...}, "full_attention": {...}}):
    another theta per type, and scaling on the full-attention layers only. Every layer has q/k/v/o
    bias or none (attention_bias); the softmax scale is query_pre_attn_scalar**-0.5.
    vision_language: the checkpoint is the vision-language composite (`gemma3`: Gemma 3 4B-27B as
    released), whose language model archon builds and trains; the vision tower and projector are
    neither built nor changed.
    """

    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0
    vision_language: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "Gemma3Args":
        """`config`: a text config (gemma3_text) or the composite's (gemma3), whose `text_config` is
        read (the composite's fields mm_tokens_per_image, boi/eoi/image_token_index only place image
        embeddings, which a text-only sequence has none of)."""
        text = config.get_text_config()
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(text, field)
            if value is not None:
                raise ValueError(
                    f"config.{field}={value!r} is not supported for {text.model_type!r}: archon has no "
                    "soft-capping (released Gemma 3 checkpoints set it to None)"
                )
        if text.use_bidirectional_attention:
            raise ValueError(
                f"config.use_bidirectional_attention={text.use_bidirectional_attention!r} is not supported: "
                "archon's attention is causal"
            )
        return cls(
            **language_model_fields_from_hf(
                config,
                mlp_activations=(GEMMA3_ACTIVATION,),
                rope_parameters=rope_parameters_by_layer_type(text, "gemma3"),
            ),
            sliding_window=text.sliding_window,
            layer_types=list(text.layer_types),
            attention_bias=bool(text.attention_bias),
            query_pre_attn_scalar=float(text.query_pre_attn_scalar),
            vision_language=text is not config,
        )
