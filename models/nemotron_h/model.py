"""Nemotron-H on packed sequences: a hybrid whose every layer is one pre-norm block around one mixer,
a Mamba2 mixer, attention without positions, a non-gated MLP or routed non-gated experts (Nemotron 3
Nano's MoE), as `layers_block_type` says (HF names each block's mixer `mixer` and its norm `norm`).

Mamba2 (state-space duality), per head h with state S [P, N] (P = mamba_head_dim, N = ssm_state_size)
and for each token t:
    dt_t = max(softplus(dt_raw_t + dt_bias), time_step_min),   a_t = dt_t * A,   A = -exp(A_log)
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D x_t
where x (P channels per head), B and C (N each, shared by the heads of a group) come from in_proj
through a depthwise causal conv (with bias) and silu, and dt_raw from in_proj directly. y is gated by
silu(z) (z from in_proj too), RMS-normed per group of channels and projected by out_proj. The state
and the conv window start from zero at every packed sequence (or from the generation cache).

Training runs the chunked form (`chunked_ssd`); a decode step is the same forward on one token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.models.common.attention import Attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.linear_attention import PaddedSequences
from archon.models.common.moe import NonGatedExperts, SigmoidGroupTopKRouter
from archon.models.common.norms import RMSNorm
from archon.models.nemotron_h.args import ATTENTION, MAMBA, MLP, MOE, NemotronHArgs
from archon.recurrent import RecurrentTokenMixer

# Tokens per chunk of the chunked scan: within a chunk the outputs come from one masked product,
# across chunks the state is carried one chunk at a time.
SSD_CHUNK_SIZE = 64


def chunked_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = SSD_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 recurrence S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, by chunks.

    x: [N, L, H, P]; dt: [N, L, H] (0 on padding, which then leaves the state unchanged); A: [H]
    (negative); B, C: [N, L, H, S] (already repeated from groups to heads); state: [N, H, P, S] or None
    (zeros). Returns (y [N, L, H, P] without the D skip, the state after the last token [N, H, P, S]).
    """
    n, length, heads, head_dim = x.shape
    pad = (-length) % chunk_size
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    n_chunks = (length + pad) // chunk_size
    x, B, C = (t.reshape(n, n_chunks, chunk_size, heads, -1) for t in (x, B, C))
    dt = dt.reshape(n, n_chunks, chunk_size, heads)

    log_decay = (dt * A).cumsum(dim=2)  # [N, c, Q, H]: sum of a over the chunk up to each token
    x_dt = x * dt[..., None]
    # Within a chunk: y_l += sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    pair_decay = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [N, c, l, s, H]
    pair_decay = pair_decay.masked_fill(~causal[:, :, None], float("-inf")).exp()
    scores = torch.einsum("nclhd,ncshd->nclsh", C, B) * pair_decay
    y = torch.einsum("nclsh,ncshp->nclhp", scores, x_dt)
    # Each chunk's own contribution to the state at its end, and the decay of a state across it.
    to_end = (log_decay[:, :, -1:, :] - log_decay).exp()  # [N, c, Q, H]
    chunk_states = torch.einsum("nclh,nclhd,nclhp->nchpd", to_end, B, x_dt)  # [N, c, H, P, S]
    chunk_decay = log_decay[:, :, -1, :].exp()  # [N, c, H]

    if state is None:
        state = x.new_zeros(n, heads, head_dim, B.shape[-1])
    state = state.to(x.dtype)
    outputs = []
    for c in range(n_chunks):
        from_state = torch.einsum("nlhd,nhpd->nlhp", C[:, c], state) * log_decay[:, c].exp()[..., None]
        outputs.append(y[:, c] + from_state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    y = torch.stack(outputs, dim=1).reshape(n, n_chunks * chunk_size, heads, head_dim)
    return y[:, :length], state


def causal_conv1d_with_bias(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor,
    initial_window: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no activation) per sequence of a padded batch.

    x: [N, L, C] (zeros after each sequence's lengths[n] tokens); weight: [C, 1, K]; bias: [C] or None;
    initial_window: [N, K-1, C], the inputs before each sequence (zeros when None).
    Returns (out [N, L, C], window [N, K-1, C]: each sequence's last K-1 inputs, to continue from).
    """
    n, _, channels = x.shape
    width = weight.shape[-1]
    if initial_window is None:
        initial_window = x.new_zeros(n, width - 1, channels)
    extended = torch.cat([initial_window.to(x.dtype), x], dim=1)  # [N, K-1+L, C]
    bias = None if bias is None else bias.to(x.dtype)
    out = F.conv1d(extended.transpose(1, 2), weight.to(x.dtype), bias, groups=channels).transpose(1, 2)
    index = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]  # [N, K-1]
    window = extended.gather(1, index[:, :, None].expand(-1, -1, channels))
    return out, window


class GroupedGatedRMSNorm(nn.Module):
    """weight * RMSNorm(y * silu(z)) with the statistics taken per group of `group_size` channels, all
    in fp32, cast back to y's dtype at the end (HF `Zamba2RMSNormGated` as Nemotron-H calls it: on the
    fp32 scan output, so the weight multiplies in fp32)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [T, dim] -> [T, dim] in fp32 (fp64 for an fp64 model)."""
        h = y.float() * F.silu(z.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(h.dtype) * groups.view(h.shape)


class Mamba2Mixer(RecurrentTokenMixer):
    """The Mamba2 mixer of Nemotron-H (HF `NemotronHMamba2Mixer`, module name `mixer`).

    in_proj: [I + (I + 2 G N) + H, dim] (rows z, then x, B, C, then dt; I = H * P); conv1d: weight
    [I + 2 G N, 1, K] (bias [I + 2 G N] when use_conv_bias); dt_bias, A_log, D: [H]; norm.weight: [I];
    out_proj: [dim, I].
    """

    def __init__(self, args: NemotronHArgs, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.n_groups, self.state_size = args.n_groups, args.ssm_state_size
        self.width, self.conv_channels = args.mamba_width, args.mamba_conv_channels
        self.time_step_min = args.time_step_min
        projection = self.width + self.conv_channels + self.num_heads
        self.in_proj = linear(args.hidden_size, projection, args.use_bias, "in_proj", lora)
        self.conv1d = nn.Conv1d(
            self.conv_channels,
            self.conv_channels,
            args.conv_kernel,
            groups=self.conv_channels,
            bias=args.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GroupedGatedRMSNorm(self.width, self.width // self.n_groups, args.rms_norm_eps)
        # PEFT refuses LoRA on this module inside a Mamba2 mixer, so out_proj is a plain linear.
        self.out_proj = nn.Linear(self.width, args.hidden_size, bias=args.use_bias)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. cos/sin are unused. `cache`: a layer cache (archon/rollout/kv_cache.py)
        holding each sequence's conv window [K-1, I + 2 G N] and state [H, P, N]."""
        if context_parallel is not None:
            raise NotImplementedError(
                "the Mamba2 mixer does not support context parallelism: its scan runs over every token of a sequence"
            )
        T, heads = x.shape[0], self.num_heads
        window, state = (None, None) if cache is None else cache.recurrent_state()
        seqs = PaddedSequences(cu_seqlens, max_seqlen)
        z, xbc, dt = self.in_proj(x).split([self.width, self.conv_channels, heads], dim=-1)
        xbc, window = causal_conv1d_with_bias(seqs.pad(xbc), self.conv1d.weight, self.conv1d.bias, seqs.lengths, window)
        xbc = F.silu(seqs.unpad(xbc))
        hs, B, C = xbc.split([self.width, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1)

        # As HF: the step size in the model dtype, everything after it in fp32 (fp64 for an fp64 model).
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(min=self.time_step_min).float()
        A = -self.A_log.float().exp()
        hs = hs.float().view(T, heads, self.head_dim)
        per_group = heads // self.n_groups
        B = B.float().view(T, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1)
        C = C.float().view(T, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1)
        y, state = chunked_ssd(seqs.pad(hs), seqs.pad(dt), A, seqs.pad(B), seqs.pad(C), state)
        if cache is not None:
            cache.store_recurrent_state(window, state)
        y = seqs.unpad(y) + self.D.float()[:, None] * hs  # [T, H, P]
        y = self.norm(y.reshape(T, -1), z)
        return self.out_proj(y.to(x.dtype))


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
            self.mixer = Mamba2Mixer(args, lora)
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
