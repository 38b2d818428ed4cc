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

import torch
import torch.nn.functional as F
from archon.models.common.attention import GatedAttention
from archon.models.common.decoder import PackedDecoderLM
from archon.models.common.linear_attention import PaddedSequences, causal_conv1d, gated_delta_rule
from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import SharedExpertMoE
from archon.models.common.norms import GatedRMSNorm, OffsetRMSNorm
from archon.models.common.rope import RotaryEmbedding
from archon.models.qwen3_next.args import LINEAR_ATTENTION, Qwen3NextArgs
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.parallel.context_parallel import heads_of_rank, heads_to_tokens, tokens_to_heads
from archon.parallel.tensor_parallel import local_tensor


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of Qwen3.5, HF name `linear_attn`.

    in_proj_qkv: [Hk * (2 dk + r dv), dim], rows grouped per key head (see the module docstring);
    in_proj_z: [Hv * dv, dim]; in_proj_b, in_proj_a: [Hv, dim]; conv1d.weight: [C, 1, K] (channels as
    in_proj_qkv's rows); dt_bias, A_log: [Hv]; norm.weight: [dv]; out_proj: [dim, Hv * dv].
    """

    def __init__(self, args: Qwen3NextArgs, lora: LoRAConfig | None) -> None:
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


class Qwen3NextDecoderLayer(nn.Module):
    """h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)), where the mixer
    is `linear_attn` (gated DeltaNet) or `self_attn` (gated attention) as layer_types says."""

    def __init__(self, args: Qwen3NextArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
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


class Qwen3NextModel(PackedDecoderLM):
    def __init__(self, args: Qwen3NextArgs, lora: LoRAConfig | None = None) -> None:
        super().__init__(
            args,
            RotaryEmbedding(args.rope_parameters, args.rotary_dim, args.max_position_embeddings),
            (Qwen3NextDecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)),
        )
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)  # the final norm is zero-centred too
