"""torchrun worker (not collected by pytest): the dense families' worker (dense_parallel_worker.py) with
an expert-parallel layout too, for Nemotron-H's MoE blocks.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/nemotron_h_parallel_worker.py OUT_JSON \
        HF_DIR@tp2,fsdp2,ep2

ep2: the routed experts split over the 2 ranks (ep=2 inside dp_shard=2; the rest FSDP2-sharded).
"""

from __future__ import annotations

import sys

import dense_parallel_worker as worker

worker.LAYOUTS["ep2"] = dict(tp=1, dp_shard=2, ep=2)

if __name__ == "__main__":
    worker.main(sys.argv[1], sys.argv[2:])
