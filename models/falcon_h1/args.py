from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf


@dataclass
class FalconH1Args(DecoderArgs):
    """Falcon-H1 hyper-parameters, named as in the HF config (FalconH1Config).

    Every layer runs a Mamba2 mixer (`mamba`) and attention (`self_attn`, RoPE, GQA, q/k/v/o bias when
    attention_bias) side by side on the same normed input, then a SwiGLU MLP (`feed_forward`, biases
    when mlp_bias).
    Mamba2: mamba_n_heads heads of mamba_d_head channels (mamba_d_ssm of them, or mamba_expand *
        hidden_size when mamba_d_ssm is None), a state of mamba_d_state per channel, B and C shared by
        the heads of each of mamba_n_groups groups, a depthwise causal conv of mamba_d_conv taps (with a
        bias when mamba_conv_bias); in_proj has a bias when mamba_proj_bias, out_proj when
        projectors_bias. The step size is softplus(dt + dt_bias) clamped to time_step_limit. With
        mamba_rms_norm the output is RMS-normed per group of channels, before the silu(z) gate when
        mamba_norm_before_gate, after it otherwise; without, it is only gated.
    The muP multipliers: embedding_multiplier on the embeddings, lm_head_multiplier on the logits,
    key_multiplier on the keys, attention_in/out_multiplier on the attention's input and output,
    ssm_in/out_multiplier on the Mamba2 mixer's, ssm_multipliers on in_proj's z, x, B, C and dt outputs,
    mlp_multipliers on the MLP's gate pre-activation and its output.
    """

    attention_bias: bool = False
    mlp_bias: bool = False
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    projectors_bias: bool = False
    mamba_rms_norm: bool = False
    mamba_norm_before_gate: bool = True
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)

    @classmethod
    def from_hf_config(cls, config) -> "FalconH1Args":
        if config.hidden_act != "silu":
            # one field for the MLP's activation and the Mamba2 conv's
            raise ValueError(f"config.hidden_act={config.hidden_act!r} is not supported; expected 'silu'")
        if config.time_step_limit is None or len(config.time_step_limit) != 2:
            raise ValueError(f"config.time_step_limit={config.time_step_limit!r} must be (min, max)")
        expanded = int(config.mamba_expand * config.hidden_size)  # the width when mamba_d_ssm is None
        width = expanded if config.mamba_d_ssm is None else config.mamba_d_ssm
        if width != config.mamba_n_heads * config.mamba_d_head:
            raise ValueError(
                f"config.mamba_n_heads={config.mamba_n_heads} x config.mamba_d_head={config.mamba_d_head} must equal "
                f"the Mamba2 width {width} (config.mamba_d_ssm, or config.mamba_expand x config.hidden_size)"
            )
        for name, count in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
            if len(getattr(config, name)) != count:
                raise ValueError(f"config.{name}={getattr(config, name)!r} must hold {count} values")
        args = cls(
            **decoder_fields_from_hf(config),
            attention_bias=bool(config.attention_bias),
            mlp_bias=bool(config.mlp_bias),
            mamba_n_heads=config.mamba_n_heads,
            mamba_d_head=config.mamba_d_head,
            mamba_d_state=config.mamba_d_state,
            mamba_n_groups=config.mamba_n_groups,
            mamba_d_conv=config.mamba_d_conv,
            mamba_conv_bias=bool(config.mamba_conv_bias),
            mamba_proj_bias=bool(config.mamba_proj_bias),
            projectors_bias=bool(config.projectors_bias),
            mamba_rms_norm=bool(config.mamba_rms_norm),
            mamba_norm_before_gate=bool(config.mamba_norm_before_gate),
            time_step_limit=(float(config.time_step_limit[0]), float(config.time_step_limit[1])),
            embedding_multiplier=float(config.embedding_multiplier),
            lm_head_multiplier=float(config.lm_head_multiplier),
            key_multiplier=float(config.key_multiplier),
            attention_in_multiplier=float(config.attention_in_multiplier),
            attention_out_multiplier=float(config.attention_out_multiplier),
            ssm_in_multiplier=float(config.ssm_in_multiplier),
            ssm_out_multiplier=float(config.ssm_out_multiplier),
            ssm_multipliers=tuple(float(m) for m in config.ssm_multipliers),
            mlp_multipliers=tuple(float(m) for m in config.mlp_multipliers),
        )
        args.validate()
        return args

    def validate(self) -> None:
        for name in ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name}={getattr(self, name)} must be at least 1")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError(
                f"config.mamba_n_heads={self.mamba_n_heads} is not a multiple of "
                f"config.mamba_n_groups={self.mamba_n_groups}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"config.num_key_value_heads={self.num_key_value_heads}"
            )
