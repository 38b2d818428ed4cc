"""Parallelism: degrees and mesh, LoRA-aware tensor parallelism, expert parallelism, activation
checkpointing and offload, FSDP2."""

from archon.parallel.activation_checkpoint import (
    AC_MODES,
    apply_activation_checkpointing,
    checkpoint_module,
)
from archon.parallel.activation_offload import (
    OFFLOAD_MIN_BYTES,
    ActivationOffload,
    OffloadStats,
    apply_activation_offload,
)
from archon.parallel.dims import ParallelDims, init_distributed, require_divisible
from archon.parallel.expert_parallel import ExpertParallelGroup, all_to_all, shard_experts
from archon.parallel.grad import clip_grad_norm, grad_norm
from archon.parallel.parallelize import ParallelConfig, apply_fsdp, parallelize_decoder
from archon.parallel.tensor_parallel import (
    ColwiseLoRAParallel,
    ReplicatedParallel,
    RowwiseLoRAParallel,
    ShardedParameters,
    apply_tp_plan,
    attention_plan,
    colwise,
    head_sharded_qk_norm,
    local_tensor,
    reduce_partial_grads,
    require_whole_scale_blocks,
    rowwise,
    swiglu_plan,
    vocab_parallel_embedding,
    vocab_parallel_head,
)

__all__ = [
    "AC_MODES",
    "ActivationOffload",
    "OFFLOAD_MIN_BYTES",
    "OffloadStats",
    "apply_activation_offload",
    "ColwiseLoRAParallel",
    "ExpertParallelGroup",
    "ParallelConfig",
    "ParallelDims",
    "ReplicatedParallel",
    "RowwiseLoRAParallel",
    "ShardedParameters",
    "apply_activation_checkpointing",
    "all_to_all",
    "apply_fsdp",
    "apply_tp_plan",
    "attention_plan",
    "checkpoint_module",
    "clip_grad_norm",
    "colwise",
    "grad_norm",
    "head_sharded_qk_norm",
    "init_distributed",
    "local_tensor",
    "parallelize_decoder",
    "reduce_partial_grads",
    "require_divisible",
    "require_whole_scale_blocks",
    "rowwise",
    "shard_experts",
    "swiglu_plan",
    "vocab_parallel_embedding",
    "vocab_parallel_head",
]
