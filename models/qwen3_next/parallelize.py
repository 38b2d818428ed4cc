"""Qwen3-Next: the hybrid decoder's tensor-parallel plan (models/common/hybrid.py), with
in_proj_qkvz and in_proj_ba (HF already groups their rows per key head) column-parallel; dense MLPs
and the shared experts of the sparse layers shard their intermediate dimension.
"""

from __future__ import annotations

from archon.models.common.hybrid import parallelize_hybrid_decoder
from archon.models.qwen3_next.model import Qwen3NextModel
from archon.parallel import ParallelConfig, ParallelDims, swiglu_plan


def parallelize_qwen3_next(model: Qwen3NextModel, dims: ParallelDims, config: ParallelConfig) -> Qwen3NextModel:
    args = model.args
    sparse = [args.is_moe_layer(i) for i in range(args.num_hidden_layers)]
    mlp_sizes = {}
    if any(sparse):
        mlp_sizes["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    if not all(sparse):
        mlp_sizes["intermediate_size"] = args.intermediate_size

    def mlp_plan(layer_idx: int):
        return swiglu_plan("mlp.shared_expert") if sparse[layer_idx] else swiglu_plan()

    return parallelize_hybrid_decoder(model, dims, config, "qwen3_next", mlp_plan, mlp_sizes, fused_projections=True)
