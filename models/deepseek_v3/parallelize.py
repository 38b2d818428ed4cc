"""DeepSeek-V3: MLA heads sharded, then the shared MoE decoder plan (dense MLPs and shared
experts sharded, routed experts whole).

The attention plan is `models/common/mla.py`'s `mla_plan`.
"""

from __future__ import annotations

from archon.models.common.mla import mla_plan
from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.deepseek_v3.model import DeepseekV3Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_deepseek_v3(model: DeepseekV3Model, dims: ParallelDims, config: ParallelConfig) -> DeepseekV3Model:
    args = model.args
    return parallelize_moe_decoder(
        model, dims, config, "deepseek_v3", mla_plan(args), dict(num_attention_heads=args.num_attention_heads)
    )
