"""The TP plan of a dense pre-norm decoder (`PackedDecoderLM` with `Attention` and `SwiGLUMLP`
blocks), then the generic activation-checkpointing / compile / FSDP2 pipeline.

TP shards attention heads (q/k/v column-parallel with their biases, o row-parallel), the MLP's
intermediate dimension, and the vocabulary of the embedding and unembedding. Windows apply per
head, so they need nothing of their own.
"""

from __future__ import annotations

from torch import nn

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


def parallelize_dense_decoder(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    qk_norm: tuple[str, str] | None = None,
) -> nn.Module:
    """qk_norm: the names of per-head q/k norms inside `self_attn`, replicated over head shards."""
    args = model.args
    if dims.tp_enabled:
        require_divisible(
            "tp",
            dims.tp,
            type(model).__name__,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
        )
    model_plan = {"embed_tokens": vocab_parallel_embedding()}
    if model.lm_head is not None:
        model_plan["lm_head"] = vocab_parallel_head()
    block_plan = {**attention_plan(qk_norm=qk_norm), **swiglu_plan()}
    return parallelize_decoder(
        model, dims, config, blocks=list(model.layers), model_tp_plan=model_plan,
        block_tp_plan=lambda index, block: block_plan,
    )
