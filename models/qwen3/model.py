"""Qwen3 and Qwen3-MoE on packed sequences.

Module names follow HF (`layers.0.self_attn.q_proj`, `mlp.experts.gate_up_proj`, ...) without the
`model.` prefix, so the state-dict adapter is a rename plus expert stacking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig
from models.common.attention import Attention
from models.common.mlp import SwiGLUMLP
from models.common.moe import GroupedExperts, SoftmaxTopKRouter, SparseMoE
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding
from models.qwen3.args import Qwen3Args


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, layer_idx: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(
            dim=args.hidden_size,
            n_heads=args.num_attention_heads,
            n_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            qkv_bias=args.attention_bias,
            o_bias=args.attention_bias,
            qk_norm_eps=args.rms_norm_eps,
            lora=lora,
        )
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(
                SoftmaxTopKRouter(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob),
                GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size, lora),
            )
        else:
            self.mlp = SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, args: Qwen3Args, lora: LoRAConfig | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rotary = RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(args, i, lora) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
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
    ) -> torch.Tensor:
        """tokens, positions: [T]; cu_seqlens: [N+1]. Returns logits [T, V] or final hidden states [T, dim]."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, cu_seqlens, max_seqlen)
        h = self.norm(h)
        if return_hidden:
            return h
        return F.linear(h, self.output_weight)
