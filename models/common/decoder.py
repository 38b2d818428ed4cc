"""The pre-norm decoder skeleton shared by the Llama-style families, on packed sequences.

Module names follow HF (`embed_tokens`, `layers.<i>.self_attn`, `layers.<i>.mlp`, `norm`, `lm_head`)
without the `model.` prefix, so a family's state-dict converter is mostly a rename.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from archon.head import full_vocab_logits
from archon.models.common.norms import RMSNorm
from archon.models.common.rope import LayerTypeRotaryEmbedding, RotaryEmbedding

# The linear layers of attention and the SwiGLU MLP, by their HF names: a dense family's LoRA targets.
DENSE_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Sizes of the tiny random-weight models the alignment tool and tests build (ModelSpec.tiny_hf_config).
TINY_DECODER_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


class PreNormDecoderLayer(nn.Module):
    """h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).

    self_attn is called as `self_attn(x, cos, sin, cu_seqlens, max_seqlen)`, mlp as `mlp(x)`.
    """

    def __init__(self, dim: int, norm_eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim, norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(dim, norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, cache, context_parallel)
        return x + self.mlp(self.post_attention_layernorm(x))


class PackedDecoderLM(nn.Module):
    """embed_tokens -> rotary -> layers -> norm -> lm_head (or the tied embedding).

    `args` needs the HF fields vocab_size, hidden_size, rms_norm_eps and tie_word_embeddings, and
    layer_types when `rotary` is a LayerTypeRotaryEmbedding (each layer then gets its type's tables).
    norm: the final norm, RMSNorm(hidden_size, rms_norm_eps) unless given.
    rotary None: no layer reads positions (cos and sin reach the layers as None).
    embedding_scale: a factor on the embeddings, rounded to their dtype first as HF does
        (Gemma: sqrt(hidden_size)), or None.
    """

    def __init__(
        self,
        args,
        rotary: RotaryEmbedding | LayerTypeRotaryEmbedding | None,
        layers: Iterable[nn.Module],
        norm: nn.Module | None = None,
        embedding_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embedding_scale = embedding_scale
        self.rotary = rotary
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if norm is None else norm
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [V, dim] unembedding (the embedding itself when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        return_hidden: bool = False,
        cache=None,
        logits_rows: torch.Tensor | None = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """tokens, positions: [T]; cu_seqlens: [N+1]. Returns logits [T, V] or final hidden states [T, dim].

        cache: a KVCache (archon/rollout/kv_cache.py) during generation; each layer gets its own slice.
        logits_rows: [M] the positions whose logits to return ([M, V]; generation needs only each
        sequence's last), or None for all.
        context_parallel: a ContextParallelGroup (archon/parallel/context_parallel.py) when tokens and
        positions are this rank's slice of the batch that cu_seqlens describes; the token mixers then
        work on every token of their share of the heads.
        """
        h = self.embed_tokens(tokens)
        if self.embedding_scale is not None:
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype, device=h.device)
        tables = (None, None) if self.rotary is None else self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.args.layer_types[i]] if isinstance(tables, dict) else tables
            h = layer(h, cos, sin, cu_seqlens, max_seqlen, None if cache is None else cache.layer(i), context_parallel)
        if logits_rows is not None:
            h = h[logits_rows]
        h = self.norm(h)
        if return_hidden:
            return h
        return full_vocab_logits(h, self.output_weight)
