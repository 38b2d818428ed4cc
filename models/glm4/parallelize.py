"""GLM-4: attention heads and the vocabulary sharded (the dense-decoder TP plan); the MLP, whose
gate_up_proj fuses gate and up rows, is kept whole on every tensor-parallel rank (a contiguous
column shard would give one rank the gate rows and the other the up rows). Then AC / compile / FSDP2."""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.glm4.model import Glm4Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_glm4(model: Glm4Model, dims: ParallelDims, config: ParallelConfig) -> Glm4Model:
    return parallelize_dense_decoder(model, dims, config)
