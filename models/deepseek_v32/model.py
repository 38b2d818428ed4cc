"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) on packed sequences: DeepSeek-V3's MLA and
MoE with DeepSeek Sparse Attention (DSA).

Each layer's lightning indexer scores every earlier key of the sequence for each query,

    score(t, s) = sum_h w_h(x_t) * relu(q_h(t) . k(s) / sqrt(index_head_dim)),
        w = weights_proj(x) / sqrt(index_n_heads)

with its own queries (wq_b on MLA's query latent), one key per token (wk, then a LayerNorm k_norm)
and per-head weights (weights_proj); the first qk_rope_head_dim features of its queries and keys
are rotary. Attention then reads only the `index_topk` best-scoring causal keys of each query
(all of them while there are fewer). A GLM-5 "shared" layer has no indexer and reuses the
selection of the nearest full layer before it.

The indexer is frozen and is not a LoRA target: the selection is a top-k (not differentiable),
and its scores reach nothing else, so no gradient reaches its weights. HF computes it under
no_grad; archon too. (DeepSeek trained the indexer with a loss of its own, a KL divergence to the
main attention's distribution; archon does not implement it.) LoRA on MLA's q_a_proj still moves
the selection, since the indexer's queries are made from the query latent. Scores are computed in
float32 whatever the model dtype, as HF does (HF also stores weights_proj in fp32 in a bf16 model;
archon stores it in the model dtype and computes with it in fp32). torch.topk orders tied scores as
it likes, in HF as here: the tiny configs use 16 indexer heads, so that no query's k-th and (k+1)-th
scores tie (at 0, where every head's ReLU is 0).

Training and prefill build, per packed sequence, the [L, L] mask of selected keys (queries in
blocks, so the [block, index_n_heads, L] score tensor stays bounded); attention runs masked per
sequence (SDPA with that mask; the flash varlen kernel takes no mask). During generation the cache
keeps each layer's indexer keys next to its keys and values (archon/rollout/kv_cache.py), and a
decode step selects over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.causal_attention import causal_mask
from archon.lora import LoRAConfig
from archon.models.common.decoder import PackedDecoderLM, PreNormDecoderLayer
from archon.models.common.mla import MultiHeadLatentAttention
from archon.models.common.moe import group_limited_moe_mlp
from archon.models.common.rope import RotaryEmbedding, apply_rotary
from archon.models.deepseek_v32.args import DeepseekV32Args

# HF builds the indexer's k_norm with this eps, not config.rms_norm_eps.
INDEXER_KEY_NORM_EPS = 1e-6
# Scores held at once when selecting over a packed sequence: the queries go in blocks whose
# [block, index_n_heads, L] fp32 scores stay within this many elements (256 MiB).
SELECTION_SCORE_ELEMENTS = 2**26


def top_k_selection(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    visible: torch.Tensor,
    top_k: int,
    scale: float,
) -> torch.Tensor:
    """index_q [..., Lq, Hi, Di], weights [..., Lq, Hi] (already scaled by Hi^-0.5), index_k
    [..., Lk, Di], visible [..., Lq, Lk] bool -> [..., Lq, Lk] bool: each query's top_k visible keys
    by indexer score (all visible keys when there are fewer)."""
    scores = torch.einsum("...qhd,...kd->...qhk", index_q.float(), index_k.float()) * scale
    scores = torch.einsum("...qh,...qhk->...qk", weights.float(), F.relu(scores))
    scores = scores.masked_fill(~visible, float("-inf"))
    chosen = scores.topk(min(top_k, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible


class LightningIndexer(nn.Module):
    """DSA's indexer (module and parameter names as HF's `indexer`)."""

    def __init__(self, args: DeepseekV32Args) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.top_k = args.index_topk
        self.interleaved = args.indexer_rope_interleave
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim], q_latent [T, q_lora_rank] -> queries [T, Hi, Di], keys [T, Di], head weights [T, Hi] (fp32)."""
        T = x.shape[0]
        q = apply_rotary(self.wq_b(q_latent).view(T, self.n_heads, self.head_dim), cos, sin, self.interleaved)
        k = apply_rotary(self.k_norm(self.wk(x))[:, None, :], cos, sin, self.interleaved)[:, 0]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        return q, k, weights

    def select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        return top_k_selection(q, weights, k, visible, self.top_k, self.scale)

    def select_packed(self, q, k, weights, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
        """One [L, L] bool mask per packed sequence: the causal keys each query reads."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        masks = []
        for q_seq, k_seq, w_seq in zip(q.split(lengths), k.split(lengths), weights.split(lengths)):
            length = k_seq.shape[0]
            causal = causal_mask(length, None, k_seq.device)
            block = max(1, SELECTION_SCORE_ELEMENTS // (self.n_heads * length))
            masks.append(
                torch.cat(
                    [
                        self.select(q_seq[s : s + block], k_seq, w_seq[s : s + block], causal[s : s + block])
                        for s in range(0, length, block)
                    ]
                )
            )
        return masks


def sparse_packed_attention(
    q, k, v, cu_seqlens: torch.Tensor, scale: float, selected: list[torch.Tensor]
) -> torch.Tensor:
    """q, k: [T, H, D], v: [T, H, Dv], selected: one [L, L] bool mask per packed sequence -> [T, H, Dv]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = []
    for q_seq, k_seq, v_seq, mask in zip(q.split(lengths), k.split(lengths), v.split(lengths), selected):
        out = F.scaled_dot_product_attention(
            q_seq.transpose(0, 1)[None],
            k_seq.transpose(0, 1)[None],
            v_seq.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
        )[0]
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA whose queries read only the keys a lightning indexer selects (this layer's own, or with
    `selection_source`, the selection of that earlier layer's attention: a GLM-5 shared layer)."""

    def __init__(
        self, args: DeepseekV32Args, lora: LoRAConfig | None, selection_source: "SparseLatentAttention | None"
    ) -> None:
        super().__init__(args, lora)
        self.indexer = LightningIndexer(args) if selection_source is None else None
        # a plain list, so the source is not registered (its parameters would be listed twice)
        self._selection_source = [] if selection_source is None else [selection_source]
        if selection_source is not None:
            selection_source.keeps_selection = True
        # keeps_selection: a shared layer reads this layer's last selection (`selection`), which is
        # otherwise not kept past the forward
        self.keeps_selection = False
        self.selection = None

    def _select(self, x, q_latent, cos, sin, cu_seqlens, cache):
        """The keys each query reads: one [L, L] mask per packed sequence (training, or a prefill
        from empty cache blocks), [R, prefix_span + suffix_span] at a decode step, or one
        [L, offset + L] mask per prompt at a prefill after kept prefixes (see LayerKVCache)."""
        if self.indexer is None:
            return self._selection_source[0].selection
        with torch.no_grad():
            q, k, weights = self.indexer(x, q_latent, cos, sin)
            context = None if cache is None else cache.index_keys(k)
            if context is None:
                return self.indexer.select_packed(q, k, weights, cu_seqlens)
            if cache.decoding:
                keys, visible = context  # [R, Lk, Di], [R, Lk]
                return self.indexer.select(q[:, None], keys, weights[:, None], visible[:, None])[:, 0]
            lengths = [visible.shape[0] for _, visible in context]
            return [
                self.indexer.select(q_seq, keys, w_seq, visible)
                for q_seq, w_seq, (keys, visible) in zip(q.split(lengths), weights.split(lengths), context)
            ]

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None) -> torch.Tensor:
        """x: [T, dim], cos/sin: [T, qk_rope_head_dim] -> [T, dim]."""
        if context_parallel is not None:
            raise ValueError("context parallelism is not implemented for DeepSeek sparse attention (index_topk)")
        q, k, v, q_latent = self.project(x, cos, sin)
        selection = self._select(x, q_latent, cos, sin, cu_seqlens, cache)
        if self.keeps_selection:
            self.selection = selection
        out = None if cache is None else cache.attention(q, k, v, self.scale, selected=selection)
        if out is None:  # training, or a prefill from empty blocks (the cache has stored k and v)
            out = sparse_packed_attention(q, k, v, cu_seqlens, self.scale, selection)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DeepseekV32DecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, args: DeepseekV32Args, self_attn: SparseLatentAttention, layer_idx: int, lora: LoRAConfig | None
    ) -> None:
        super().__init__(args.hidden_size, args.rms_norm_eps, self_attn, group_limited_moe_mlp(args, layer_idx, lora))


class DeepseekV32Model(PackedDecoderLM):
    def __init__(self, args: DeepseekV32Args, lora: LoRAConfig | None = None) -> None:
        layers, full_layer = [], None
        for i in range(args.num_hidden_layers):
            attention = SparseLatentAttention(args, lora, None if args.has_indexer(i) else full_layer)
            full_layer = attention if args.has_indexer(i) else full_layer
            layers.append(DeepseekV32DecoderLayer(args, attention, i, lora))
        super().__init__(
            args, RotaryEmbedding(args.rope_parameters, args.qk_rope_head_dim, args.max_position_embeddings), layers
        )
