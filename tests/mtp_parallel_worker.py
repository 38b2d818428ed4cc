"""torchrun worker (not collected by pytest): MTP training under a parallel layout.

    python -m torch.distributed.run --nproc_per_node N tests/mtp_parallel_worker.py HF_DIR TP[,TP...] OUT_JSON

Trains the MTP layer of HF_DIR (LoRA, `mtp_loss_weight` 1, no policy loss) for three steps on fixed
samples with parallel.tp=TP (the other ranks shard the parameters with FSDP), in float64 inside
fp32_islands_in_fp64, once for each TP listed (one after the other in the same processes); rank 0
writes {TP: each step's mtp_loss and mtp_accuracy} to OUT_JSON, to be compared with one process's
(`mtp_training_steps` with tp=1, run in the test's process).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from archon.batch import PackedBatch
from archon.lora import LoRAConfig
from archon.optim import OptimConfig
from archon.parallel import ParallelConfig
from archon.precision import fp32_islands_in_fp64
from archon.trainer import Trainer, TrainerConfig


def mtp_training_steps(model_dir: str, tp: int) -> list[dict]:
    """mtp_loss and mtp_accuracy of each of the three steps, trained in float64 (call it inside
    fp32_islands_in_fp64)."""
    trainer = Trainer(
        TrainerConfig(
            model_path=str(model_dir),
            lora=LoRAConfig(rank=4, alpha=8),
            device="cpu",
            optim=OptimConfig(lr=3e-2),
            parallel=ParallelConfig(tp=tp),
            mtp=True,
            mtp_loss_weight=1.0,
            dtype="float64",
        )
    )
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 9)]
    batch = PackedBatch.from_sequences(sequences, prompt_lens=[3, 3], advantages=[0.0, 0.0])
    steps = [trainer.train_step(batch, lambda mb, lp, ctx: ((lp * 0.0).sum(), {})) for _ in range(3)]
    return [{k: m[k] for k in ("mtp_loss", "mtp_accuracy")} for m in steps]


def main(model_dir: str, tps: list[int], out_path: str) -> None:
    steps = {}
    for tp in tps:
        with fp32_islands_in_fp64():
            steps[str(tp)] = mtp_training_steps(model_dir, tp)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(steps, f)


if __name__ == "__main__":
    main(sys.argv[1], [int(tp) for tp in sys.argv[2].split(",")], sys.argv[3])
