"""OLMo 3: the dense-decoder TP plan with QK-norms over the whole projections, then AC / compile / FSDP2.

TP shards attention heads (q/k/v column-parallel, o row-parallel), the MLP's intermediate dimension
and the vocabulary. q_norm and k_norm normalize all H * D columns of q and k, which the
column-parallel projections split over the ranks: their weights are sharded with the columns, and
ProjectionRMSNorm sums the squares over the tensor-parallel group.
"""

from __future__ import annotations

from archon.models.common.dense_parallel import parallelize_dense_decoder
from archon.models.olmo3.model import Olmo3Model
from archon.parallel import ParallelConfig, ParallelDims


def parallelize_olmo3(model: Olmo3Model, dims: ParallelDims, config: ParallelConfig) -> Olmo3Model:
    return parallelize_dense_decoder(model, dims, config, projection_qk_norm=("q_norm", "k_norm"), family="olmo3")
