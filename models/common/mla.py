"""Multi-head latent attention (MLA, DeepSeek-V3) on packed sequences, and its tensor-parallel plan.

Computed in its expanded form: every head's keys and values are made from the latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from archon.lora import LoRAConfig, linear
from archon.models.common.attention import packed_attention
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import apply_rotary, yarn_softmax_mscale
from archon.parallel import colwise, rowwise

# HF builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's MLA. Per token, H heads:

    q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with the query bottleneck: [H, nope + rope]
    [latent | k_rot] = kv_a_proj_with_mqa(x): [kv_lora_rank | rope]; k_rot is one key for all heads
    [k_nope | v] = kv_b_proj(kv_a_layernorm(latent)): [H, nope + v]
    k = [k_nope | RoPE(k_rot)], q = [q_nope | RoPE(q_rot)]; softmax scale qk_head_dim^-0.5 * YaRN mscale.
    With rotary=False (Kimi Linear's NoPE layers) q_rot and k_rot are used as they are, and the scale
    is qk_head_dim^-0.5.

    `args` needs the HF fields hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias, and qk_head_dim (nope + rope);
    with rotary, rope_interleave and rope_parameters too. Families: DeepSeek-V3 / Kimi K2 and those
    built on its attention (Kimi Linear).
    """

    def __init__(self, args, lora: LoRAConfig | None, rotary: bool = True) -> None:
        super().__init__()
        dim, n_heads = args.hidden_size, args.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_head_dim = args.qk_head_dim
        self.rotary = rotary
        self.interleaved = args.rope_interleave if rotary else False
        self.scale = self.qk_head_dim**-0.5 * (yarn_softmax_mscale(args.rope_parameters) if rotary else 1.0)
        if args.q_lora_rank is None:
            self.q_proj = linear(dim, n_heads * self.qk_head_dim, False, "q_proj", lora)
        else:
            self.q_proj = None
            self.q_a_proj = linear(dim, args.q_lora_rank, args.attention_bias, "q_a_proj", lora)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(args.q_lora_rank, n_heads * self.qk_head_dim, False, "q_b_proj", lora)
        self.kv_a_proj_with_mqa = linear(
            dim, self.kv_lora_rank + self.rope_dim, args.attention_bias, "kv_a_proj_with_mqa", lora
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear(self.kv_lora_rank, n_heads * (self.nope_dim + self.v_dim), False, "kv_b_proj", lora)
        self.o_proj = linear(n_heads * self.v_dim, dim, args.attention_bias, "o_proj", lora)
        # Identity on the rotary key that all heads share. Under tensor parallelism each rank uses
        # it for its own heads only; the TP plan makes this module sum those gradient shares.
        self.shared_rope_key = nn.Identity()

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [T, dim], cos/sin: [T, qk_rope_head_dim] -> q [T, H, qk_head_dim], k [T, H, qk_head_dim],
        v [T, H, v_head_dim] and the query latent q_a_layernorm(q_a_proj(x)) [T, q_lora_rank] (None
        without the query bottleneck). H is this rank's share of the heads under tensor parallelism."""
        T = x.shape[0]
        if self.q_proj is not None:
            q_latent = None
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q_nope, q_rot = q.view(T, -1, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [T, H, nope], [T, H, v]
        k_rot = k_rot[:, None, :]  # [T, 1, rope]
        if self.rotary:
            q_rot = apply_rotary(q_rot, cos, sin, self.interleaved)
            k_rot = apply_rotary(k_rot, cos, sin, self.interleaved)
        k_rot = self.shared_rope_key(k_rot)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1)), dim=-1)
        return q, k, v, q_latent

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        cache=None,
        context_parallel=None,
    ) -> torch.Tensor:
        """x: [T, dim], cos/sin: [T, qk_rope_head_dim] -> [T, dim]. context_parallel: see
        packed_attention. `cache`: a layer's KV cache during generation (archon/rollout/kv_cache.py),
        which holds the expanded per-head keys and values."""
        q, k, v, _ = self.project(x, cos, sin)
        out = None if cache is None else cache.attention(q, k, v, self.scale)
        if out is None:  # training, or a prefill (the cache has stored k and v)
            # The flash varlen kernel takes one head size for q, k and v: values are zero-padded up
            # to the query/key size and the padding is cut from the output.
            pad = max(self.qk_head_dim - self.v_dim, 0)
            out = packed_attention(
                q, k, F.pad(v, (0, pad)), cu_seqlens, max_seqlen, self.scale, context_parallel=context_parallel
            )[..., : self.v_dim]
        return self.o_proj(out.reshape(x.shape[0], -1))


class SharedAcrossHeads(ParallelStyle):
    """For a replicated activation that each tensor-parallel rank consumes for its own heads only:
    the module's output is its input as a local tensor whose gradient is a partial sum, so the
    backward all-reduces it over the ranks before it reaches the (replicated) producer."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return (DTensor.from_local(inputs[0], mesh, (Replicate(),), run_check=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            return output.to_local(grad_placements=(Partial(),))

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


def mla_plan(args, prefix: str = "self_attn") -> dict[str, ParallelStyle]:
    """Heads sharded: the per-head projections (q_proj, or q_b_proj after the query bottleneck, and
    kv_b_proj, whose rows are head-major) column-parallel, o_proj row-parallel. The latent
    projections (q_a_proj, kv_a_proj_with_mqa) and their norms feed every head, so they stay
    replicated; so does the shared rotary key, which each rank expands to its own heads: its gradient
    is summed over the ranks (`SharedAcrossHeads`)."""
    query = "q_proj" if args.q_lora_rank is None else "q_b_proj"
    return {
        f"{prefix}.{query}": colwise(),
        f"{prefix}.kv_b_proj": colwise(),
        f"{prefix}.shared_rope_key": SharedAcrossHeads(),
        f"{prefix}.o_proj": rowwise(),
    }
