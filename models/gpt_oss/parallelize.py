"""GPT-OSS: heads sharded (q/k/v column-parallel with their biases, o row-parallel, the per-head
attention sinks sharded with the q heads), then the shared MoE decoder plan with every MLP whole:
router and routed experts are replicated across tensor-parallel ranks and sharded by FSDP2."""

from __future__ import annotations

from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.gpt_oss.model import GptOssModel
from archon.parallel import ParallelConfig, ParallelDims, attention_plan


def parallelize_gpt_oss(model: GptOssModel, dims: ParallelDims, config: ParallelConfig) -> GptOssModel:
    args = model.args
    return parallelize_moe_decoder(
        model,
        dims,
        config,
        "gpt_oss",
        attention_plan(sinks="sinks"),
        dict(num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads),
        dense_and_shared_experts=False,
        num_experts_field="num_local_experts",
    )
