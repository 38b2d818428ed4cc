"""Qwen2: the dense-decoder TP plan (heads, MLP intermediate, vocabulary), then AC / compile / FSDP2."""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.qwen2.model import Qwen2Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_qwen2(model: Qwen2Model, dims: ParallelDims, config: ParallelConfig) -> Qwen2Model:
    return parallelize_dense_decoder(model, dims, config)
