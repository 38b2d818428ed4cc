"""The TP plan of a decoder whose MLPs come from `group_limited_moe_mlp` (DeepSeek-V3, GLM-4.5),
then the generic activation-checkpointing / compile / FSDP2 pipeline.

TP shards the family's attention (its own plan), the intermediate dimension of the dense MLPs and
of the shared experts, and the vocabulary of the embedding and unembedding. Router and routed
experts stay whole on every tensor-parallel rank; FSDP2 shards the stacked experts on dim 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from archon.parallel import (
    ParallelConfig,
    ParallelDims,
    parallelize_decoder,
    require_divisible,
    swiglu_plan,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from models.common.moe import SharedExpertsMoE


def parallelize_group_limited_moe_decoder(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    family: str,
    attention_plan: Mapping[str, ParallelStyle],
    attention_sizes: Mapping[str, int],
) -> nn.Module:
    """attention_plan: styles for one block's attention (names relative to the block);
    attention_sizes: the config fields that plan shards, which the TP degree must divide."""
    args = model.args
    if dims.tp_enabled:
        sizes = dict(attention_sizes, vocab_size=args.vocab_size, moe_intermediate_size=args.moe_intermediate_size)
        if args.first_k_dense_replace > 0:
            sizes["intermediate_size"] = args.intermediate_size
        require_divisible("tp", dims.tp, family, **sizes)
    model_plan = {"embed_tokens": vocab_parallel_embedding()}
    if model.lm_head is not None:
        model_plan["lm_head"] = vocab_parallel_head()

    def block_plan(index: int, block: nn.Module) -> dict[str, ParallelStyle]:
        is_moe = isinstance(block.mlp, SharedExpertsMoE)
        return {**attention_plan, **swiglu_plan("mlp.shared_experts" if is_moe else "mlp")}

    return parallelize_decoder(
        model, dims, config, blocks=list(model.layers), model_tp_plan=model_plan, block_tp_plan=block_plan
    )
