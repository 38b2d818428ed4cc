from __future__ import annotations

from dataclasses import dataclass

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
    """

    rope_interleave: bool = True

    @classmethod
    def from_hf_config(cls, config) -> "DeepseekV3Args":
        fields = group_limited_moe_fields_from_hf(config)
        fields["head_dim"] = config.qk_rope_head_dim
        latent_fields = latent_attention_fields_from_hf(config)
        if config.qk_rope_head_dim % 2:
            raise ValueError(f"config.qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        return cls(**fields, **latent_fields, rope_interleave=bool(getattr(config, "rope_interleave", True)))
