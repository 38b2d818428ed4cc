"""Hyper-parameters every decoder family shares, named as in the HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from archon.models.common.rope import ROPE_TYPES

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"  # a recurrent (gated DeltaNet) layer in a hybrid


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


def mlp_activation_from_hf(config, supported: tuple[str, ...] = ("silu",)) -> str:
    """The MLP's activation, from `hidden_act` or (Gemma) `hidden_activation`; 'silu' when the
    config has neither. A value outside `supported`, in either field, is refused, naming the field."""
    found = []
    for name in ("hidden_act", "hidden_activation"):
        value = getattr(config, name, None)
        if value is None:
            continue
        if value not in supported:
            raise ValueError(f"config.{name}={value!r} is not supported; expected one of {list(supported)}")
        found.append(value)
    return found[0] if found else "silu"


def decoder_fields_from_hf(
    config, mlp_activations: tuple[str, ...] = ("silu",), rope_parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The DecoderArgs fields of an HF config, as HF's modeling code resolves them.

    head_dim falls back to hidden_size // num_attention_heads when the config has none (or None);
    num_key_value_heads falls back to num_attention_heads; intermediate_size is 0 for a config
    without one (an MoE whose every MLP is routed, e.g. Qwen3.5-MoE). The MLP activation must be
    one of `mlp_activations` (the family reads which with `mlp_activation_from_hf`); attention
    dropout must be 0, since archon's attention has none.
    rope_parameters: the family's own reading of config.rope_parameters (OLMo 3's, one entry per
    layer type), taken as it is; otherwise config.rope_parameters must hold rope_theta.
    """
    mlp_activation_from_hf(config, mlp_activations)
    attention_dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if attention_dropout != 0.0:
        raise ValueError(
            f"config.attention_dropout={attention_dropout!r} is not supported; archon's attention has no dropout"
        )
    if rope_parameters is None:
        rope_parameters = getattr(config, "rope_parameters", None)
        if not rope_parameters or "rope_theta" not in rope_parameters:
            raise ValueError(f"config.rope_parameters must hold rope_theta, got {rope_parameters!r}")
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or 0,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )


def is_sparse_layer(layer_idx: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: list[int]) -> bool:
    """The Qwen MoE rule (Qwen2-MoE, Qwen3-MoE, Qwen3-Next) for whether layer `layer_idx` has routed
    experts: the model has some, the layer is not in mlp_only_layers, and (layer_idx + 1) is a
    multiple of decoder_sparse_step."""
    return num_experts > 0 and layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0


def partial_rotary_factor_from_hf(rope_parameters: dict[str, Any], head_dim: int) -> float:
    """rope_parameters["partial_rotary_factor"] (1.0 when absent): the share of each head's features
    that RoPE rotates (the first ones). Refused unless it gives a positive even number of them."""
    factor = float(rope_parameters.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"rope_parameters.partial_rotary_factor={factor} with head_dim={head_dim} gives {rotary_dim} rotary "
            "features; it must be a positive even number"
        )
    return factor


def language_model_fields_from_hf(config, fields_from_hf=None, **options) -> dict[str, Any]:
    """`fields_from_hf` (decoder_fields_from_hf unless given; with `options`) of the language model's
    config: `config` itself, or the `text_config` of a vision-language composite (Qwen3.5, Gemma 3),
    whose head HF's whole model ties by the composite's own top-level tie_word_embeddings."""
    text = config.get_text_config()
    fields = (fields_from_hf or decoder_fields_from_hf)(text, **options)
    if text is not config:
        fields["tie_word_embeddings"] = bool(config.tie_word_embeddings)
    return fields


def checked_rope_parameters(params, field: str, family: str) -> dict[str, Any]:
    """One set of rope parameters (`field` names where it is in the config), refused by name unless
    archon implements it: a rope_type of ROPE_TYPES, every feature of a head rotated."""
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"{field} must be a dict holding rope_theta, got {params!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{field}['rope_type']={rope_type!r} is not supported; supported: {ROPE_TYPES}")
    partial_rotary_factor = params.get("partial_rotary_factor", 1.0)
    if partial_rotary_factor != 1.0:
        raise ValueError(
            f"{field}['partial_rotary_factor']={partial_rotary_factor} is not supported by the {family} family "
            "(every feature of a head rotates)"
        )
    return dict(params)


def rope_parameters_by_layer_type(config, family: str) -> dict[str, dict[str, Any]]:
    """config.rope_parameters as HF's per-layer-type rotary embeddings read it (OLMo 3, Gemma 3):
    `rope_parameters[layer_type]` for each full or sliding type in config.layer_types (top-level keys
    beside the layer types are not read; another layer type is refused by name with layer_types)."""
    rope_parameters = config.rope_parameters or {}
    return {
        layer_type: checked_rope_parameters(
            rope_parameters.get(layer_type), f"config.rope_parameters[{layer_type!r}]", family
        )
        for layer_type in sorted(set(config.layer_types) & {FULL_ATTENTION, SLIDING_ATTENTION})
    }


@dataclass
class SlidingWindowDecoderArgs(DecoderArgs):
    """DecoderArgs with Qwen2-style per-layer sliding windows (Qwen2/2.5, dense Qwen3).

    layer_types: one of "full_attention" / "sliding_attention" per layer. HF derives it from
    use_sliding_window and max_window_layers (layers at index >= max_window_layers slide) unless
    the config lists it; sliding_window is None unless use_sliding_window is set.
    """

    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(
                    f"config.layer_types[{i}]={layer_type!r} is not supported; "
                    f"expected {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
                )
            if layer_type == SLIDING_ATTENTION and self.sliding_window is None:
                raise ValueError(
                    f"config.layer_types[{i}] is {SLIDING_ATTENTION!r} but config.sliding_window is None "
                    "(Qwen2/Qwen3 configs set it to None unless use_sliding_window=True)"
                )

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None


def sliding_window_fields_from_hf(config) -> dict[str, Any]:
    """The SlidingWindowDecoderArgs fields of an HF config (DecoderArgs fields included)."""
    fields = decoder_fields_from_hf(config)
    use_sliding_window = bool(getattr(config, "use_sliding_window", False))
    sliding_window = getattr(config, "sliding_window", None)
    if not use_sliding_window:
        sliding_window = None
    max_window_layers = getattr(config, "max_window_layers", fields["num_hidden_layers"])
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # configs from before layer_types existed
        layer_types = [
            SLIDING_ATTENTION if sliding_window is not None and i >= max_window_layers else FULL_ATTENTION
            for i in range(fields["num_hidden_layers"])
        ]
    return dict(fields, sliding_window=sliding_window, layer_types=list(layer_types))


@dataclass
class GroupLimitedMoEArgs(DecoderArgs):
    """DeepSeek-V3-style MoE fields (DeepSeek-V3, Kimi K2, GLM-4.5), named as in the HF config.

    The first `first_k_dense_replace` layers have a dense MLP (`intermediate_size`); the others have
    `n_routed_experts` experts of `moe_intermediate_size` behind a sigmoid, group-limited router,
    plus `n_shared_experts` always-on experts fused into one MLP.
    """

    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace


def group_limited_moe_fields_from_hf(
    config, num_experts_field: str = "n_routed_experts", rope_parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The GroupLimitedMoEArgs fields of an HF config (DecoderArgs fields included).

    num_experts_field: the config field that counts the routed experts (Kimi Linear's is
    num_local_experts); rope_parameters: as in `decoder_fields_from_hf`."""
    n_shared_experts = getattr(config, "n_shared_experts", None)
    if not n_shared_experts:
        raise ValueError(f"config.n_shared_experts={n_shared_experts!r} is not supported; it must be at least 1")
    return dict(
        decoder_fields_from_hf(config, rope_parameters=rope_parameters),
        n_routed_experts=getattr(config, num_experts_field),
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        n_shared_experts=n_shared_experts,
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
        first_k_dense_replace=getattr(config, "first_k_dense_replace", None) or 0,
    )


@dataclass
class LatentAttentionMoEArgs(GroupLimitedMoEArgs):
    """GroupLimitedMoEArgs plus the fields of multi-head latent attention (DeepSeek-V3, Kimi Linear).

    Queries come through a `q_lora_rank` bottleneck (or straight from `q_proj` when it is None); keys
    and values are expanded from one shared `kv_lora_rank` latent. A query/key head is
    `qk_nope_head_dim` features without position plus `qk_rope_head_dim` ones (rotary in DeepSeek-V3,
    used as they are in Kimi Linear); a value head is `v_head_dim`. `attention_bias` puts a bias on
    q_a_proj, kv_a_proj_with_mqa and o_proj.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def latent_attention_fields_from_hf(config) -> dict[str, Any]:
    """The LatentAttentionMoEArgs fields of an HF config that GroupLimitedMoEArgs does not have."""
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(config, name, None):
            raise ValueError(f"config.{name}={getattr(config, name, None)!r}; it must be a positive integer")
    qk_head_dim = getattr(config, "qk_head_dim", None)
    if qk_head_dim is not None and qk_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim:
        raise ValueError(
            f"config.qk_head_dim={qk_head_dim} is not qk_nope_head_dim + qk_rope_head_dim "
            f"({config.qk_nope_head_dim} + {config.qk_rope_head_dim})"
        )
    return dict(
        q_lora_rank=config.q_lora_rank or None,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        attention_bias=bool(getattr(config, "attention_bias", False)),
    )


@dataclass
class HybridDeltaNetArgs(DecoderArgs):
    """A hybrid of gated DeltaNet and gated attention layers (Qwen3.5 / Qwen3.6, Qwen3-Next), named as
    in the HF (text) config, with the sizes of the shared-expert MoE (num_experts == 0: none).

    layer_types: per layer, "linear_attention" (gated DeltaNet) or "full_attention" (gated attention).
    Each of the linear_num_key_heads key heads serves linear_num_value_heads / linear_num_key_heads
    value heads; RoPE turns the first partial_rotary_factor of each attention head.
    checkpoint_mtp_layers: the checkpoint's multi-token-prediction layers (`mtp.*`; the family's
        args say which config field counts them); num_mtp_layers: how many of them the model builds
        (0 unless build_model is asked to load them); mtp_lora: their blocks carry the model's LoRA
        (to train them), else none.
    """

    layer_types: list[str] = field(default_factory=list)
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    checkpoint_mtp_layers: int = 0
    num_mtp_layers: int = 0
    mtp_lora: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(f"config.layer_types holds {unknown}; supported: {LINEAR_ATTENTION!r}, {FULL_ATTENTION!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"config.linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"config.linear_num_key_heads ({self.linear_num_key_heads})"
            )


def hybrid_deltanet_fields_from_hf(config) -> dict[str, Any]:
    """The HybridDeltaNetArgs fields of an HF (text) config (DecoderArgs fields included)."""
    fields = decoder_fields_from_hf(config)
    return dict(
        fields,
        layer_types=list(config.layer_types),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        partial_rotary_factor=partial_rotary_factor_from_hf(fields["rope_parameters"], fields["head_dim"]),
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        num_experts=getattr(config, "num_experts", 0) or 0,
        num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) or 0,
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )
