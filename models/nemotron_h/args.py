from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import DecoderArgs

MAMBA = "linear_attention"  # HF's name for a Mamba2 block in layers_block_type
ATTENTION = "full_attention"
MLP = "mlp"
MOE = "moe"
BLOCK_TYPES = (MAMBA, ATTENTION, MLP, MOE)


@dataclass
class NemotronHArgs(DecoderArgs):
    """Nemotron-H hyper-parameters, named as in the HF config (NemotronHConfig).

    layers_block_type: per layer, one mixer behind one pre-norm: "linear_attention" (a Mamba2 mixer),
        "full_attention" (GQA without positions: HF's Nemotron-H applies no RoPE), "mlp" (a
        non-gated MLP, up_proj -> relu^2 -> down_proj) or "moe" (Nemotron 3 Nano's routed experts).
    MoE: n_routed_experts non-gated relu^2 experts of moe_intermediate_size, num_experts_per_tok per
        token by sigmoid scores with e_score_correction_bias over the topk_group best of n_group
        groups (renormalised when norm_topk_prob, times routed_scaling_factor), plus one non-gated
        shared MLP of moe_shared_expert_intermediate_size. With moe_latent_size the routed experts run
        in a latent space of that width (fc1_latent_proj in, fc2_latent_proj out, biases when mlp_bias).
    Mamba2: mamba_num_heads heads of mamba_head_dim channels, a state of ssm_state_size per channel,
        B and C shared by the heads of each of n_groups groups, a depthwise causal conv of conv_kernel
        taps (with a bias when use_conv_bias) over [x | B | C]; in_proj and out_proj have a bias when
        use_bias. The step size is softplus(dt + dt_bias), clamped below at time_step_min (HF's
        forward clamps at (time_step_min, inf) and ignores config.time_step_limit).
    rms_norm_eps is the config's layer_norm_epsilon (every RMSNorm, the Mamba2 gated norm included).
    """

    layers_block_type: list[str] = field(default_factory=list)
    mlp_bias: bool = False
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    n_groups: int = 1
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_min: float = 0.0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def layer_types(self) -> list[str]:
        return self.layers_block_type

    @property
    def num_experts(self) -> int:
        """The routed experts of each 'moe' block (0 without one)."""
        return self.n_routed_experts if MOE in self.layers_block_type else 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.layers_block_type[layer_idx] == MOE

    @classmethod
    def from_hf_config(cls, config) -> "NemotronHArgs":
        for name, value in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if getattr(config, name) != value:
                raise ValueError(f"config.{name}={getattr(config, name)!r} is not supported; expected {value!r}")
        attention_dropout = getattr(config, "attention_dropout", 0.0) or 0.0
        if attention_dropout != 0.0:
            raise ValueError(
                f"config.attention_dropout={attention_dropout!r} is not supported; archon's attention has no dropout"
            )
        blocks = list(config.layers_block_type)
        args = cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=len(blocks),
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.head_dim or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.layer_norm_epsilon,
            rope_parameters={},
            max_position_embeddings=config.max_position_embeddings,
            # HF's NemotronHForCausalLM never ties its head (no tied-weights keys): lm_head is its own.
            tie_word_embeddings=False,
            layers_block_type=blocks,
            mlp_bias=bool(config.mlp_bias),
            mamba_num_heads=config.mamba_num_heads,
            mamba_head_dim=config.mamba_head_dim,
            ssm_state_size=config.ssm_state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            use_conv_bias=bool(config.use_conv_bias),
            use_bias=bool(config.use_bias),
            time_step_min=float(config.time_step_min),
            n_routed_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
            moe_latent_size=config.moe_latent_size,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
        )
        args.validate()
        return args

    def validate(self) -> None:
        for i, kind in enumerate(self.layers_block_type):
            if kind not in BLOCK_TYPES:
                raise ValueError(
                    f"config.layers_block_type[{i}]={kind!r} is not supported; expected one of {BLOCK_TYPES}"
                )
        if MAMBA in self.layers_block_type:
            for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"):
                if getattr(self, name) < 1:
                    raise ValueError(f"config.{name}={getattr(self, name)} must be at least 1")
            if self.mamba_num_heads % self.n_groups:
                raise ValueError(
                    f"config.mamba_num_heads={self.mamba_num_heads} is not a multiple of "
                    f"config.n_groups={self.n_groups}"
                )
        if MOE in self.layers_block_type:
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) < 1:
                    raise ValueError(f"config.{name}={getattr(self, name)} must be at least 1 with 'moe' blocks")
            if self.moe_latent_size is not None and self.moe_latent_size < 1:
                raise ValueError(f"config.moe_latent_size={self.moe_latent_size} must be at least 1 (or None)")
        if ATTENTION in self.layers_block_type and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"config.num_key_value_heads={self.num_key_value_heads}"
            )
