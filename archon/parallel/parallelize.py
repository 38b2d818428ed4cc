"""The generic parallelize pipeline a model family calls from its own `parallelize.py`.

Order: tensor parallelism, then activation checkpointing and offload, then torch.compile, then FSDP2 per block
and at the root. Every step keeps parameter names unchanged, so HF loading, LoRA export and
checkpoints see the same names with or without parallelism.

A family's `models/<family>/parallelize.py` is usually a dozen lines (see models/qwen3):

    def parallelize_<family>(model, dims, config):
        if dims.tp_enabled:
            require_divisible("tp", dims.tp, "<family>", num_attention_heads=..., num_key_value_heads=...,
                              intermediate_size=..., vocab_size=...)
        model_plan = {"embed_tokens": vocab_parallel_embedding()}
        if model.lm_head is not None:
            model_plan["lm_head"] = vocab_parallel_head()
        def block_plan(index, block):
            plan = attention_plan(qk_norm=("q_norm", "k_norm") or None)
            if <block has a dense MLP>:
                plan.update(swiglu_plan())
            return plan
        return parallelize_decoder(model, dims, config, blocks=list(model.layers),
                                   model_tp_plan=model_plan, block_tp_plan=block_plan)

and `parallelize_fn=parallelize_<family>` in its ModelSpec. Rules for the plan:
- output-sharded linears (q/k/v, gate/up, MLA's q_b/kv_b) take `colwise()`, the linear that
  consumes their sharded output (o_proj, down_proj) takes `rowwise()`; LoRA needs nothing more.
- the attention must read its head count from the tensor (`view(T, -1, head_dim)`), since each
  rank holds heads / tp of them.
- parameters applied per head to head-sharded activations (QK norms over [T, H, D]) take
  `head_sharded_qk_norm()`; per-head vectors used directly in the forward (attention sinks) take
  `ShardedParameters({"sinks": Shard(0)})` (`attention_plan(sinks="sinks")`) and the forward reads
  them through `local_tensor`.
- modules left out (routers, stacked MoE experts, norms on the replicated residual stream) stay
  whole on every tensor-parallel rank; FSDP2 still shards them across data-parallel ranks.

An MoE family also passes its routed-expert modules (`routed_experts`, with their expert count).
With ep > 1 they are split over the expert-parallel ranks (archon/parallel/expert_parallel.py) and
FSDP2 leaves them alone; with ep = 1 FSDP2 shards them on the expert dimension like any parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from archon.parallel.activation_checkpoint import ACMode, apply_activation_checkpointing
from archon.parallel.activation_offload import apply_activation_offload, check_activation_offload
from archon.parallel.context_parallel import require_context_parallel_heads
from archon.parallel.dims import ParallelDims
from archon.parallel.expert_parallel import shard_experts
from archon.parallel.tensor_parallel import apply_tp_plan, require_whole_scale_blocks

DTypeName = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ParallelConfig:
    """How to lay a model out over the ranks and how to run its blocks."""

    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP when dp_shard > 1 too)."""
    dp_shard: int = -1
    """FSDP2 sharding degree; -1 takes what dp_replicate and tp leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree (heads and MLP intermediate sharded, vocabulary-parallel head)."""
    ep: int = 1
    """Expert-parallel degree: routed experts split over this many data-parallel ranks (it must divide
    dp_shard and each MoE family's expert count); tokens reach their experts by all-to-all."""
    cp: int = 1
    """Context-parallel degree: each packed micro-batch is split along its tokens over this many
    ranks (Ulysses: every token mixer trades the token split for a head split by all-to-all), so one
    sequence's activations are spread over them. It must divide each mixer's heads per tensor-parallel
    rank; context-parallel ranks see the same data, like tensor-parallel ones."""
    activation_checkpoint: ACMode = "none"
    """Per-block activation checkpointing: none, full or selective."""
    activation_offload: bool = False
    """Keep the activations each block saves for the backward in pinned host memory between its forward
    and its backward, copied back ahead of use (CUDA: on a side stream, overlapping compute). Frees
    device memory for long sequences at the cost of host copies; with activation checkpointing it
    offloads the saved block inputs. Not on CPU devices, nor with compile."""
    compile: bool = False
    """torch.compile each block."""
    compile_backend: str = "inductor"
    param_dtype: DTypeName | None = None
    """FSDP2 compute dtype for parameters; None keeps each parameter's own dtype."""
    reduce_dtype: DTypeName = "float32"
    """FSDP2 gradient reduce-scatter dtype (a float64 model reduces in float64 whatever this says)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (re-gathered for backward)."""

    def dims(self, world_size: int, device_type: str) -> ParallelDims:
        return ParallelDims(
            world_size=world_size,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            ep=self.ep,
            cp=self.cp,
            device_type=device_type,
        )


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    dims: ParallelDims,
    config: ParallelConfig,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """fully_shard each block, then the root (embedding, final norm, unembedding).

    Stacked MoE expert weights [E, ...] are sharded on dim 0 like any parameter, so they stay
    stacked; `ignored_params` (expert-parallel experts, laid out already) are left as they are.
    Gradients are summed over data-parallel ranks, not averaged: the engine normalises the loss over
    the global batch itself.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    reduce_dtype = DTYPES[config.reduce_dtype]
    if any(p.dtype == torch.float64 for p in model.parameters()):
        reduce_dtype = torch.float64  # an fp32 reduce would round an fp64 run's gradients to fp32
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[config.param_dtype] if config.param_dtype else None, reduce_dtype=reduce_dtype
    )
    mesh = dims.fsdp_mesh
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=config.reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root keeps its parameters gathered after forward (FSDP2's default for the root): the
    # engine reads the unembedding right after the forward for its chunked head.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM reduce-scatter (gloo has no pre-multiplied sum).
            module.set_force_sum_reduction_for_comms(True)


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    *,
    blocks: Sequence[nn.Module],
    model_tp_plan: Mapping[str, ParallelStyle] | None = None,
    block_tp_plan: Callable[[int, nn.Module], Mapping[str, ParallelStyle]] | None = None,
    routed_experts: Sequence[nn.Module] = (),
    num_experts: int = 0,
    context_parallel_heads: Mapping[str, int] | None = None,
    context_parallel_kv_heads: Mapping[str, int] | None = None,
) -> nn.Module:
    """Apply TP -> EP -> activation checkpointing -> activation offload -> compile -> FSDP2 to a
    decoder-only model. With offload, `model.activation_offload` is the ActivationOffload (its stats).

    blocks: the transformer blocks, each becomes one FSDP unit (and one checkpoint/compile unit).
    model_tp_plan: styles for modules outside the blocks, names relative to `model`.
    block_tp_plan(index, block): styles for one block, names relative to the block (MoE and dense
        blocks may differ). Modules left out stay replicated across the tensor-parallel group.
    routed_experts: the MoE layers' routed-expert modules, every parameter stacked over `num_experts`
        on dim 0; split over the expert-parallel ranks when ep > 1. The family checks first that ep
        divides its expert count (`require_divisible`).
    context_parallel_heads / context_parallel_kv_heads: the config fields counting each token mixer's
        heads (query heads, DeltaNet key heads, MLA heads) and key/value heads, which cp > 1 splits
        over the context-parallel ranks (archon/parallel/context_parallel.py); a family that gives
        none has no context parallelism.
    """
    if dims.cp_enabled:
        if not context_parallel_heads:
            raise ValueError(
                f"parallel.cp={dims.cp} requested but {type(model).__name__} has no context-parallel support"
            )
        require_context_parallel_heads(dims, type(model).__name__, context_parallel_heads, context_parallel_kv_heads)
    if dims.ep_enabled and not routed_experts:
        raise ValueError(f"ep={dims.ep} requested but {type(model).__name__} has no routed experts to split")
    if dims.tp_enabled:
        if block_tp_plan is None:
            raise ValueError(f"tp={dims.tp} requested but {type(model).__name__} has no tensor-parallel plan")
        block_plans = [block_tp_plan(index, block) for index, block in enumerate(blocks)]
        name_of = {id(module): name for name, module in model.named_modules()}
        # Before any mesh exists: a quantized base whose scale blocks the plan would split fails here.
        require_whole_scale_blocks(model, model_tp_plan or {}, dims.tp)
        for block, plan in zip(blocks, block_plans):
            require_whole_scale_blocks(block, plan, dims.tp, prefix=f"{name_of[id(block)]}.")
        tp_mesh = dims.tp_mesh
        if model_tp_plan:
            apply_tp_plan(model, tp_mesh, model_tp_plan)
        for block, plan in zip(blocks, block_plans):
            apply_tp_plan(block, tp_mesh, plan)
    expert_params: set[nn.Parameter] = set()
    if dims.ep_enabled:
        # One mesh object for every layer: the gradient norm reduces the shards of each mesh once.
        expert_mesh = dims.expert_mesh
        for experts in routed_experts:
            shard_experts(experts, num_experts, expert_mesh)
            expert_params.update(experts.parameters())
    apply_activation_checkpointing(blocks, config.activation_checkpoint)
    if config.activation_offload:
        check_activation_offload(dims.device_type, config.compile)
        model.activation_offload = apply_activation_offload(blocks)
    if config.compile:
        for block in blocks:
            block.compile(backend=config.compile_backend, fullgraph=False)
    if dims.fsdp_enabled:
        apply_fsdp(model, blocks, dims, config, ignored_params=expert_params or None)
    return model
