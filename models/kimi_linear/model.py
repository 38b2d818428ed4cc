"""Kimi Linear (Kimi-Linear-48B-A3B) on packed sequences: a hybrid of Kimi Delta Attention layers and
MLA layers, as `layer_types` says (HF names both mixers `self_attn`), with dense MLPs or group-limited
sigmoid-routed experts plus shared experts, as `mlp_layer_types` says.

Kimi Delta Attention (KDA), per head with state S [d, d] and for each token t:
    S_t = diag(exp(g_t)) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
a gated delta rule whose log decay g_t is per key channel ([H, d] per token, not one number per head):
g = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias). q, k and v come from their own
projections through short causal depthwise convs (then silu), q and k are L2-normed, q scaled by
d^-0.5, beta = sigmoid(b_proj x), and the output is RMS-normed per head and gated by
sigmoid(g_b_proj(g_a_proj(x))) before o_proj. The recurrent state and the conv windows start from zero
at every packed sequence (or from the generation cache).

The MLA layers are DeepSeek-V3's attention without positions (NoPE): the shared key part
(qk_rope_head_dim features) is used as it is, and no layer reads `positions`.

Layout differences from HF's in-memory model (the state-dict converter maps them): the conv is three
modules, `q_conv1d`, `k_conv1d`, `v_conv1d`, as in released checkpoints (HF concatenates them into one
`conv1d`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.linear_attention import PaddedSequences, causal_conv1d, gated_delta_rule
from archon.models.common.mla import MultiHeadLatentAttention
from archon.models.common.moe import group_limited_moe_mlp
from archon.models.common.norms import GatedRMSNorm
from archon.models.kimi_linear.args import LINEAR_ATTENTION, KimiLinearArgs
from archon.parallel.tensor_parallel import local_tensor
from archon.recurrent import RecurrentTokenMixer


class KimiForgetGate(nn.Module):
    """The per-channel log decay of KDA, HF name `forget_gate`: f_a_proj [d, dim] (a low-rank
    bottleneck of one head's width), f_b_proj [H * d, d], dt_bias [H * d], A_log [1, 1, H, 1] (HF's shape)."""

    def __init__(self, args: KimiLinearArgs, lora: LoRAConfig | None) -> None:
        super().__init__()
        n_heads, head_dim = args.linear_num_heads, args.linear_head_dim
        self.head_dim = head_dim
        self.f_a_proj = linear(args.hidden_size, head_dim, False, "f_a_proj", lora)
        self.f_b_proj = linear(head_dim, n_heads * head_dim, False, "f_b_proj", lora)
        self.dt_bias = nn.Parameter(torch.zeros(n_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, n_heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] -> g [T, H, d] (fp32, or fp64 for an fp64 model), the log decay of each key channel."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        dt_bias, A_log = local_tensor(self.dt_bias).to(dtype), local_tensor(self.A_log).to(dtype).reshape(-1)
        g = (self.f_b_proj(self.f_a_proj(x)).to(dtype) + dt_bias).view(x.shape[0], -1, self.head_dim)
        return -A_log.exp()[:, None] * F.softplus(g)


class KimiDeltaAttention(RecurrentTokenMixer):
    """The linear-attention mixer of Kimi Linear (HF `KimiLinearDeltaAttention`, module name `self_attn`).

    q_proj, k_proj, v_proj: [H * d, dim]; q_conv1d, k_conv1d, v_conv1d weights: [H * d, 1, K];
    b_proj: [H, dim]; g_a_proj: [d, dim]; g_b_proj: [H * d, d]; o_norm.weight: [d]; o_proj: [dim, H * d].
    """

    def __init__(self, args: KimiLinearArgs, lora: LoRAConfig | None) -> None:
        super().__init__()
        dim, n_heads, head_dim = args.hidden_size, args.linear_num_heads, args.linear_head_dim
        width, taps = n_heads * head_dim, args.linear_conv_kernel_dim
        self.head_dim = head_dim
        self.q_proj = linear(dim, width, False, "q_proj", lora)
        self.k_proj = linear(dim, width, False, "k_proj", lora)
        self.v_proj = linear(dim, width, False, "v_proj", lora)
        self.q_conv1d = nn.Conv1d(width, width, taps, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, taps, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, taps, groups=width, bias=False)
        self.forget_gate = KimiForgetGate(args, lora)
        self.b_proj = linear(dim, n_heads, False, "b_proj", lora)
        self.g_a_proj = linear(dim, head_dim, False, "g_a_proj", lora)
        self.g_b_proj = linear(head_dim, width, False, "g_b_proj", lora)
        self.o_norm = GatedRMSNorm(head_dim, args.rms_norm_eps, gate_activation=torch.sigmoid)
        self.o_proj = linear(width, dim, False, "o_proj", lora)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim] -> [T, dim]. cos/sin are unused (no positions in a recurrence). `cache`: a
        layer cache (archon/rollout/kv_cache.py) holding each sequence's conv window [K-1, 3 H d]
        (q, k, v channels) and state [H, d, d]."""
        if context_parallel is not None:
            raise NotImplementedError("Kimi Delta Attention does not support context parallelism")
        T, d = x.shape[0], self.head_dim
        window, state = (None, None) if cache is None else cache.recurrent_state()
        seqs = PaddedSequences(cu_seqlens, max_seqlen)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3 H d], this rank's heads
        conv_weight = torch.cat([local_tensor(c.weight) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        qkv, window = causal_conv1d(seqs.pad(qkv), conv_weight, seqs.lengths, window)
        q, k, v = seqs.unpad(qkv).view(T, 3, -1, d).unbind(1)  # each [T, H, d]

        g = self.forget_gate(x)  # [T, H, d]
        beta = self.b_proj(x).sigmoid()  # [T, H]
        o, state = gated_delta_rule(q, k, v, g, beta, seqs, state)
        if cache is not None:
            cache.store_recurrent_state(window, state)

        gate = self.g_b_proj(self.g_a_proj(x)).view(T, -1, d)
        o = self.o_norm(o.to(x.dtype), gate)  # [T, H, d]
        return self.o_proj(o.reshape(T, -1))


class KimiLinearDecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: KimiLinearArgs, layer_idx: int, lora: LoRAConfig | None) -> None:
        layer_type = args.layer_types[layer_idx]
        if layer_type == LINEAR_ATTENTION:
            mixer = KimiDeltaAttention(args, lora)
        else:
            mixer = MultiHeadLatentAttention(args, lora, rotary=False)
        super().__init__(args.hidden_size, args.rms_norm_eps, mixer, group_limited_moe_mlp(args, layer_idx, lora))
        self.layer_type = layer_type


class KimiLinearModel(PackedDecoderLM):
    def __init__(self, args: KimiLinearArgs, lora: LoRAConfig | None = None) -> None:
        super().__init__(args, None, (KimiLinearDecoderLayer(args, i, lora) for i in range(args.num_hidden_layers)))
