"""The trainer's configuration, and the PackedBatch.extras keys it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from archon.head import DEFAULT_CHUNK_SIZE
from archon.load_balance import MoEConfig
from archon.lora import LoRAConfig
from archon.optim import OptimConfig
from archon.parallel import ParallelConfig
from archon.parallel.parallelize import DTypeName

SINGLE_ADAPTER = ""
"""The name of a single-adapter trainer's adapter (Trainer.adapters)."""


@dataclass
class TrainerTask:
    """One adapter of a multi-task trainer."""

    name: str
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


ROUTED_EXPERTS_EXTRA = "routed_experts"
"""PackedBatch.extras key of the expert ids to replay: [T, L_moe, k] (int16; -1 rows: the router's
own choice). A batch that carries it is scored and trained with every MoE router taking these ids
instead of its own top-k (archon.routing_replay.replayed_routing)."""

TASK_EXTRA = "task"
"""PackedBatch.extras key of a multi-task batch: [T] long, each token's task index (TrainerConfig.tasks order)."""


@dataclass
class TrainerConfig:
    model_path: str
    """HF checkpoint directory (config.json + safetensors)."""
    lora: LoRAConfig | None = field(default_factory=LoRAConfig)
    """The adapter to train; None trains every parameter (full fine-tuning)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dtype: DTypeName = "float32"
    """Base-weight dtype. LoRA factors are fp32, or fp64 under a float64 base (the arithmetic equality
    tests compare in, with archon.precision.fp32_islands_in_fp64). Use float32 on CPU."""
    quantized_base: Literal["keep", "dequantize"] = "keep"
    """For an FP8 or MXFP4 checkpoint: keep its weights quantized and frozen, dequantized per GEMM
    (keep), or dequantize them into `dtype` as they load (dequantize)."""
    device: str = "auto"
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward; whole sequences are packed up to it."""
    head_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Rows of logits computed at a time by the log-prob head."""
    seed: int = 0
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE load balancing (auxiliary loss, correction-bias updates); MoE models only."""
    tasks: tuple[TrainerTask, ...] = ()
    """Several adapters on the one base (multi-LoRA), each with its own LoRA config and optimizer;
    `lora` and `optim` are then unused and must be left None / default. Empty: one adapter."""
    mtp: bool = False
    """Build and load the checkpoint's multi-token-prediction layers (model.mtp; see docs/mtp.md)."""
    mtp_loss_weight: float = 0.0
    """> 0: train the MTP layer beside the loss function, with this weight on its cross-entropy of
    token t+2 from the hidden state at t and token t+1, at the loss-mask positions (`mtp_step_loss`);
    its blocks get the model's LoRA (full fine-tuning: all its weights train). Needs `mtp`."""
