"""Qwen3.5: the hybrid decoder's tensor-parallel plan (models/common/hybrid.py), with in_proj_qkv
(rows grouped per key head), in_proj_z, in_proj_b and in_proj_a column-parallel; dense MLPs and the
MoE shared expert shard their intermediate dimension.
"""

from __future__ import annotations

from archon.models.common.hybrid import parallelize_hybrid_decoder
from archon.models.qwen3_5.model import Qwen3_5Model
from archon.parallel import ParallelConfig, ParallelDims, swiglu_plan


def parallelize_qwen3_5(model: Qwen3_5Model, dims: ParallelDims, config: ParallelConfig) -> Qwen3_5Model:
    args = model.args
    if args.num_experts > 0:
        mlp = swiglu_plan("mlp.shared_expert")
        mlp_sizes = {"shared_expert_intermediate_size": args.shared_expert_intermediate_size}
    else:
        mlp, mlp_sizes = swiglu_plan(), {"intermediate_size": args.intermediate_size}
    return parallelize_hybrid_decoder(model, dims, config, "qwen3_5", lambda layer_idx: mlp, mlp_sizes)
