"""Qwen3 / Qwen3-MoE: tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards attention heads (q/k/v column-parallel, o row-parallel, per-head q/k norms replicated),
the dense MLP's intermediate dimension, and the vocabulary of the embedding and unembedding.
MoE blocks keep router and stacked experts whole on every tensor-parallel rank; FSDP2 shards the
experts on their expert dimension, or expert parallelism (ep > 1) splits them over the ep ranks.
"""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.qwen3.model import Qwen3Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_qwen3(model: Qwen3Model, dims: ParallelDims, config: ParallelConfig) -> Qwen3Model:
    return parallelize_dense_decoder(
        model, dims, config, qk_norm=("q_norm", "k_norm"), family="qwen3", num_experts_field="num_experts"
    )
