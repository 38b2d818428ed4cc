"""Nemotron-H on packed sequences: a hybrid whose every layer is one pre-norm block around one mixer,
a Mamba2 mixer, attention without positions, a non-gated MLP or routed non-gated experts (Nemotron 3
Nano's MoE), as `layers_block_type` says (HF names each block's mixer `mixer` and its norm `norm`).

The Mamba2 mixer (models/common/mamba2.py) clamps the step size below at time_step_min only, and
RMS-norms per group after the silu(z) gate; its state and conv window start from zero at every
packed sequence (or from the generation cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.mamba2 import Mamba2Mixer, Mamba2Settings
from archon.models.common.moe import NonGatedExperts, SigmoidGroupTopKRouter
from archon.models.common.norms import RMSNorm
from archon.models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE, NemotronHArgs


def mamba2_settings(args: NemotronHArgs) -> Mamba2Settings:
    """Nemotron-H's Mamba2: biases on both projections when use_bias, the gated norm after the gate,
    the step size clamped below at time_step_min (HF's forward ignores time_step_limit)."""
    return Mamba2Settings(
        hidden_size=args.hidden_size,
        num_heads=args.mamba_num_heads,
        head_dim=args.mamba_head_dim,
        n_groups=args.n_groups,
        state_size=args.ssm_state_size,
        conv_kernel=args.conv_kernel,
        use_conv_bias=args.use_conv_bias,
        in_proj_bias=args.use_bias,
        out_proj_bias=args.use_bias,
        rms_norm_eps=args.rms_norm_eps,
        dt_min=args.time_step_min,
    )


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class NemotronHMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2), HF `NemotronHMLP`; biases when mlp_bias."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.up_proj = linear(dim, hidden_dim, bias, "up_proj", lora)
        self.down_proj = linear(hidden_dim, dim, bias, "down_proj", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Nemotron 3 Nano's MoE block (HF `NemotronHMoE`): group-limited sigmoid routing (`gate`) over
    non-gated relu^2 experts (`experts`: up_proj [E, I, D'], down_proj [E, D', I]) plus a non-gated
    shared MLP (`shared_experts`) on every token. With moe_latent_size the routed experts see the
    tokens through fc1_latent_proj (D -> D') and give back through fc2_latent_proj (D' -> D); the
    router and the shared MLP see the block's input."""

    def __init__(self, args: NemotronHArgs, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, latent = args.hidden_size, args.moe_latent_size
        self.gate = SigmoidGroupTopKRouter(
            dim,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )
        expert_dim = dim if latent is None else latent
        self.experts = NonGatedExperts(
            args.n_routed_experts, expert_dim, args.moe_intermediate_size, relu_squared, lora
        )
        self.shared_experts = NemotronHMLP(dim, args.moe_shared_expert_intermediate_size, args.mlp_bias, lora)
        if latent is None:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        else:
            self.fc1_latent_proj = linear(dim, latent, args.mlp_bias, "fc1_latent_proj", lora)
            self.fc2_latent_proj = linear(latent, dim, args.mlp_bias, "fc2_latent_proj", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        top_weights, top_indices = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, top_weights, top_indices)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """out = x + mixer(norm(x)), the mixer as `layers_block_type[layer_idx]` says. The norm scales in
    fp32 before casting back, as HF's NemotronHRMSNorm does."""

    def __init__(self, args: NemotronHArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.layer_type = args.layers_block_type[layer_idx]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True)
        if self.layer_type == MAMBA:
            self.mixer = Mamba2Mixer(mamba2_settings(args), lora)
        elif self.layer_type == ATTENTION:
            # HF's Nemotron-H attention has no bias whatever config.attention_bias says, and no RoPE.
            self.mixer = Attention.from_args(args, lora, qkv_bias=False, o_bias=False, rotary=False)
        elif self.layer_type == MOE:
            self.mixer = NemotronHMoE(args, lora)
        else:
            self.mixer = NemotronHMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, lora)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        h = self.norm(x)
        if self.layer_type in (MLP, MOE):
            return x + self.mixer(h)
        return x + self.mixer(h, cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)


class NemotronHModel(PackedDecoderLM):
    def __init__(self, args: NemotronHArgs, lora: LoRAConfig | None = None) -> None:
        layers = (NemotronHBlock(args, i, lora) for i in range(args.num_hidden_layers))
        norm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_fp32=True)
        super().__init__(args, None, layers, norm=norm)
