"""GLM-4.5: heads sharded (q/k/v column-parallel with their biases, o row-parallel, per-head QK
norms replicated), then the shared MoE decoder plan (dense MLPs and shared experts sharded,
routed experts whole)."""

from __future__ import annotations

from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.glm4_moe.model import Glm4MoeModel
from archon.parallel import ParallelConfig, ParallelDims, attention_plan


def parallelize_glm4_moe(model: Glm4MoeModel, dims: ParallelDims, config: ParallelConfig) -> Glm4MoeModel:
    args = model.args
    return parallelize_moe_decoder(
        model,
        dims,
        config,
        "glm4_moe",
        attention_plan(qk_norm=("q_norm", "k_norm") if args.use_qk_norm else None),
        dict(num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads),
    )
