"""Gemma 3: the dense decoder's tensor-parallel plan, then the generic AC / compile / FSDP2 pipeline.

TP shards attention heads (q/k/v column-parallel, o row-parallel, the per-head q/k norms replicated),
the GeGLU MLP's intermediate dimension, and the vocabulary of the embedding and unembedding. The
sandwich norms act on whole hidden states and stay replicated.
"""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.gemma3.model import Gemma3Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_gemma3(model: Gemma3Model, dims: ParallelDims, config: ParallelConfig) -> Gemma3Model:
    return parallelize_dense_decoder(model, dims, config, qk_norm=("q_norm", "k_norm"), family="gemma3")
