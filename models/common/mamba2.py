"""The Mamba2 mixer (state-space duality) on packed sequences, shared by the Mamba2 hybrids
(Nemotron-H, Falcon-H1).

Per head h with state S [P, N] (P = head_dim, N = state_size) and for each token t:
    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_min, dt_max),   a_t = dt_t * A,   A = -exp(A_log)
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D x_t
where x (P channels per head), B and C (N each, shared by the heads of a group) come from in_proj
through a depthwise causal conv and silu, and dt_raw from in_proj directly. y is gated by silu(z) (z
from in_proj too), optionally RMS-normed per group of channels (before or after the gate), and
projected by out_proj. The state and the conv window start from zero at every packed sequence (or from
the generation cache).

Training runs the chunked form (`chunked_ssd`); a decode step is the same forward on one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.models.common.linear_attention import PaddedSequences
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
    """RMSNorm with the statistics taken per group of `group_size` channels, gated by silu(z): after
    the gate, weight * RMSNorm(y * silu(z)) (HF `Zamba2RMSNormGated` as Nemotron-H calls it, Falcon-H1
    with mamba_norm_before_gate False), or before it, weight * RMSNorm(y) * silu(z). All in fp32 (the
    scan output's dtype; fp64 for an fp64 model), so the weight multiplies in fp32."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [T, dim] -> [T, dim] in fp32 (fp64 for an fp64 model)."""
        gate = F.silu(z.float())
        h = y.float() if self.norm_before_gate else y.float() * gate
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.to(h.dtype) * groups.view(h.shape)
        return h * gate if self.norm_before_gate else h


@dataclass(frozen=True)
class Mamba2Settings:
    """What a family's Mamba2 mixer is made of (names of the HF config fields vary by family).

    in_proj_bias / out_proj_bias: biases on the projections; gated_norm: the grouped gated RMSNorm
    (`norm`) after the scan, else y * silu(z) without a norm; norm_before_gate: its order;
    dt_min / dt_max: the clamp of the step size after softplus; in_multiplier: a factor on the
    mixer's input; projection_multipliers: factors on in_proj's z, x, B, C and dt outputs (Falcon-H1's
    `ssm_multipliers`), None for none.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    use_conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    rms_norm_eps: float
    gated_norm: bool = True
    norm_before_gate: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")
    in_multiplier: float = 1.0
    projection_multipliers: tuple[float, float, float, float, float] | None = None

    @property
    def width(self) -> int:
        """The channels of x (and of the gate z): num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """The conv's channels: x, then B and C (n_groups * state_size each)."""
        return self.width + 2 * self.n_groups * self.state_size


class Mamba2Mixer(RecurrentTokenMixer):
    """A Mamba2 mixer (HF `NemotronHMamba2Mixer`, `FalconH1Mixer`).

    in_proj: [I + (I + 2 G N) + H, dim] (rows z, then x, B, C, then dt; I = H * P); conv1d: weight
    [I + 2 G N, 1, K] (bias [I + 2 G N] when use_conv_bias); dt_bias, A_log, D: [H]; norm.weight: [I]
    when gated_norm; out_proj: [dim, I].
    """

    def __init__(self, settings: Mamba2Settings, lora: LoRAConfig | None) -> None:
        super().__init__()
        s = settings
        self.settings = s
        self.num_heads, self.head_dim = s.num_heads, s.head_dim
        self.n_groups, self.state_size = s.n_groups, s.state_size
        self.width, self.conv_channels = s.width, s.conv_channels
        self.time_step_min, self.time_step_max = s.dt_min, s.dt_max
        projection = self.width + self.conv_channels + self.num_heads
        self.in_proj = linear(s.hidden_size, projection, s.in_proj_bias, "in_proj", lora)
        self.conv1d = nn.Conv1d(
            self.conv_channels, self.conv_channels, s.conv_kernel, groups=self.conv_channels, bias=s.use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        group_size = self.width // self.n_groups
        self.norm = (
            GroupedGatedRMSNorm(self.width, group_size, s.rms_norm_eps, s.norm_before_gate) if s.gated_norm else None
        )
        # PEFT refuses LoRA on this module inside a Mamba2 mixer, so out_proj is a plain linear.
        self.out_proj = nn.Linear(self.width, s.hidden_size, bias=s.out_proj_bias)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (z [T, I], x|B|C [T, I + 2 G N], dt [T, H]), with the family's multipliers."""
        s = self.settings
        if s.in_multiplier != 1.0:
            x = x * s.in_multiplier
        z, xbc, dt = self.in_proj(x).split([self.width, self.conv_channels, self.num_heads], dim=-1)
        if s.projection_multipliers is None:
            return z, xbc, dt
        # As HF's mup vector: the factors rounded to fp32 (HF builds it in fp32 whatever the model
        # dtype), then held in the activations' dtype.
        m_z, m_x, m_b, m_c, m_dt = (torch.tensor(m, dtype=torch.float32).to(z.dtype) for m in s.projection_multipliers)
        bc = self.n_groups * self.state_size
        hs, B, C = xbc.split([self.width, bc, bc], dim=-1)
        return z * m_z, torch.cat([hs * m_x, B * m_b, C * m_c], dim=-1), dt * m_dt

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
        z, xbc, dt = self._project(x)
        xbc, window = causal_conv1d_with_bias(seqs.pad(xbc), self.conv1d.weight, self.conv1d.bias, seqs.lengths, window)
        xbc = F.silu(seqs.unpad(xbc))
        hs, B, C = xbc.split([self.width, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1)

        # As HF: the step size in the model dtype, everything after it in fp32 (fp64 for an fp64 model).
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        dt = dt.clamp(min=self.time_step_min, max=self.time_step_max).float()
        A = -self.A_log.float().exp()
        hs = hs.float().view(T, heads, self.head_dim)
        per_group = heads // self.n_groups
        B = B.float().view(T, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1)
        C = C.float().view(T, self.n_groups, self.state_size).repeat_interleave(per_group, dim=1)
        y, state = chunked_ssd(seqs.pad(hs), seqs.pad(dt), A, seqs.pad(B), seqs.pad(C), state)
        if cache is not None:
            cache.store_recurrent_state(window, state)
        y = seqs.unpad(y) + self.D.float()[:, None] * hs  # [T, H, P]
        y = y.reshape(T, -1)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        return self.out_proj(y.to(x.dtype))
