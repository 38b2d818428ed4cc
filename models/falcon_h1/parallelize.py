"""Falcon-H1: tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards the attention heads (q/k/v column-parallel, o row-parallel, with their biases), the SwiGLU
MLP's intermediate dimension and the vocabulary. The Mamba2 mixers stay whole on every tensor-parallel
rank: in_proj's rows interleave z, x, B, C and dt, so a contiguous shard would split them. No context
parallelism: the Mamba2 scan runs over every token of a sequence.
"""

from __future__ import annotations

from archon.models.common.dense_parallel import vocab_parallel_plan
from archon.models.falcon_h1.model import FalconH1Model
from archon.parallel import ParallelConfig, ParallelDims, attention_plan, parallelize_decoder, swiglu_plan
from archon.parallel.dims import require_divisible


def parallelize_falcon_h1(model: FalconH1Model, dims: ParallelDims, config: ParallelConfig) -> FalconH1Model:
    args = model.args
    if dims.cp_enabled:
        raise ValueError(
            f"parallel.cp={dims.cp}: falcon_h1 has no context parallelism (its Mamba2 mixers scan every token "
            "of a sequence on one rank)"
        )
    if dims.tp_enabled:
        require_divisible(
            "tp",
            dims.tp,
            "falcon_h1",
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
        )
    plan = {**attention_plan(), **swiglu_plan("feed_forward")}
    return parallelize_decoder(
        model,
        dims,
        config,
        blocks=list(model.layers),
        model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=lambda index, block: plan,
    )
