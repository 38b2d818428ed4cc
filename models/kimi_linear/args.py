from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import (
    LatentAttentionMoEArgs,
    group_limited_moe_fields_from_hf,
    latent_attention_fields_from_hf,
)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DENSE_MLP = "dense"
SPARSE_MLP = "sparse"


@dataclass
class KimiLinearArgs(LatentAttentionMoEArgs):
    """Kimi Linear hyper-parameters, named as in the HF config (KimiLinearConfig).

    layer_types: per layer, "linear_attention" (Kimi Delta Attention) or "full_attention" (MLA
        without positions: HF's Kimi Linear applies no RoPE, and its shared key part is used as is).
        A checkpoint's `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`) is resolved
        into it by the HF config.
    mlp_layer_types: per layer, "dense" (SwiGLU of intermediate_size) or "sparse" (group-limited
        sigmoid routing over the routed experts, plus the shared experts). HF derives it from
        `first_k_dense_replace` unless the config lists it; it decides, not first_k_dense_replace.
    MLA: see LatentAttentionMoEArgs; the qk_rope_head_dim features are used without rotation.
    KDA: linear_num_heads heads of linear_head_dim (queries, keys and values alike), short convs of
        linear_conv_kernel_dim taps.
    """

    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == SPARSE_MLP

    @classmethod
    def from_hf_config(cls, config) -> "KimiLinearArgs":
        # no rope_parameters: HF's Kimi Linear has no rotary embedding
        fields = group_limited_moe_fields_from_hf(config, num_experts_field="num_local_experts", rope_parameters={})
        fields["head_dim"] = config.qk_rope_head_dim
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError(
                f"config.num_key_value_heads={config.num_key_value_heads} differs from config.num_attention_heads="
                f"{config.num_attention_heads}; MLA expands every head's keys and values from the latent"
            )
        # Fields of released config.json files (read by their remote code) that HF's model implements
        # one way only: values that would need another are refused.
        if getattr(config, "moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError(
                f"config.moe_router_activation_func={config.moe_router_activation_func!r} is not supported; "
                "HF's Kimi Linear routes with sigmoid scores"
            )
        if getattr(config, "moe_layer_freq", 1) != 1:
            raise ValueError(
                f"config.moe_layer_freq={config.moe_layer_freq!r} is not supported; HF's Kimi Linear takes its MoE "
                "layers from mlp_layer_types (every layer from first_k_dense_replace on)"
            )
        if not getattr(config, "use_grouped_topk", True) and (config.n_group or 1) > 1:
            raise ValueError(
                f"config.use_grouped_topk=False with config.n_group={config.n_group} is not supported; HF's Kimi "
                "Linear always limits routing to the top groups"
            )
        if getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError(
                f"config.num_nextn_predict_layers={config.num_nextn_predict_layers} is not supported; HF's Kimi "
                "Linear has no multi-token-prediction layers"
            )
        if not getattr(config, "mla_use_nope", True):
            raise ValueError(
                "config.mla_use_nope=False (RoPE in the MLA layers) is not supported; HF's Kimi Linear is NoPE"
            )
        if config.tie_word_embeddings:
            raise ValueError(
                "config.tie_word_embeddings=True is not supported: HF's KimiLinearForCausalLM never ties its head "
                "(it keeps a separate lm_head), so the flag does not say what the checkpoint computes"
            )
        for name in ("linear_num_heads", "linear_head_dim"):
            if not getattr(config, name, None):
                raise ValueError(f"config.{name}={getattr(config, name, None)!r}; it must be a positive integer")
        if config.num_local_experts % (config.n_group or 1):
            raise ValueError(
                f"config.num_local_experts={config.num_local_experts} "
                f"is not a multiple of config.n_group={config.n_group}"
            )
        args = cls(
            **fields,
            **latent_attention_fields_from_hf(config),
            layer_types=list(config.layer_types),
            mlp_layer_types=list(config.mlp_layer_types),
            linear_num_heads=config.linear_num_heads,
            linear_head_dim=config.linear_head_dim,
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        )
        args.validate()
        return args

    def validate(self) -> None:
        for name, kinds in (
            ("layer_types", (LINEAR_ATTENTION, FULL_ATTENTION)),
            ("mlp_layer_types", (DENSE_MLP, SPARSE_MLP)),
        ):
            pattern = getattr(self, name)
            if len(pattern) != self.num_hidden_layers:
                raise ValueError(f"config.{name} has {len(pattern)} entries for {self.num_hidden_layers} layers")
            for i, kind in enumerate(pattern):
                if kind not in kinds:
                    raise ValueError(f"config.{name}[{i}]={kind!r} is not supported; expected one of {kinds}")
        if DENSE_MLP in self.mlp_layer_types and self.intermediate_size <= 0:
            raise ValueError("config.intermediate_size must be positive when config.mlp_layer_types has 'dense' layers")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"config.linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be at least 1")
