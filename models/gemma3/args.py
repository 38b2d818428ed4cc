from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import SlidingWindowDecoderArgs, decoder_fields_from_hf

# The MLP gate's activation, HF's `hidden_activation` (gelu with the tanh approximation).
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"


@dataclass
class Gemma3Args(SlidingWindowDecoderArgs):
    """Gemma 3 text hyper-parameters, named as in HF's Gemma3TextConfig.

    rope_parameters is keyed by layer type ({"sliding_attention": {...}, "full_attention": {...}}):
    another theta per type, and scaling on the full-attention layers only. Every layer has q/k/v/o
    bias or none (attention_bias); the softmax scale is query_pre_attn_scalar**-0.5.
    """

    attention_bias: bool = False
    query_pre_attn_scalar: float = 256.0

    @classmethod
    def from_hf_config(cls, config) -> "Gemma3Args":
        # Inert HF config fields (the math does not depend on them; for the spec's
        # inert_hf_config_fields once the field exists):
        #   attention_dropout: dropout on the attention weights, off in evaluation, and archon's
        #     attention has no dropout (the trainer runs HF's eval-mode math);
        #   pad_token_id: HF's embedding padding_idx only keeps the pad row's gradient zero, and
        #     archon never trains the embedding;
        #   sliding_window_pattern: read by HF only to derive layer_types, which is read instead.
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(config, field)
            if value is not None:
                raise ValueError(
                    f"config.{field}={value!r} is not supported for {config.model_type!r}: archon has no "
                    "soft-capping (released Gemma 3 checkpoints set it to None)"
                )
        if config.use_bidirectional_attention:
            raise ValueError(
                f"config.use_bidirectional_attention={config.use_bidirectional_attention!r} is not supported: "
                "archon's attention is causal"
            )
        return cls(
            **decoder_fields_from_hf(
                config, activation_field="hidden_activation", activations=(GEMMA3_ACTIVATION,),
                rope_per_layer_type=True,
            ),
            sliding_window=config.sliding_window,
            layer_types=list(config.layer_types),
            attention_bias=bool(config.attention_bias),
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        )
