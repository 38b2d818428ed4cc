from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf, partial_rotary_factor_from_hf

# attn_type_list entries: 1 is softmax attention, the only kind MiniMax-M2 has (MiniMax-Text-01's 0,
# lightning attention, is not implemented).
SOFTMAX_ATTENTION = 1


@dataclass
class MinimaxM2Args(DecoderArgs):
    """MiniMax-M2 / M2.1 hyper-parameters, named as in the HF config (intermediate_size is per expert).

    Every layer is GQA attention with q_norm / k_norm over the whole projection, then a sparse MoE of
    `num_local_experts` experts behind a sigmoid router with a score-correction bias; no shared
    expert, no dense layer. partial_rotary_factor: the share of each head's features RoPE rotates
    (the first ones); released configs give it as `rotary_dim`, which HF converts.
    """

    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    partial_rotary_factor: float = 1.0

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config) -> "MinimaxM2Args":
        fields = decoder_fields_from_hf(config)
        _refuse_unimplemented(config)
        partial_rotary_factor = partial_rotary_factor_from_hf(fields["rope_parameters"], fields["head_dim"])
        args = cls(
            **fields,
            num_local_experts=config.num_local_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            partial_rotary_factor=partial_rotary_factor,
        )
        rotary_dim = getattr(config, "rotary_dim", None)
        if rotary_dim is not None and rotary_dim != args.rotary_dim:
            # HF rotates partial_rotary_factor * head_dim features and ignores rotary_dim when both are given
            raise ValueError(
                f"config.rotary_dim={rotary_dim} disagrees with rope_parameters.partial_rotary_factor="
                f"{partial_rotary_factor} (x head_dim {args.head_dim} = {args.rotary_dim})"
            )
        if not 1 <= args.num_experts_per_tok <= args.num_local_experts:
            raise ValueError(
                f"config.num_experts_per_tok={args.num_experts_per_tok} must be between 1 and "
                f"config.num_local_experts={args.num_local_experts}"
            )
        return args


def _refuse_unimplemented(config) -> None:
    """Config values of MiniMax checkpoints that change the math in a way archon (and HF's MiniMax-M2) does
    not implement, each refused by name. Fields HF's config class lacks are read only when present (and
    not None)."""
    if config.router_jitter_noise:
        raise ValueError(f"config.router_jitter_noise={config.router_jitter_noise} is not supported; it must be 0")
    # HF normalises q and k over the whole projection and adds the routing bias whatever these say.
    if getattr(config, "use_qk_norm", None) is False:
        raise ValueError(f"config.use_qk_norm={config.use_qk_norm!r} is not supported; MiniMax-M2 normalises q and k")
    qk_norm_type = getattr(config, "qk_norm_type", None)
    if qk_norm_type not in (None, "per_layer"):
        raise ValueError(
            f"config.qk_norm_type={qk_norm_type!r} is not supported; only 'per_layer' (one norm over all heads)"
        )
    scoring_func = getattr(config, "scoring_func", None)
    if scoring_func not in (None, "sigmoid"):
        raise ValueError(f"config.scoring_func={scoring_func!r} is not supported; only 'sigmoid'")
    if getattr(config, "use_routing_bias", None) is False:
        raise ValueError(
            f"config.use_routing_bias={config.use_routing_bias!r} is not supported; the router adds "
            "e_score_correction_bias"
        )
    shared_intermediate_size = getattr(config, "shared_intermediate_size", 0)
    if shared_intermediate_size:
        raise ValueError(
            f"config.shared_intermediate_size={shared_intermediate_size} is not supported; "
            "MiniMax-M2 has no shared expert"
        )
    attn_type_list = getattr(config, "attn_type_list", None)
    if attn_type_list is not None:
        if len(attn_type_list) != config.num_hidden_layers:
            raise ValueError(
                f"config.attn_type_list has {len(attn_type_list)} entries for {config.num_hidden_layers} layers"
            )
        for i, attn_type in enumerate(attn_type_list):
            if attn_type != SOFTMAX_ATTENTION:
                raise ValueError(
                    f"config.attn_type_list[{i}]={attn_type!r} is not supported; only {SOFTMAX_ATTENTION} "
                    "(softmax attention)"
                )
    sliding_window = getattr(config, "sliding_window", None)
    if sliding_window is not None:
        raise ValueError(f"config.sliding_window={sliding_window} is not supported; MiniMax-M2 attends to every token")
