from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf


@dataclass
class LlamaArgs(DecoderArgs):
    """Llama (2, 3, 3.1, 3.2, 3.3) hyper-parameters, named as in the HF config.

    head_dim may differ from hidden_size // num_attention_heads; rope_parameters may carry
    rope_type "llama3" (or linear / yarn / default).
    """

    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "LlamaArgs":
        # Llama-shaped configs of other types (e.g. Mistral) may carry a window; this model has none.
        sliding_window = getattr(config, "sliding_window", None)
        if sliding_window is not None:
            raise ValueError(
                f"config.sliding_window={sliding_window} is not supported by the llama family "
                "(full causal attention only); set it to None or use a family with windowed attention"
            )
        return cls(
            **decoder_fields_from_hf(config),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )
