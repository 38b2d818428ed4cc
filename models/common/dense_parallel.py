"""The TP plan of a pre-norm decoder (`PackedDecoderLM` with `Attention` and `SwiGLUMLP` blocks,
sparse MLPs kept whole), then the generic activation-checkpointing / compile / FSDP2 pipeline.

TP shards attention heads (q/k/v column-parallel with their biases, o row-parallel), the MLP's
intermediate dimension, and the vocabulary of the embedding and unembedding. Windows apply per
head, so they need nothing of their own.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard

from archon.models.common.mlp import SwiGLUMLP
from archon.models.common.moe import routed_experts
from archon.parallel import (
    ParallelConfig,
    ParallelDims,
    ShardedParameters,
    attention_plan,
    parallelize_decoder,
    require_divisible,
    swiglu_plan,
    vocab_parallel_embedding,
    vocab_parallel_head,
)


def vocab_parallel_plan(model: nn.Module) -> dict:
    """The embedding and (when untied) the unembedding, sharded on the vocabulary."""
    plan = {"embed_tokens": vocab_parallel_embedding()}
    if model.lm_head is not None:
        plan["lm_head"] = vocab_parallel_head()
    return plan


def parallelize_dense_decoder(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    qk_norm: tuple[str, str] | None = None,
    family: str | None = None,
    num_experts_field: str | None = None,
    projection_qk_norm: tuple[str, str] | None = None,
) -> nn.Module:
    """qk_norm: the names of per-head q/k norms inside `self_attn`, replicated over head shards.
    projection_qk_norm: the names of q/k norms over the whole projections inside `self_attn`
    (`ProjectionRMSNorm`, OLMo 2/3): their weights are sharded with the projections' columns.
    Blocks whose MLP is not a `SwiGLUMLP` (Qwen3-MoE's sparse blocks) keep it whole on every
    tensor-parallel rank; FSDP2 shards their stacked experts on the expert dimension, or expert
    parallelism (ep > 1) splits them; `num_experts_field` is the config field counting them."""
    args = model.args
    family = family or type(model).__name__
    experts = routed_experts(model) if num_experts_field else []
    num_experts = getattr(args, num_experts_field) if experts else 0
    if dims.ep_enabled:
        if not experts:
            raise ValueError(f"ep={dims.ep} requested but this {family} model has no routed experts")
        require_divisible("ep", dims.ep, family, **{num_experts_field: num_experts})
    dense = [isinstance(block.mlp, SwiGLUMLP) for block in model.layers]
    if dims.tp_enabled:
        sizes = dict(num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads)
        if any(dense):
            sizes["intermediate_size"] = args.intermediate_size
        require_divisible("tp", dims.tp, family, **sizes, vocab_size=args.vocab_size)
    attention = attention_plan(qk_norm=qk_norm)
    for name in projection_qk_norm or ():
        attention[f"self_attn.{name}"] = ShardedParameters({"weight": Shard(0)})
    dense_block = {**attention, **swiglu_plan()}
    return parallelize_decoder(
        model,
        dims,
        config,
        blocks=list(model.layers),
        model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=lambda index, block: dense_block if dense[index] else attention,
        routed_experts=experts,
        num_experts=num_experts,
        context_parallel_heads={"num_attention_heads": args.num_attention_heads},
        context_parallel_kv_heads={"num_key_value_heads": args.num_key_value_heads},
    )
