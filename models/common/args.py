"""Hyper-parameters every decoder family shares, named as in the HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool


def decoder_fields_from_hf(config) -> dict[str, Any]:
    """The DecoderArgs fields of an HF config, as HF's modeling code resolves them.

    head_dim falls back to hidden_size // num_attention_heads when the config has none (or None);
    num_key_value_heads falls back to num_attention_heads.
    """
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.hidden_act={hidden_act!r} is not supported; the SwiGLU MLP uses 'silu'")
    rope_parameters = getattr(config, "rope_parameters", None)
    if not rope_parameters or "rope_theta" not in rope_parameters:
        raise ValueError(f"config.rope_parameters must hold rope_theta, got {rope_parameters!r}")
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )
