"""Qwen3.5 / Qwen3.6 (dense and MoE) on packed sequences: a hybrid of gated DeltaNet layers
(`linear_attn`) and gated full-attention layers (`self_attn`), as `layer_types` says.

Gated DeltaNet, per value head with state S [dk, dv] and for each token t:
    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
after a short causal depthwise conv (then silu) over the fused q/k/v projection, L2-normed q and k,
q scaled by dk^-0.5, beta = sigmoid(in_proj_b x), g = -exp(A_log) * softplus(in_proj_a x + dt_bias),
and the output gated-RMSNormed with silu(in_proj_z x) before out_proj. Key heads serve
`linear_num_value_heads / linear_num_key_heads` value heads each. The recurrent state and the conv
window start from zero at every packed sequence (or from the generation cache).

Gated attention: q_proj yields each head's query and an output gate side by side; the attention
output is multiplied by sigmoid(gate) before o_proj. QK-norm per head, RoPE on the first
`partial_rotary_factor` of each head.

Layout differences from HF (the state-dict converter maps them): `in_proj_qkv` rows and the conv
channels are ordered per key head, [q_h, k_h, v of h's value heads] for h = 0, 1, ..., so that a
contiguous shard of them (tensor parallelism) holds whole heads. Module names otherwise follow HF.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from archon.models.common.attention import packed_attention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import GroupedExperts, SoftmaxTopKRouter
from archon.models.common.rope import RotaryEmbedding, apply_rotary
from archon.models.qwen3_5.args import LINEAR_ATTENTION, Qwen3_5Args
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.parallel.context_parallel import heads_of_rank, heads_to_tokens, tokens_to_heads
from archon.parallel.tensor_parallel import local_tensor

logger = logging.getLogger(__name__)

# Tokens per chunk of the chunked delta rule: within a chunk the updates are solved at once, chunks
# are scanned one after another.
DELTA_RULE_CHUNK_SIZE = 64


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight) in fp32, then cast back (Qwen3.5's zero-centred norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """weight * RMSNorm(x), cast back to x's dtype, times silu(gate) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Packed sequences <-> a padded batch
# ---------------------------------------------------------------------------------------------


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

    q, k: [N, H, L, dk] (q already scaled); v: [N, H, L, dv]; g (log decay), beta: [N, H, L], zero
    after each sequence so the padding leaves the state as it is; initial_state: [N, H, dk, dv] or None.
    Returns (o [N, H, L, dv], final state [N, H, dk, dv]).

    Within a chunk, with G the cumulative log decay and D[i, j] = exp(G_i - G_j) for j <= i, the
    updates are solved at once (the WY form of the delta rule): with A = I + strictly_lower(
    beta_i k_i.k_j D[i, j]), U = A^-1 (beta v) and W = A^-1 (beta exp(G) k), the chunk reads the
    state S it starts from as v_new = U - W S and o = exp(G) q S + (q k^T * D) v_new, and leaves
    S' = exp(G_last) S + (exp(G_last - G) k)^T v_new.
    """
    n_seqs, n_heads, length, dk = k.shape
    dv = v.shape[-1]
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n_chunks = (length + pad) // chunk
    q, k, v = (t.reshape(n_seqs, n_heads, n_chunks, chunk, -1) for t in (q, k, v))
    g, beta = (t.reshape(n_seqs, n_heads, n_chunks, chunk) for t in (g, beta))

    cum_g = g.cumsum(dim=-1)  # [N, H, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, H, n, C, C]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strictly lower triangle is read
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum_g.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum_g.exp()[..., None]
    k_to_chunk_end = k * (cum_g[..., -1:] - cum_g).exp()[..., None]
    chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [N, H, n, 1, 1]

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
            "delta rule. Install archon[kernels] for the fused CUDA kernel.", e,
        )
        return None
    logger.info("gated DeltaNet layers use flash-linear-attention's chunk_gated_delta_rule")
    return chunk_gated_delta_rule


def gated_delta_rule(q, k, v, g, beta, seqs: PaddedSequences, initial_state):
    """q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H] (packed, fp32 g) -> (o [T, H, dv], state [N, H, dk, dv]).

    q and k are L2-normalised here and q scaled by dk^-0.5. The rule runs in fp32 (or fp64 for an fp64 model)."""
    dk = q.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    kernel = _fla_chunk_gated_delta_rule() if q.is_cuda else None
    if kernel is not None:
        cu_seqlens = torch.cat([seqs.lengths.new_zeros(1), seqs.lengths.cumsum(0)])
        o, state = kernel(
            q[None], k[None], v[None], g[None], beta[None], scale=dk**-0.5,
            initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
        )
        return o[0], state
    padded = [seqs.pad(t).transpose(1, 2) for t in (q * dk**-0.5, k, v, g, beta)]  # [N, H, L, ...]
    o, state = chunked_gated_delta_rule(*padded, initial_state=initial_state)
    return seqs.unpad(o.transpose(1, 2)), state


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of Qwen3.5, HF name `linear_attn`.

    in_proj_qkv: [Hk * (2 dk + r dv), dim], rows grouped per key head (see the module docstring);
    in_proj_z: [Hv * dv, dim]; in_proj_b, in_proj_a: [Hv, dim]; conv1d.weight: [C, 1, K] (channels as
    in_proj_qkv's rows); dt_bias, A_log: [Hv]; norm.weight: [dv]; out_proj: [dim, Hv * dv].
    """

    def __init__(self, args: Qwen3_5Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim = args.hidden_size
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.value_heads_per_key_head = args.linear_value_heads_per_key_head
        n_k, n_v = args.linear_num_key_heads, args.linear_num_value_heads
        conv_dim = n_k * (2 * self.key_head_dim + self.value_heads_per_key_head * self.value_head_dim)
        self.in_proj_qkv = linear(dim, conv_dim, False, "in_proj_qkv", lora)
        self.in_proj_z = linear(dim, n_v * self.value_head_dim, False, "in_proj_z", lora)
        self.in_proj_b = linear(dim, n_v, False, "in_proj_b", lora)
        self.in_proj_a = linear(dim, n_v, False, "in_proj_a", lora)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, args.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = GatedRMSNorm(self.value_head_dim, args.rms_norm_eps)
        self.out_proj = linear(n_v * self.value_head_dim, dim, False, "out_proj", lora)

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
        qkv = self.in_proj_qkv(x)  # [T, Hk * (2 dk + r dv)], this rank's key heads
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [T, Hv]
        conv_weight, A_log, dt_bias = (local_tensor(t) for t in (self.conv1d.weight, self.A_log, self.dt_bias))
        if cp is not None:
            qkv = tokens_to_heads(qkv.view(x.shape[0], -1, 2 * dk + r * dv), cp).flatten(1)
            b, a = (tokens_to_heads(t[..., None], cp)[..., 0] for t in (b, a))
            conv_weight, A_log, dt_bias = (heads_of_rank(t, cp) for t in (conv_weight, A_log, dt_bias))
        T = qkv.shape[0]
        seqs = PaddedSequences(cu_seqlens, max_seqlen)

        qkv, window = causal_conv1d(seqs.pad(qkv), conv_weight, seqs.lengths, window)
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

        z = self.in_proj_z(x).view(x.shape[0], -1, dv)
        o = self.norm(o.to(x.dtype), z)  # [T, Hv, dv]
        return self.out_proj(o.reshape(x.shape[0], -1))


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate, QK-norm and partial rotary; HF name `self_attn`.

    q_proj: [H * 2 * head_dim, dim], each head's query rows then its gate rows.
    """

    def __init__(self, args: Qwen3_5Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        n_heads, n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})")
        bias = args.attention_bias
        self.head_dim = hd
        self.scale = hd**-0.5
        self.q_proj = linear(dim, n_heads * 2 * hd, bias, "q_proj", lora)
        self.k_proj = linear(dim, n_kv_heads * hd, bias, "k_proj", lora)
        self.v_proj = linear(dim, n_kv_heads * hd, bias, "v_proj", lora)
        self.o_proj = linear(n_heads * hd, dim, bias, "o_proj", lora)
        self.q_norm = OffsetRMSNorm(hd, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, args.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. `cache`: a layer's KV cache during generation, or None.
        context_parallel: see packed_attention."""
        T, hd = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(T, -1, 2 * hd).split(hd, dim=-1)  # [T, H, hd] each
        k = self.k_proj(x).view(T, -1, hd)
        v = self.v_proj(x).view(T, -1, hd)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        out = None if cache is None else cache.attention(q, k, v, self.scale)
        if out is None:  # training, or a prefill (the cache has stored k and v)
            out = packed_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, context_parallel=context_parallel)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(T, -1))


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k, renormalised) plus one shared expert scaled per token by
    sigmoid(shared_expert_gate(x)); HF names gate, experts, shared_expert, shared_expert_gate."""

    def __init__(self, args: Qwen3_5Args, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim = args.hidden_size
        self.gate = SoftmaxTopKRouter(dim, args.num_experts, args.num_experts_per_tok, norm_topk_prob=True)
        self.experts = GroupedExperts(args.num_experts, dim, args.moe_intermediate_size, lora)
        self.shared_expert = SwiGLUMLP(dim, args.shared_expert_intermediate_size, bias=False, lora=lora)
        self.shared_expert_gate = linear(dim, 1, False, "shared_expert_gate", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_weights, top_indices = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, top_weights, top_indices) + shared


class Qwen3_5DecoderLayer(nn.Module):
    """h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)), where the mixer
    is `linear_attn` (gated DeltaNet) or `self_attn` (gated attention) as layer_types says."""

    def __init__(self, args: Qwen3_5Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.layer_type = args.layer_types[layer_idx]
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args, lora)
        else:
            self.self_attn = GatedAttention(args, lora)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.num_experts:
            self.mlp = SharedExpertMoE(args, lora)
        else:
            self.mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        x = x + self.mixer(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(PackedDecoderLM):
    def __init__(self, args: Qwen3_5Args, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings),
            (Qwen3_5DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)  # the final norm is zero-centred too
