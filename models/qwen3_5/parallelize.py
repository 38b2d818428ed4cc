"""Qwen3.5: tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards heads. Gated attention as any GQA attention (q_proj's rows are per head, query then
gate, so a head's gate stays with it). Gated DeltaNet by key head, with the value heads each key
head serves: in_proj_qkv (rows grouped per key head), in_proj_z, in_proj_b and in_proj_a are
column-parallel, the conv channels, dt_bias and A_log are sharded with them, the gated norm runs
on the local heads, and out_proj is row-parallel. Dense MLPs and the MoE shared expert shard their
intermediate dimension; the router, the routed experts and the shared-expert gate stay whole on
every tensor-parallel rank (FSDP2 shards the experts on their expert dimension).
"""

from __future__ import annotations

from archon.models.common.args import LINEAR_ATTENTION
from archon.models.common.dense_parallel import vocab_parallel_plan
from archon.models.common.linear_attention import gated_deltanet_plan
from archon.models.common.moe import routed_experts
from archon.models.qwen3_5.model import Qwen3_5Model
from torch.distributed.tensor.parallel import ParallelStyle

from archon.parallel import (
    ParallelConfig,
    ParallelDims,
    attention_plan,
    parallelize_decoder,
    require_divisible,
    swiglu_plan,
)


def parallelize_qwen3_5(model: Qwen3_5Model, dims: ParallelDims, config: ParallelConfig) -> Qwen3_5Model:
    args = model.args
    moe = args.num_experts > 0
    if dims.tp_enabled:
        mlp_size = {"shared_expert_intermediate_size": args.shared_expert_intermediate_size} if moe else {
            "intermediate_size": args.intermediate_size
        }
        require_divisible(
            "tp", dims.tp, "qwen3_5", num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads, linear_num_key_heads=args.linear_num_key_heads,
            vocab_size=args.vocab_size, **mlp_size,
        )
    if dims.ep_enabled:
        if not moe:
            raise ValueError(f"ep={dims.ep} requested but this qwen3_5 model has no routed experts")
        require_divisible("ep", dims.ep, "qwen3_5", num_experts=args.num_experts)
    attention = attention_plan(qk_norm=("q_norm", "k_norm"))
    deltanet = gated_deltanet_plan()
    mlp = swiglu_plan("mlp.shared_expert") if moe else swiglu_plan()

    def block_plan(index, block) -> dict[str, ParallelStyle]:
        mixer = deltanet if block.layer_type == LINEAR_ATTENTION else attention
        return {**mixer, **mlp}

    return parallelize_decoder(
        model, dims, config, blocks=list(model.layers), model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=block_plan, routed_experts=routed_experts(model), num_experts=args.num_experts,
        context_parallel_heads=dict(num_attention_heads=args.num_attention_heads,
                                    linear_num_key_heads=args.linear_num_key_heads),
        context_parallel_kv_heads=dict(num_key_value_heads=args.num_key_value_heads),
    )
