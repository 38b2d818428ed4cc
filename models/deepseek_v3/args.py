from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from archon.models.common.args import (
    LatentAttentionMoEArgs,
    group_limited_moe_fields_from_hf,
    latent_attention_fields_from_hf,
)


@dataclass
class DeepseekV3Args(LatentAttentionMoEArgs):
    """DeepSeek-V3 / Kimi K2 hyper-parameters, named as in the HF config.

    Multi-head latent attention (see LatentAttentionMoEArgs) whose `qk_rope_head_dim` features are
    rotary; `head_dim` is that rotary part, which sizes the RoPE tables.

    checkpoint_mtp_layers: the checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`),
        stored as decoder layers numbered from num_hidden_layers on.
    num_mtp_layers: how many of them the model builds (0 unless build_model is asked to load them).
    mtp_lora: the MTP layers' blocks carry the model's LoRA (to train them), else none.
    """

    mtp_config_field: ClassVar[str] = "num_nextn_predict_layers"

    rope_interleave: bool = True
    checkpoint_mtp_layers: int = 0
    num_mtp_layers: int = 0
    mtp_lora: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "DeepseekV3Args":
        fields = group_limited_moe_fields_from_hf(config)
        fields["head_dim"] = config.qk_rope_head_dim
        latent_fields = latent_attention_fields_from_hf(config)
        if config.qk_rope_head_dim % 2:
            raise ValueError(f"config.qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        return cls(
            **fields,
            **latent_fields,
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            checkpoint_mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
        )
