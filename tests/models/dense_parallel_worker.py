"""torchrun worker (not collected by pytest): a family under TP x2 (and FSDP x2) against one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/dense_parallel_worker.py OUT_JSON \
        HF_DIR[@LAYOUT,LAYOUT...]...

Layouts are the keys of LAYOUTS; a checkpoint without `@` runs under tp2 only. Every rank runs the
same packed batch; rank 0 writes, per checkpoint and layout, the largest |Δ hidden state|, the
largest |Δ label log-prob| (the unembedding, vocab-sharded under TP) and the largest relative
LoRA-gradient error against the unparallelized model. Both sides run in float64 inside
fp32_islands_in_fp64, so the figures are float64 rounding (~1e-15) on any CPU's arithmetic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from archon.build import build_model
from archon.checkpoint.hf import copy_local_into, local_region
from archon.head import label_logprobs
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import full_tensor
from archon.parallel import ParallelConfig, reduce_partial_grads
from archon.precision import fp32_islands_in_fp64
from archon.tools.align import packed_batch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/
from worker_exit import exit_when_every_rank_is_done  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2, dp_shard=1), "fsdp2": dict(tp=1, dp_shard=2)}
DEFAULT_LAYOUTS = ("tp2",)
SEQ_LENS = (7, 1, 13, 33)


def hidden_logprobs_and_lora_grads(model, tokens, positions, cu_seqlens):
    """Same non-zero LoRA factors on every layout (each rank copies its shard), then hidden states
    [T, D], the log-probs of the next packed token, and the full LoRA gradients of mean(h^2)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(lora_parameters(model).items()):
            full = torch.randn(param.shape, generator=g, dtype=param.dtype) * 0.1
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], name)
    hidden = model(tokens, positions, cu_seqlens, max(SEQ_LENS), return_hidden=True)
    # Before backward: FSDP2 keeps the root's unembedding gathered only until then.
    with torch.no_grad():
        logprobs, _ = label_logprobs(hidden.detach(), model.output_weight, tokens.roll(-1))
    hidden.float().pow(2).mean().backward()
    reduce_partial_grads(model)
    grads = {n: full_tensor(p.grad).clone() for n, p in lora_parameters(model).items()}
    return hidden.detach(), logprobs, grads


def compare_layouts(hf_dir: str, layouts: list[str], world: int) -> dict:
    lora = LoRAConfig(rank=4, alpha=8.0)
    _, tokens, positions, cu_seqlens = packed_batch(SEQ_LENS, 256, seed=0)
    reference = build_model(hf_dir, lora=lora, dtype=torch.float64).model
    ref_hidden, ref_logprobs, ref_grads = hidden_logprobs_and_lora_grads(reference, tokens, positions, cu_seqlens)
    results = {}
    for layout in layouts:
        degrees = LAYOUTS[layout]
        config = ParallelConfig(**degrees)
        model = build_model(
            hf_dir, lora=lora, dtype=torch.float64, parallel=config, dims=config.dims(world, "cpu")
        ).model
        hidden, logprobs, grads = hidden_logprobs_and_lora_grads(model, tokens, positions, cu_seqlens)
        # FSDP2 (dp_shard > 1) sums gradients over data-parallel ranks, and every rank ran the same batch.
        scale = degrees["dp_shard"]
        results[layout] = {
            "hidden_max_abs": (hidden - ref_hidden).abs().max().item(),
            "logprob_max_abs": (logprobs - ref_logprobs).abs().max().item(),
            "grad_max_rel": max(
                ((grads[n] / scale - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                for n, ref in ref_grads.items()
            ),
        }
    return results


def main(out: str, checkpoints: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for checkpoint in checkpoints:
        hf_dir, _, layouts = checkpoint.partition("@")
        with fp32_islands_in_fp64():
            results[hf_dir] = compare_layouts(
                hf_dir, layouts.split(",") if layouts else list(DEFAULT_LAYOUTS), dist.get_world_size()
            )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    exit_when_every_rank_is_done()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
