"""MiniMax-M2: heads sharded (q/k/v column-parallel, o row-parallel), q_norm and k_norm sharded with
the projections they normalise and their statistic reduced over the tensor-parallel group, the
vocabulary of the embedding and unembedding sharded; router and routed experts whole on every
tensor-parallel rank (FSDP2 shards the experts on their expert dimension, or expert parallelism
splits them)."""

from __future__ import annotations

from torch.distributed.tensor import Shard

from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.minimax_m2.model import MinimaxM2Model
from archon.parallel import ParallelConfig, ParallelDims, ShardedParameters, attention_plan


def parallelize_minimax_m2(model: MinimaxM2Model, dims: ParallelDims, config: ParallelConfig) -> MinimaxM2Model:
    args = model.args
    # A ProjectionRMSNorm whose weight is sharded reduces its statistic over the weight's mesh.
    plan = {
        **attention_plan(),
        "self_attn.q_norm": ShardedParameters({"weight": Shard(0)}),
        "self_attn.k_norm": ShardedParameters({"weight": Shard(0)}),
    }
    return parallelize_moe_decoder(
        model,
        dims,
        config,
        "minimax_m2",
        plan,
        dict(num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads),
        dense_and_shared_experts=False,
        num_experts_field="num_local_experts",
    )
