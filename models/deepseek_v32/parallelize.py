"""DeepSeek-V3.2 / GLM-5: MLA heads sharded (`models/common/mla.py`'s `mla_plan`), then the shared
MoE decoder plan (dense MLPs and shared experts sharded, routed experts whole).

The indexer stays replicated: its heads are summed into one score per key before the top-k, so
sharding them would need an all-reduce of the scores; it is small (index_n_heads x index_head_dim)
and gets no gradient, so every rank computes the whole selection for its own attention heads.
"""

from __future__ import annotations

from archon.models.common.mla import mla_plan
from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.deepseek_v32.model import DeepseekV32Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_deepseek_v32(model: DeepseekV32Model, dims: ParallelDims, config: ParallelConfig) -> DeepseekV32Model:
    args = model.args
    if dims.cp > 1:
        raise ValueError(
            f"deepseek_v32: context parallelism (cp={dims.cp}) is not implemented for DeepSeek sparse attention "
            "(each query's top-k selection reads every earlier key of its sequence)"
        )
    return parallelize_moe_decoder(
        model, dims, config, "deepseek_v32", mla_plan(args), dict(num_attention_heads=args.num_attention_heads)
    )
