from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import (
    GroupLimitedMoEArgs,
    group_limited_moe_fields_from_hf,
)


@dataclass
class DeepseekV3Args(GroupLimitedMoEArgs):
    """DeepSeek-V3 / Kimi K2 hyper-parameters, named as in the HF config.

    Multi-head latent attention: queries come through a `q_lora_rank` bottleneck (or straight from
    `q_proj` when it is None); keys and values are expanded from one shared `kv_lora_rank` latent.
    A query/key head is `qk_nope_head_dim` features without position plus `qk_rope_head_dim` rotary
    ones; a value head is `v_head_dim`. `head_dim` is the rotary part, which sizes the RoPE tables.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, config) -> "DeepseekV3Args":
        fields = group_limited_moe_fields_from_hf(config)
        fields["head_dim"] = config.qk_rope_head_dim
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(config, name, None):
                raise ValueError(f"config.{name}={getattr(config, name, None)!r}; it must be a positive integer")
        qk_head_dim = getattr(config, "qk_head_dim", None)
        if qk_head_dim is not None and qk_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim:
            raise ValueError(
                f"config.qk_head_dim={qk_head_dim} is not qk_nope_head_dim + qk_rope_head_dim "
                f"({config.qk_nope_head_dim} + {config.qk_rope_head_dim})"
            )
        if config.qk_rope_head_dim % 2:
            raise ValueError(f"config.qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        return cls(
            **fields,
            q_lora_rank=config.q_lora_rank or None,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
        )
