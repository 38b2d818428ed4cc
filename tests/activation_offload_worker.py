"""torchrun worker (not collected by pytest): one FSDP2 forward-backward with activation offload
(forced on CPU) and one without, on two gloo ranks (the gathered weights autograd saves stay put),
in float64 inside fp32_islands_in_fp64.

    python -m torch.distributed.run --nproc_per_node 2 tests/activation_offload_worker.py HF_DIR OUT

Rank 0 writes {"plain" | "offloaded": {"loss", "grads" (full LoRA gradients), "tensors_offloaded"}}
with torch.save to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The checkout this file belongs to first (whatever an editable install points at), then tests/.
_TESTS_DIR = sys.path.pop(0)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archon.lora import is_lora_param  # noqa: E402
from archon.parallel import ParallelConfig, apply_activation_offload  # noqa: E402
from archon.precision import fp32_islands_in_fp64  # noqa: E402
from archon.trainer import Trainer  # noqa: E402

sys.path.append(_TESTS_DIR)
import parallel_cases as cases  # noqa: E402
from worker_exit import exit_when_every_rank_is_done  # noqa: E402

MIN_BYTES = 1024  # below the tiny model's hidden states on one rank's sequences


def first_step(path: str, offload: bool) -> dict:
    parallel = ParallelConfig(dp_shard=2)
    trainer = Trainer(cases.engine_config(path, parallel, micro_batch_tokens=10_000, dtype=cases.EQUALITY_DTYPE))
    hooks = None
    if offload:
        hooks = apply_activation_offload(trainer.model.layers, offload_host_tensors=True, min_bytes=MIN_BYTES)
    full = cases.make_batch(trainer.loaded.args.vocab_size)
    batch = full.select(list(range(trainer.dims.dp_rank, full.num_sequences, trainer.dims.dp)))
    cases.set_lora_values(trainer, seed=1)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    result = trainer.forward_backward(batch, cases.loss_fn, with_entropy=True)
    grads = {n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters() if is_lora_param(n)}
    offloaded = torch.tensor(hooks.stats.tensors_offloaded if hooks else 0)
    dist.all_reduce(offloaded, op=dist.ReduceOp.MIN)  # every rank offloaded
    return {"loss": result["loss"], "grads": grads, "tensors_offloaded": int(offloaded)}


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    with fp32_islands_in_fp64():
        results = {"plain": first_step(path, offload=False), "offloaded": first_step(path, offload=True)}
    if dist.get_rank() == 0:
        torch.save(results, out)
    exit_when_every_rank_is_done()


if __name__ == "__main__":
    main()
