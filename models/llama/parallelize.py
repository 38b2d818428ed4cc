"""Llama: the dense-decoder TP plan (heads, MLP intermediate, vocabulary), then AC / compile / FSDP2."""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.llama.model import LlamaModel
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_llama(model: LlamaModel, dims: ParallelDims, config: ParallelConfig) -> LlamaModel:
    return parallelize_dense_decoder(model, dims, config)
