"""The gated delta rule (gated DeltaNet, Kimi Delta Attention) on packed sequences, in PyTorch, with an
optional CUDA kernel for the per-head decay.

Per head with state S [dk, dv] and for each token t:
    S_t = diag(exp(g_t)) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
where the log decay g_t is one number per head (gated DeltaNet: the diagonal is exp(g_t) I) or one per
key channel, [dk] (Kimi Delta Attention, KDA). The decay acts on the state before the delta update.

Packed sequences are laid out as a zero-padded batch (`PaddedSequences`); the padding has g = 0 and
beta = 0, so it leaves each sequence's state as it is. The short causal conv before the rule and the
state restart at every sequence. Families: Qwen3.5 / Qwen3.6, Qwen3-Next (per-head decay), Kimi
Linear (per-channel decay).

`GatedDeltaNet` is the mixer around the rule (HF name `linear_attn`), with its tensor-parallel plan
(`gated_deltanet_plan`); models/common/hybrid.py mixes it with gated attention by `layer_types`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from archon.lora import LoRAConfig, linear
from archon.models.common.norms import GatedRMSNorm
from archon.parallel.context_parallel import heads_of_rank, heads_to_tokens, tokens_to_heads
from archon.parallel.tensor_parallel import ReplicatedParallel, ShardedParameters, colwise, local_tensor, rowwise
from archon.recurrent import RecurrentTokenMixer

logger = logging.getLogger(__name__)

# Tokens per chunk of the chunked delta rule: within a chunk the updates are solved at once, chunks
# are scanned one after another.
DELTA_RULE_CHUNK_SIZE = 64
# Tokens per sub-chunk of a chunk, for the per-channel decay's pairwise products (see
# `decayed_pair_products`).
DECAY_SUB_CHUNK_SIZE = 16


class PaddedSequences:
    """The N packed sequences of a [T, ...] tensor laid out as a zero-padded [N, L, ...] batch."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        self.lengths = lengths
        self.num_seqs, self.max_len = len(lengths), int(max_seqlen)
        self.seq_index = torch.repeat_interleave(torch.arange(self.num_seqs, device=cu_seqlens.device), lengths)
        token = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
        self.offset = token - cu_seqlens[:-1][self.seq_index]  # position of each token within its sequence

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [N, max_len, ...], zeros after each sequence."""
        out = x.new_zeros(self.num_seqs, self.max_len, *x.shape[1:])
        return out.index_put((self.seq_index, self.offset), x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [T, ...]."""
        return x[self.seq_index, self.offset]


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor, initial_window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv then silu, per sequence of a padded batch.

    x: [N, L, C] (zeros after each sequence's `lengths[n]` tokens); weight: [C, 1, K];
    initial_window: [N, K-1, C], the inputs that precede each sequence (zeros when None).
    Returns (out [N, L, C], window [N, K-1, C]: the last K-1 inputs of each sequence, to continue from).
    """
    n, length, channels = x.shape
    width = weight.shape[-1]
    if initial_window is None:
        initial_window = x.new_zeros(n, width - 1, channels)
    extended = torch.cat([initial_window.to(x.dtype), x], dim=1)  # [N, K-1+L, C]
    out = F.conv1d(extended.transpose(1, 2), weight.to(x.dtype), groups=channels).transpose(1, 2)
    # The window after sequence n is extended[n, lengths[n] : lengths[n] + K-1].
    index = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]  # [N, K-1]
    window = extended.gather(1, index[:, :, None].expand(-1, -1, channels))
    return F.silu(out), window


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def decayed_pair_products(
    x: torch.Tensor, y: torch.Tensor, cum_g: torch.Tensor, sub_chunk: int = DECAY_SUB_CHUNK_SIZE
) -> torch.Tensor:
    """M[..., i, j] = sum_c x_i[c] y_j[c] exp(G_i[c] - G_j[c]) for j <= i, and 0 above the diagonal.

    x, y, cum_g (G): [..., C, dk]; G is a cumulative log decay, so it does not increase along C.
    Returns [..., C, C]. Pairs in different sub-chunks (j in sub-chunk b < a, i in a) go through one
    matmul per pair of sub-chunks, with both sides decayed to the first row r of sub-chunk a:
    exp(G_i - G_r) and exp(G_r - G_j), each at most 1 since j < r <= i, so neither overflows. Pairs
    within a sub-chunk are summed over the channels directly. This holds [.., C, C / S, dk] and
    [.., C, S, dk] terms rather than the [.., C, C, dk] of every pair.
    """
    *lead, length, dk = x.shape
    size = sub_chunk if length % sub_chunk == 0 else length
    n_sub = length // size
    xs, ys, gs = (t.reshape(*lead, n_sub, size, dk) for t in (x, y, cum_g))
    ref = gs[..., :1, :]  # [.., n_sub, 1, dk]: G at each sub-chunk's first row
    x_to_ref = xs * (gs - ref).exp()
    earlier = torch.ones(n_sub, n_sub, dtype=torch.bool, device=x.device).tril(-1)  # [a, b]: b < a
    from_ref = (ref[..., :, None, :, :] - gs[..., None, :, :, :]).masked_fill(~earlier[:, :, None, None], float("-inf"))
    y_from_ref = ys[..., None, :, :, :] * from_ref.exp()  # [.., n_sub (a), n_sub (b), S, dk]
    across = x_to_ref[..., :, None, :, :] @ y_from_ref.transpose(-1, -2)  # [.., a, b, S, S], zero for b >= a
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    pair_decay = (gs[..., :, None, :] - gs[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    within = (xs[..., :, None, :] * pair_decay * ys[..., None, :, :]).sum(-1)  # [.., n_sub, S, S]
    same = torch.eye(n_sub, dtype=torch.bool, device=x.device)[:, :, None, None]
    blocks = torch.where(same, within[..., :, None, :, :], across)  # [.., a, b, S, S]
    return blocks.transpose(-3, -2).reshape(*lead, length, length)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = DELTA_RULE_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a padded batch, in fp32, a chunk of tokens at a time.

    q, k: [N, H, L, dk] (q already scaled); v: [N, H, L, dv]; g (log decay): [N, H, L] per head or
    [N, H, L, dk] per key channel; beta: [N, H, L]; g and beta are zero after each sequence so the
    padding leaves the state as it is; initial_state: [N, H, dk, dv] or None.
    Returns (o [N, H, L, dv], final state [N, H, dk, dv]).

    Within a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i (per
    channel: D[i, j, c] = exp(G_i[c] - G_j[c]), and x.D.y = sum_c x[c] D[i, j, c] y[c]), the updates
    are solved at once (the WY form of the delta rule): with A = I + strictly_lower(beta_i k_i.D.k_j),
    U = A^-1 (beta v) and W = A^-1 (beta exp(G) k), the chunk reads the state S it starts from as
    v_new = U - W S and o = (exp(G) q) S + (q_i.D.k_j)_{j<=i} v_new, and leaves
    S' = exp(G_last) S + (exp(G_last - G) k)^T v_new. The per-channel products x.D.y come from
    `decayed_pair_products`.
    """
    n_seqs, n_heads, length, dk = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 4
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad)) if per_channel else F.pad(g, (0, pad))
        beta = F.pad(beta, (0, pad))
    n_chunks = (length + pad) // chunk
    q, k, v = (t.reshape(n_seqs, n_heads, n_chunks, chunk, -1) for t in (q, k, v))
    beta = beta.reshape(n_seqs, n_heads, n_chunks, chunk)
    k_beta = k * beta[..., None]
    if per_channel:
        cum_g = g.reshape(n_seqs, n_heads, n_chunks, chunk, dk).cumsum(dim=-2)  # [N, H, n, C, dk]
        system = decayed_pair_products(k_beta, k, cum_g)  # [N, H, n, C, C]
        intra = decayed_pair_products(q, k, cum_g)
        channel_cum_g = cum_g
        chunk_decay = cum_g[..., -1, :].exp()[..., None]  # [N, H, n, dk, 1]
    else:
        cum_g = g.reshape(n_seqs, n_heads, n_chunks, chunk).cumsum(dim=-1)  # [N, H, n, C]
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, H, n, C, C]
        system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strictly lower triangle is read
        intra = (q @ k.transpose(-1, -2)) * decay
        channel_cum_g = cum_g[..., None]  # [N, H, n, C, 1]
        chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [N, H, n, 1, 1]
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * channel_cum_g.exp(), upper=False, unitriangular=True)
    q_decayed = q * channel_cum_g.exp()
    k_to_chunk_end = k * (channel_cum_g[..., -1:, :] - channel_cum_g).exp()

    state = q.new_zeros(n_seqs, n_heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_chunk_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).reshape(n_seqs, n_heads, n_chunks * chunk, dv)
    return o[:, :, :length], state


@functools.cache
def _fla_chunk_gated_delta_rule():
    """flash-linear-attention's kernel when it imports (the `kernels` extra), else None, said once."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        logger.warning(
            "flash-linear-attention is not importable (%s); gated DeltaNet layers use the PyTorch chunked "
            "delta rule. Install archon[kernels] for the fused CUDA kernel.",
            e,
        )
        return None
    logger.info("gated DeltaNet layers use flash-linear-attention's chunk_gated_delta_rule")
    return chunk_gated_delta_rule


def gated_delta_rule(q, k, v, g, beta, seqs: PaddedSequences, initial_state):
    """q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H] (per-head decay) or [T, H, dk] (per-channel decay,
    KDA); beta: [T, H] (packed, fp32 g) -> (o [T, H, dv], state [N, H, dk, dv]).

    q and k are L2-normalised here and q scaled by dk^-0.5. The rule runs in fp32 (or fp64 for an fp64
    model). The CUDA kernel serves the per-head decay; the per-channel decay runs the PyTorch path on
    every device."""
    dk = q.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    kernel = _fla_chunk_gated_delta_rule() if q.is_cuda and g.dim() == 2 else None
    if kernel is not None:
        cu_seqlens = torch.cat([seqs.lengths.new_zeros(1), seqs.lengths.cumsum(0)])
        o, state = kernel(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            scale=dk**-0.5,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        return o[0], state
    padded = [seqs.pad(t).transpose(1, 2) for t in (q * dk**-0.5, k, v, g, beta)]  # [N, H, L, ...]
    o, state = chunked_gated_delta_rule(*padded, initial_state=initial_state)
    return seqs.unpad(o.transpose(1, 2)), state


def qkv_rows_by_key_head(args) -> torch.Tensor:
    """The order archon keeps a DeltaNet's q/k/v rows (and conv channels) in: for each archon row (key
    head h: its q rows, its k rows, then the v rows of its value heads), the HF row (all q, all k,
    all v). `args` needs linear_num_key_heads, linear_key_head_dim, linear_num_value_heads and
    linear_value_head_dim."""
    n_k, dk = args.linear_num_key_heads, args.linear_key_head_dim
    group_v = args.linear_num_value_heads // n_k * args.linear_value_head_dim
    q_rows = torch.arange(n_k * dk).view(n_k, dk)
    k_rows = n_k * dk + q_rows
    v_rows = 2 * n_k * dk + torch.arange(n_k * group_v).view(n_k, group_v)
    return torch.cat([q_rows, k_rows, v_rows], dim=1).reshape(-1)


class GatedDeltaNet(RecurrentTokenMixer):
    """The gated DeltaNet mixer (Qwen3.5, Qwen3-Next), HF name `linear_attn`.

    Per value head, after a short causal depthwise conv (then silu) over the q/k/v projection:
    L2-normed q and k, q scaled by dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
    the gated delta rule, then the output gated-RMSNormed with silu(z) before out_proj. Key heads
    serve `linear_num_value_heads / linear_num_key_heads` value heads each.

    Projections, by `fused_projections`:
    - False (Qwen3.5): in_proj_qkv [Hk * (2 dk + r dv), dim], rows grouped per key head
      ([q_h | k_h | v of h's value heads]; HF stores all q | all k | all v and the converter permutes);
      in_proj_z [Hv * dv, dim]; in_proj_b, in_proj_a [Hv, dim].
    - True (Qwen3-Next, as HF stores them): in_proj_qkvz [Hk * (2 dk + 2 r dv), dim], per key head
      [q_h | k_h | v of h's value heads | z of h's value heads]; in_proj_ba [2 Hv, dim], per key head
      [b of h's value heads | a of h's value heads].
    Either way a contiguous shard of the projection rows holds whole key heads (tensor parallelism).
    conv1d.weight: [C, 1, K], C = Hk * (2 dk + r dv) channels grouped per key head as in_proj_qkv's
    rows; dt_bias, A_log: [Hv]; norm.weight: [dv]; out_proj: [dim, Hv * dv].
    """

    def __init__(self, args, lora: LoRAConfig | None, fused_projections: bool = False) -> None:
        super().__init__()
        dim = args.hidden_size
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.value_heads_per_key_head = args.linear_num_value_heads // args.linear_num_key_heads
        self.fused_projections = fused_projections
        n_k, n_v = args.linear_num_key_heads, args.linear_num_value_heads
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.value_heads_per_key_head
        conv_dim = n_k * (2 * dk + r * dv)
        if fused_projections:
            self.in_proj_qkvz = linear(dim, n_k * (2 * dk + 2 * r * dv), False, "in_proj_qkvz", lora)
            self.in_proj_ba = linear(dim, 2 * n_v, False, "in_proj_ba", lora)
        else:
            self.in_proj_qkv = linear(dim, conv_dim, False, "in_proj_qkv", lora)
            self.in_proj_z = linear(dim, n_v * dv, False, "in_proj_z", lora)
            self.in_proj_b = linear(dim, n_v, False, "in_proj_b", lora)
            self.in_proj_a = linear(dim, n_v, False, "in_proj_a", lora)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, args.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = GatedRMSNorm(dv, args.rms_norm_eps)
        self.out_proj = linear(n_v * dv, dim, False, "out_proj", lora)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, dim] -> qkv [T, Hk, 2 dk + r dv], b and a [T, Hv], z [T, Hv, dv], for this rank's heads."""
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.value_heads_per_key_head
        T = x.shape[0]
        if self.fused_projections:
            qkv, z = self.in_proj_qkvz(x).view(T, -1, 2 * dk + 2 * r * dv).split([2 * dk + r * dv, r * dv], dim=-1)
            b, a = self.in_proj_ba(x).view(T, -1, 2 * r).split(r, dim=-1)  # [T, Hk, r] each
            return qkv, b.reshape(T, -1), a.reshape(T, -1), z.reshape(T, -1, dv)
        qkv = self.in_proj_qkv(x).view(T, -1, 2 * dk + r * dv)
        return qkv, self.in_proj_b(x), self.in_proj_a(x), self.in_proj_z(x).view(T, -1, dv)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. cos/sin are unused (no positions in a recurrence). `cache`: a
        layer cache (archon/rollout/kv_cache.py) holding each sequence's conv window and state.

        With context_parallel (a ContextParallelGroup) x is this rank's slice of the tokens: the projections run on it,
        then the conv and the delta rule run on every token of this rank's key heads (each with its
        value heads; conv channels, A_log and dt_bias are per head), and the output comes back to
        the slice before the gated norm."""
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.value_heads_per_key_head
        cp = context_parallel
        window, state = (None, None) if cache is None else cache.recurrent_state()
        qkv, b, a, z = self._project(x)  # qkv: [T, Hk, 2 dk + r dv], this rank's key heads
        conv_weight, A_log, dt_bias = (local_tensor(t) for t in (self.conv1d.weight, self.A_log, self.dt_bias))
        if cp is not None:
            qkv = tokens_to_heads(qkv, cp)
            b, a = (tokens_to_heads(t[..., None], cp)[..., 0] for t in (b, a))
            conv_weight, A_log, dt_bias = (heads_of_rank(t, cp) for t in (conv_weight, A_log, dt_bias))
        T = qkv.shape[0]
        seqs = PaddedSequences(cu_seqlens, max_seqlen)

        qkv, window = causal_conv1d(seqs.pad(qkv.reshape(T, -1)), conv_weight, seqs.lengths, window)
        qkv = seqs.unpad(qkv).view(T, -1, 2 * dk + r * dv)  # [T, Hk, 2 dk + r dv]
        q, k, v = qkv.split([dk, dk, r * dv], dim=-1)
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # value head h reads key head h // r
        v = v.reshape(T, -1, dv)  # [T, Hv, dv]

        beta = b.sigmoid()  # [T, Hv]
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        o, state = gated_delta_rule(q, k, v, g, beta, seqs, state)
        if cache is not None:
            cache.store_recurrent_state(window, state)
        if cp is not None:
            o = heads_to_tokens(o, cp)

        o = self.norm(o.to(x.dtype), z)  # [T, Hv, dv]
        return self.out_proj(o.reshape(x.shape[0], -1))


def gated_deltanet_plan(prefix: str = "linear_attn", fused_projections: bool = False) -> dict[str, ParallelStyle]:
    """TP plan of a `GatedDeltaNet` by key head, with the value heads each key head serves: the input
    projections column-parallel (their rows are grouped per key head), the conv channels, dt_bias and
    A_log sharded with them, the gated norm on the local heads, out_proj row-parallel."""
    projections = (
        ("in_proj_qkvz", "in_proj_ba") if fused_projections else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    )
    plan = {f"{prefix}.{name}": colwise() for name in projections}
    plan[f"{prefix}.out_proj"] = rowwise()
    plan[f"{prefix}.norm"] = ReplicatedParallel(Shard(1))  # on [T, heads, dv]
    plan[prefix] = ShardedParameters({"conv1d.weight": Shard(0), "dt_bias": Shard(0), "A_log": Shard(0)})
    return plan
