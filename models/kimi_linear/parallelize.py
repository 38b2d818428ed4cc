"""Kimi Linear: tensor-parallel plan, then the shared MoE decoder pipeline (dense MLPs and shared
experts sharded, routed experts whole; FSDP2 shards the experts on their expert dimension).

TP shards heads. MLA layers take `models/common/mla.py`'s `mla_plan`. KDA layers by head: q_proj,
k_proj, v_proj, b_proj, g_b_proj and the forget gate's f_b_proj are column-parallel (their rows are
head-major), the three convs' channels, dt_bias and A_log are sharded with them, the gated norm runs
on the local heads, and o_proj is row-parallel. The low-rank f_a_proj and g_a_proj feed every head
and stay replicated.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from archon.models.common.mla import mla_plan
from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.kimi_linear.args import LINEAR_ATTENTION
from archon.models.kimi_linear.model import KimiLinearModel
from archon.parallel import ParallelConfig, ParallelDims, colwise, rowwise
from archon.parallel.tensor_parallel import ReplicatedParallel, ShardedParameters


def kimi_delta_attention_plan(prefix: str = "self_attn") -> dict[str, ParallelStyle]:
    plan = {
        f"{prefix}.{name}": colwise()
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_b_proj", "forget_gate.f_b_proj")
    }
    plan[f"{prefix}.o_proj"] = rowwise()
    plan[f"{prefix}.o_norm"] = ReplicatedParallel(Shard(1))  # on [T, heads, d]
    per_head = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "forget_gate.dt_bias")
    plan[prefix] = ShardedParameters(
        {**{name: Shard(0) for name in per_head}, "forget_gate.A_log": Shard(2)}
    )  # [1, 1, H, 1]
    return plan


def parallelize_kimi_linear(model: KimiLinearModel, dims: ParallelDims, config: ParallelConfig) -> KimiLinearModel:
    args = model.args
    if dims.cp_enabled:
        raise ValueError(
            f"parallel.cp={dims.cp}: kimi_linear has no context parallelism (its Kimi Delta Attention layers "
            "do not split their tokens over ranks)"
        )
    attention, kda = mla_plan(args), kimi_delta_attention_plan()

    def mixer_plan(block) -> dict[str, ParallelStyle]:
        return kda if block.layer_type == LINEAR_ATTENTION else attention

    return parallelize_moe_decoder(
        model,
        dims,
        config,
        "kimi_linear",
        mixer_plan,
        dict(num_attention_heads=args.num_attention_heads, linear_num_heads=args.linear_num_heads),
        num_experts_field="n_routed_experts",
    )
