"""torchrun worker (not collected by pytest): a dense family under TP x2 against one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/dense_parallel_worker.py OUT_JSON HF_DIR...

Every rank runs the same packed batch; rank 0 writes, per checkpoint and layout, the largest
|Δ hidden state| and the largest relative LoRA-gradient error against the unparallelized model.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from archon.checkpoint.hf import copy_local_into, local_region
from archon.engine import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import full_tensor
from archon.parallel import ParallelConfig, reduce_partial_grads
from archon.tools.align import packed_batch

LAYOUTS = {"tp2": dict(tp=2, dp_shard=1)}
SEQ_LENS = (7, 1, 13, 33)


def hidden_and_lora_grads(model, tokens, positions, cu_seqlens):
    """Same non-zero LoRA factors on every layout (each rank copies its shard), then hidden states
    [T, D] and the full LoRA gradients of mean(h^2)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(lora_parameters(model).items()):
            full = torch.randn(param.shape, generator=g) * 0.1
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], name)
    hidden = model(tokens, positions, cu_seqlens, max(SEQ_LENS), return_hidden=True)
    hidden.float().pow(2).mean().backward()
    reduce_partial_grads(model)
    return hidden.detach(), {n: full_tensor(p.grad).clone() for n, p in lora_parameters(model).items()}


def compare_layouts(hf_dir: str, world: int) -> dict:
    lora = LoRAConfig(rank=4, alpha=8.0)
    _, tokens, positions, cu_seqlens = packed_batch(SEQ_LENS, 256, seed=0)
    ref_hidden, ref_grads = hidden_and_lora_grads(build_model(hf_dir, lora=lora).model, tokens, positions, cu_seqlens)
    results = {}
    for layout, degrees in LAYOUTS.items():
        config = ParallelConfig(**degrees)
        model = build_model(hf_dir, lora=lora, parallel=config, dims=config.dims(world, "cpu")).model
        hidden, grads = hidden_and_lora_grads(model, tokens, positions, cu_seqlens)
        # FSDP2 (dp_shard > 1) sums gradients over data-parallel ranks, and every rank ran the same batch.
        scale = degrees["dp_shard"]
        results[layout] = {
            "hidden_max_abs": (hidden - ref_hidden).abs().max().item(),
            "grad_max_rel": max(
                ((grads[n] / scale - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                for n, ref in ref_grads.items()
            ),
        }
    return results


def main(out: str, hf_dirs: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {hf_dir: compare_layouts(hf_dir, dist.get_world_size()) for hf_dir in hf_dirs}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
