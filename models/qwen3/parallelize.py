"""Qwen3 / Qwen3-MoE: tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards attention heads (q/k/v column-parallel, o row-parallel, per-head q/k norms replicated),
the dense MLP's intermediate dimension, and the vocabulary of the embedding and unembedding.
MoE blocks keep router and stacked experts whole on every tensor-parallel rank; FSDP2 shards the
experts on their expert dimension.
"""

from __future__ import annotations

from archon.parallel import (
    ParallelConfig,
    ParallelDims,
    attention_plan,
    parallelize_decoder,
    require_divisible,
    swiglu_plan,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from models.qwen3.model import Qwen3Model
from models.common.moe import SparseMoE


def parallelize_qwen3(model: Qwen3Model, dims: ParallelDims, config: ParallelConfig) -> Qwen3Model:
    args = model.args
    if dims.tp_enabled:
        sizes = dict(
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            vocab_size=args.vocab_size,
        )
        if any(not args.is_moe_layer(i) for i in range(args.num_hidden_layers)):
            sizes["intermediate_size"] = args.intermediate_size
        require_divisible("tp", dims.tp, "qwen3", **sizes)

    model_plan = {"embed_tokens": vocab_parallel_embedding()}
    if model.lm_head is not None:
        model_plan["lm_head"] = vocab_parallel_head()

    def block_plan(index, block):
        plan = attention_plan(qk_norm=("q_norm", "k_norm"))
        if not isinstance(block.mlp, SparseMoE):
            plan.update(swiglu_plan())
        return plan

    return parallelize_decoder(
        model, dims, config, blocks=list(model.layers), model_tp_plan=model_plan, block_tp_plan=block_plan
    )
