"""The TP plan of an MoE decoder, then the generic activation-checkpointing / compile / FSDP2 pipeline.

TP shards the family's attention (its own plan) and the vocabulary of the embedding and
unembedding. Router and routed experts stay whole on every tensor-parallel rank; FSDP2 shards the
stacked experts on dim 0, or, with ep > 1, expert parallelism splits them over the ep ranks
(`ParallelDims`). Families whose MLPs come from `group_limited_moe_mlp` (DeepSeek-V3,
GLM-4.5) also have the intermediate dimension of their dense MLPs and shared experts sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from archon.models.common.dense_parallel import vocab_parallel_plan
from archon.models.common.moe import SharedExpertsMoE, routed_experts
from archon.parallel import (
    ParallelConfig,
    ParallelDims,
    parallelize_decoder,
    require_divisible,
    swiglu_plan,
)


def parallelize_moe_decoder(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    family: str,
    attention_plan: Mapping[str, ParallelStyle] | Callable[[nn.Module], Mapping[str, ParallelStyle]],
    attention_sizes: Mapping[str, int],
    dense_and_shared_experts: bool = True,
    num_experts_field: str = "n_routed_experts",
) -> nn.Module:
    """attention_plan: styles for one block's attention (names relative to the block), or a function
        of the block that returns them (a hybrid whose blocks have different token mixers);
    attention_sizes: the config fields that plan shards, which the TP degree must divide (and the
        attention's head counts, which context parallelism splits);
    dense_and_shared_experts: the model has leading dense MLPs (`first_k_dense_replace`) and
        shared experts (`SharedExpertsMoE`, `moe_intermediate_size`), both sharded. False for a
        family whose every MLP is a router plus routed experts (GPT-OSS): TP leaves MLPs whole.
    num_experts_field: the config field that counts the routed experts (named when ep does not
        divide it)."""
    args = model.args
    experts = routed_experts(model)
    num_experts = getattr(args, num_experts_field)
    if dims.ep_enabled:
        require_divisible("ep", dims.ep, family, **{num_experts_field: num_experts})
    if dims.tp_enabled:
        sizes = dict(attention_sizes, vocab_size=args.vocab_size)
        if dense_and_shared_experts:
            sizes["moe_intermediate_size"] = args.moe_intermediate_size
            if any(not args.is_moe_layer(i) for i in range(args.num_hidden_layers)):
                sizes["intermediate_size"] = args.intermediate_size
        require_divisible("tp", dims.tp, family, **sizes)

    def block_plan(index: int, block: nn.Module) -> dict[str, ParallelStyle]:
        mixer = attention_plan(block) if callable(attention_plan) else attention_plan
        if not dense_and_shared_experts:
            return dict(mixer)
        is_moe = isinstance(block.mlp, SharedExpertsMoE)
        return {**mixer, **swiglu_plan("mlp.shared_experts" if is_moe else "mlp")}

    return parallelize_decoder(
        model,
        dims,
        config,
        blocks=list(model.layers),
        model_tp_plan=vocab_parallel_plan(model),
        block_tp_plan=block_plan,
        routed_experts=experts,
        num_experts=num_experts,
        context_parallel_heads={k: n for k, n in attention_sizes.items() if k != "num_key_value_heads"},
        context_parallel_kv_heads={k: n for k, n in attention_sizes.items() if k == "num_key_value_heads"},
    )
