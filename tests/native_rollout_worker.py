"""torchrun worker (not collected by pytest): the native engine under FSDP x2 and TP x2 against one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/native_rollout_worker.py OUT_JSON HF_DIR

FSDP: the ranks generate different prompts (rank 1 fewer, and none at all in a second call), in
a cache table small enough that blocks are refilled, with a stop token, so the ranks need different
numbers of prefills and decode steps and must keep their collectives in step. TP: both ranks
generate the same prompts. Each rank's samples must equal those of the unsharded model generating
the same prompts in one process; rank 0 writes the comparison. Under FSDP the ranks also run a
three-turn episode with kept sessions (each rank its own trajectories, so that the ranks prefill
different numbers of tokens), against the unsharded model prefilling every trajectory in full.
Every model is fp64 and runs inside `fp32_islands_in_fp64`: the layouts are compared in float64.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from worker_exit import exit_when_every_rank_is_done  # the script's folder, tests/, is on sys.path

from archon.build import build_model
from archon.checkpoint.hf import copy_local_into, local_region
from archon.lora import LoRAConfig, lora_parameters
from archon.parallel import ParallelConfig
from archon.precision import fp32_islands_in_fp64
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine

LORA = LoRAConfig(rank=4, alpha=8.0)
PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105], [5, 6, 7], [11, 12]]


def _randomize_lora(model) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(lora_parameters(model).items()):
            full = torch.randn(param.shape, generator=g) * 0.1
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], name)


def _summary(samples) -> list:
    return [(s.prompt_index, s.completion_ids, s.logprobs, s.finish_reason) for s in samples]


def _compare(got, expected) -> dict:
    tokens_equal = len(got) == len(expected) and all(g[:2] == e[:2] and g[3] == e[3] for g, e in zip(got, expected))
    gap = max((abs(a - b) for g, e in zip(got, expected) for a, b in zip(g[2], e[2])), default=0.0)
    return {"tokens_equal": bool(tokens_equal), "logprob_max_abs": gap, "samples": len(got)}


def _episode(engine, prompts, sampling, keep: bool) -> list:
    """Three turns over `prompts`, each trajectory extended by its completion and a few fixed
    environment tokens between turns; every turn's samples."""
    trajectories = [list(p) for p in prompts]
    samples = []
    for turn in range(3):
        sessions = list(range(len(trajectories))) if keep else None
        turn_samples = engine.generate(trajectories, sampling, sessions=sessions)
        samples += turn_samples
        for i, (trajectory, sample) in enumerate(zip(trajectories, turn_samples)):
            trajectory += sample.completion_ids + [(31 * turn + 7 * i + k) % 256 for k in range(3 + 2 * i)]
    return samples


def main(out: str, hf_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = build_model(hf_dir, lora=LORA, dtype=torch.float64).model.eval()
    _randomize_lora(reference)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    # the reference's greedy tokens give a stop token that ends some sequences early
    stop = NativeRolloutEngine(reference).generate(PROMPTS[:1], greedy)[0].completion_ids[2]
    sampling = SamplingParams(max_new_tokens=6, temperature=0, n=2, stop_token_ids=(stop,))
    mine = {"fsdp2": [PROMPTS, PROMPTS[3:]][rank], "tp2": PROMPTS}
    results = {}
    for layout, degrees in {"fsdp2": dict(tp=1, dp_shard=2), "tp2": dict(tp=2, dp_shard=1)}.items():
        config = ParallelConfig(**degrees)
        model = build_model(
            hf_dir, lora=LORA, dtype=torch.float64, parallel=config, dims=config.dims(world, "cpu")
        ).model.eval()
        _randomize_lora(model)
        engine = NativeRolloutEngine(model, max_batch_sequences=4)  # two blocks of 2: refilled
        expected = _summary(NativeRolloutEngine(reference, max_batch_sequences=4).generate(mine[layout], sampling))
        results[layout] = _compare(_summary(engine.generate(mine[layout], sampling)), expected)
        if layout == "fsdp2":  # rank 1 has nothing to generate: it runs idle forwards for rank 0
            prompts = PROMPTS[:2] if rank == 0 else []
            expected = _summary(NativeRolloutEngine(reference).generate(prompts, sampling))
            results["fsdp2_one_rank_idle"] = _compare(_summary(engine.generate(prompts, sampling)), expected)
            one = dataclasses.replace(sampling, n=1)  # a trajectory per prompt
            expected = _summary(
                _episode(NativeRolloutEngine(reference, max_batch_sequences=4), mine[layout], one, keep=False)
            )
            results["fsdp2_sessions"] = _compare(_summary(_episode(engine, mine[layout], one, keep=True)), expected)
            results["fsdp2_sessions"]["reused_tokens"] = engine.stats.reused_tokens
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    exit_when_every_rank_is_done()


if __name__ == "__main__":
    with fp32_islands_in_fp64():
        main(sys.argv[1], sys.argv[2])
