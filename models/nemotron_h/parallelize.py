"""Nemotron-H: tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards the attention heads (q/k/v column-parallel, o row-parallel; no biases), the intermediate
dimension of the MLP blocks and of the MoE blocks' shared MLP (up_proj column-parallel, down_proj
row-parallel) and the vocabulary. The Mamba2 mixers stay whole on every tensor-parallel rank: in_proj's
rows interleave z, x, B, C and dt, so a contiguous shard would split them. An MoE block's router,
latent projections and routed experts stay whole under TP; FSDP2 shards the stacked experts on dim 0,
or, with ep > 1, expert parallelism splits them over the ep ranks. No context parallelism: the Mamba2
scan runs over every token of a sequence.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from archon.models.common.dense_parallel import vocab_parallel_plan
from archon.models.common.moe import routed_experts
from archon.models.nemotron_h.args import ATTENTION, MLP, MOE
from archon.models.nemotron_h.model import NemotronHModel
from archon.parallel import ParallelConfig, ParallelDims, attention_plan, colwise, parallelize_decoder, rowwise
from archon.parallel.dims import require_divisible


def parallelize_nemotron_h(model: NemotronHModel, dims: ParallelDims, config: ParallelConfig) -> NemotronHModel:
    args = model.args
    if dims.cp_enabled:
        raise ValueError(
            f"parallel.cp={dims.cp}: nemotron_h has no context parallelism (its Mamba2 mixers scan every token "
            "of a sequence on one rank)"
        )
    kinds = set(args.layers_block_type)
    if dims.ep_enabled:
        require_divisible("ep", dims.ep, "nemotron_h", n_routed_experts=args.num_experts)
    if dims.tp_enabled:
        sizes = {}
        if ATTENTION in kinds:
            sizes.update(num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads)
        if MLP in kinds:
            sizes.update(intermediate_size=args.intermediate_size)
        if MOE in kinds:
            sizes.update(moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size)
        require_divisible("tp", dims.tp, "nemotron_h", **sizes, vocab_size=args.vocab_size)
    attention = attention_plan(prefix="mixer")
    mlp = {"mixer.up_proj": colwise(), "mixer.down_proj": rowwise()}
    shared_mlp = {"mixer.shared_experts.up_proj": colwise(), "mixer.shared_experts.down_proj": rowwise()}

    def block_plan(index: int, block) -> dict[str, ParallelStyle]:
        return {ATTENTION: attention, MLP: mlp, MOE: shared_mlp}.get(block.layer_type, {})

    return parallelize_decoder(
        model,
        dims,
        config,
        blocks=list(model.layers),
        model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=block_plan,
        routed_experts=routed_experts(model),
        num_experts=args.num_experts,
    )
