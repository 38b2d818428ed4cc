"""Long-context benchmark: one LoRA train step on one sequence of T tokens, in one process, with
context parallelism over two ranks, and with activation offload.

    python benchmarks/long_context.py [--lengths 4096 8192 16384 32768] [--families qwen3 qwen3_5]
                                      [--threads 2] [--repeats 5] [--runs single cp2 offload]

Models (random weights, fp32, LoRA r=16 on every linear layer, untied head):
    qwen3    hidden 256, 4 layers, 4 heads and 2 KV heads of 64, MLP 768, vocabulary 4096, full attention
    qwen3_5  the same sizes, 3 gated DeltaNet layers (4 q/k heads and 4 v heads of 64) and 1 gated
             attention layer
Each sequence is a 256-token prompt and a completion; the loss is a token-level policy gradient on
the completion. Per (family, T), each run in fresh processes after a short warm-up step, the three
run alternately (benchmarks/arms.py: after `warmup` rounds, `repeats` rounds of one process each,
the order reversed every other round):
    single   one process on `threads` threads
    cp2      torchrun, 2 ranks of `threads` / 2 threads each, parallel.cp = 2: each rank holds half
             the tokens (Ulysses all-to-all in every token mixer)
    offload  one process whose blocks copy what autograd saves into separate host buffers and back
             (the CPU has no device memory to free, so the copies are forced: what this measures is
             the bookkeeping's cost and how many saved-activation bytes stay with the compute)
Figures per run: the step's peak growth of anonymous resident memory per rank (RssAnon, sampled
every 5 ms, loading excluded: the heap and the tensors, not the file-backed pages that the kernel
evicts under memory pressure; every run has glibc's mmap threshold fixed at 128 KiB, so a freed
activation buffer leaves the RSS), the
step time, tokens/s per rank, and the peak bytes of saved activations resident with the compute
(counted by the offload hooks, in counting-only mode for single and cp2), each the median over the
rounds; the ratios between runs are the medians of the rounds' ratios, with their min and max.
Then per family and
option, the longest T that fits in 8 GB per rank, from the line through the two shortest lengths
(memory grows linearly in T here: attention runs the fused kernel, the head is chunked), and, on
paper, Qwen3.6-27B at 64K tokens with CP 1, 2, 4, 8 from the saved bytes per token measured on
the small Qwen3.5 (large_model_estimate).
After each (family, T), stderr gets each ratio's median with its min-max over the rounds, whether
CP=2's peak per rank is at most 0.55x the one process's in every round, the load averages before
and after, and the CPU model. The last line printed (stdout) is JSON, with the same environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Measure the checkout this script belongs to, whatever an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# benchmarks/ is the script's own folder
from arms import (  # noqa: E402
    MIN_REPEATS,
    Ratio,
    check_repeats,
    describe,
    environment_record,
    goal_verdict,
    load_now,
    median_figures,
    run_arms,
    verdict_line,
)
from train_step import PeakRSS  # noqa: E402

SIZES = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)
QWEN3_5_SIZES = dict(
    SIZES,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
MODEL_TYPES = {"qwen3": ("qwen3", dict(SIZES, use_sliding_window=False)), "qwen3_5": ("qwen3_5_text", QWEN3_5_SIZES)}
PROMPT_TOKENS = 256
WARMUP_TOKENS = 512
LORA_RANK = 16
MEMORY_BUDGET_MB = 8192
MMAP_THRESHOLD = 128 * 1024
"""glibc's malloc threshold for mmap, fixed for every run: left dynamic it rises to the largest
freed block, so freed activation buffers then stay in the heap and count in the peak RSS."""
RUNS = ("single", "cp2", "offload")
CP_PEAK_GOAL = 0.55
"""CP=2 peak RSS growth per rank / one process's, at most (the goal for every length and model)."""
RATIOS = (
    Ratio("cp2_vs_single_peak", "cp2", "single", "peak_mb"),
    Ratio("cp2_vs_single_saved_peak", "cp2", "single", "saved_peak_bytes"),
    Ratio("offload_vs_single_saved_peak", "offload", "single", "saved_peak_bytes"),
    Ratio("offload_vs_single_step_time", "offload", "single", "step_s"),
)

# Qwen3.6-27B's language model (the figures of docs/parallelism.md): 64 layers of hidden 5120, bf16,
# FSDP2 over the 8 devices of a node; fixed per-device terms from that page's table at 8 ranks.
LARGE_LAYERS, LARGE_HIDDEN, LARGE_TOKENS = 64, 5120, 65536
LARGE_FIXED_GB = {"base weights / 8": 6.72, "LoRA state / 8": 0.47, "gathered block": 1.53, "head chunk": 1.02}


@dataclass
class Args:
    lengths: tuple[int, ...] = (4096, 8192, 16384, 32768)
    families: tuple[str, ...] = ("qwen3", "qwen3_5")
    threads: int = 2
    repeats: int = MIN_REPEATS
    """Measured rounds of the alternated runs per (family, T) (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    runs: tuple[str, ...] = RUNS
    """Which runs alternate: single and cp2, and offload unless left out (its step takes as long as single's)."""
    worker: str = ""
    """Internal: run one measurement (single, cp2 or offload) and write its JSON to --out."""
    checkpoint: str = ""
    length: int = 0
    out: str = ""


def _pg_loss(mb, logprobs, ctx):
    return -(logprobs * mb.advantages * mb.loss_mask).sum() / ctx.global_tokens, {}


def _batch(vocab: int, length: int, seed: int):
    import torch

    from archon.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    return PackedBatch.from_sequences(
        [torch.randint(0, vocab, (length,), generator=g)], prompt_lens=[PROMPT_TOKENS], advantages=[1.0]
    )


def worker(args: Args) -> None:
    import torch.distributed as dist

    from archon.lora import LoRAConfig
    from archon.parallel import ParallelConfig, apply_activation_offload
    from archon.trainer import Trainer, TrainerConfig

    cp = 2 if args.worker == "cp2" else 1
    trainer = Trainer(
        TrainerConfig(
            model_path=args.checkpoint,
            lora=LoRAConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK, target_modules="all-linear"),
            parallel=ParallelConfig(cp=cp),
            device="cpu",
            micro_batch_tokens=args.length + 1,
        )
    )
    hooks = apply_activation_offload(trainer.model.layers, offload=args.worker == "offload", offload_host_tensors=True)
    vocab = trainer.model.args.vocab_size
    trainer.train_step(_batch(vocab, WARMUP_TOKENS, seed=1), _pg_loss)
    batch = _batch(vocab, args.length, seed=2)
    hooks.reset_stats()
    with PeakRSS(anonymous=True) as rss:
        start = time.perf_counter()
        metrics = trainer.train_step(batch, _pg_loss)
        step_s = time.perf_counter() - start
    result = {
        "peak_mb": rss.peak_mb - rss.start_mb,
        "step_s": step_s,
        "tokens_per_s_per_rank": args.length / cp / step_s,
        "saved_peak_bytes": hooks.stats.peak_resident_bytes,
        "bytes_offloaded": hooks.stats.bytes_offloaded,
        "loss": metrics["loss"],
    }
    results = [result]
    if dist.is_initialized():
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
    if trainer.rank == 0:
        merged = {
            key: max(r[key] for r in results) for key in ("peak_mb", "step_s", "saved_peak_bytes", "bytes_offloaded")
        }
        merged.update(tokens_per_s_per_rank=min(r["tokens_per_s_per_rank"] for r in results), loss=result["loss"])
        Path(args.out).write_text(json.dumps(merged))
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(run: str, checkpoint: Path, length: int, threads: int, out: Path) -> dict:
    script = str(Path(__file__).resolve())
    common = ["--worker", run, "--checkpoint", str(checkpoint), "--length", str(length), "--out", str(out)]
    if run == "cp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *common]
        per_rank = max(threads // 2, 1)
    else:
        cmd = [sys.executable, script, *common]
        per_rank = threads
    env = {**os.environ, "OMP_NUM_THREADS": str(per_rank), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{run} at T={length} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def longest_fitting(points: dict[int, float], budget_mb: float) -> int | None:
    """T where the line through the two shortest measured lengths reaches the budget (their steps
    take seconds: the kernel's reclaim of cold pages has not yet thinned the RSS of longer ones)."""
    (t1, m1), (t2, m2) = sorted(points.items())[:2]
    slope = (m2 - m1) / (t2 - t1)
    if slope <= 0:
        return None
    return int(t2 + (budget_mb - m2) / slope)


def large_model_estimate(saved_bytes_per_token_layer_width: float) -> dict[str, dict[str, float]]:
    """GB per device for Qwen3.6-27B LoRA at 64K tokens with CP 1, 2, 4, 8 (8 devices, FSDP over all
    of them): the fixed terms of docs/parallelism.md plus activations, from the measured bytes that
    autograd saves per token, per layer and per unit of hidden width (fp32, Qwen3.5's layer mix),
    halved for bf16 and scaled to 64 layers of 5120 for the tokens each rank holds:
        none       every layer's saved activations
        full       activation checkpointing: each layer's bf16 input, plus one layer recomputed
        full+offload   the inputs in host memory too (two layers' worth stay on the device)
    """
    fixed = sum(LARGE_FIXED_GB.values())
    layer = saved_bytes_per_token_layer_width * LARGE_HIDDEN / 2  # bytes per token of one layer, bf16
    block_input = LARGE_HIDDEN * 2
    out = {}
    for cp in (1, 2, 4, 8):
        tokens = LARGE_TOKENS / cp
        out[f"cp{cp}"] = {
            "none": round(fixed + LARGE_LAYERS * layer * tokens / 1e9, 1),
            "full": round(fixed + (LARGE_LAYERS * block_input + layer) * tokens / 1e9, 1),
            "full+offload": round(fixed + (2 * block_input + layer) * tokens / 1e9, 1),
        }
    return out


def derived_figures(runs: dict, comparisons: dict) -> dict:
    """Ratios per length, the longest T in 8 GB per rank and the saved bytes per token, from one
    family's runs ({run: {T: median figures}}) and their comparisons ({T: arms.ArmsResult})."""
    lengths = sorted(runs["single"])
    single, cp2 = runs["single"], runs["cp2"]
    ratios = {}
    for t in lengths:
        ratios[t] = {"cp2_loss_minus_single": cp2[t]["loss"] - single[t]["loss"]}
        for name, summary in comparisons[t].ratios.items():
            ratios[t] |= {name: summary.median, f"{name}_min": summary.min, f"{name}_max": summary.max}
    out = {"runs": runs, "ratios": ratios, "comparisons": {t: c.to_json() for t, c in comparisons.items()}}
    if len(lengths) >= 2:
        out["longest_T_in_8GB"] = {
            run: longest_fitting({t: r["peak_mb"] for t, r in runs[run].items()}, MEMORY_BUDGET_MB)
            for run in ("single", "cp2")
        }
        (t1, r1), (t2, r2) = sorted(single.items())[-2:]
        out["saved_bytes_per_token"] = (r2["saved_peak_bytes"] - r1["saved_peak_bytes"]) / (t2 - t1)
    return out


def _ratios(runs: tuple[str, ...]) -> list[Ratio]:
    unknown = set(runs) - set(RUNS)
    if unknown or not {"single", "cp2"} <= set(runs):
        raise ValueError(f"--runs {' '.join(runs)}: need single and cp2, optionally offload (from {RUNS})")
    return [r for r in RATIOS if r.numerator in runs and r.denominator in runs]


def summary_lines(family: str, length: int, comparison) -> str:
    """Per model and length: each ratio's median with min-max over the rounds, the CP peak goal's
    verdict, the load averages before and after, and the CPU model."""
    env = comparison.environment
    lines = [
        f"{family} T={length}: {env['cpu_model']} ({env['cpu_capability']}), load average "
        f"{env['load_average_before']} before, {env['load_average_after']} after"
    ]
    for name, summary in comparison.ratios.items():
        lines.append("  " + describe(summary))
        if name == "cp2_vs_single_peak":
            lines.append("  " + verdict_line(summary, goal_verdict(summary, CP_PEAK_GOAL)))
    return "\n".join(lines)


def main(args: Args) -> dict:
    from archon.tools.align import make_tiny_hf_checkpoint

    check_repeats(args.repeats, quick=False)
    ratios = _ratios(args.runs)
    load_start = os.getloadavg()[0]
    before = load_now()
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            model_type, sizes = MODEL_TYPES[family]
            checkpoint = make_tiny_hf_checkpoint(model_type, Path(tmp) / family, seed=0, **sizes)
            runs: dict = {run: {} for run in args.runs}
            comparisons = {}
            for length in args.lengths:
                arms = {
                    run: (lambda run=run: _measure(run, checkpoint, length, args.threads, Path(tmp) / "out.json"))
                    for run in args.runs
                }
                print(f"{family} T={length}:", file=sys.stderr, flush=True)
                comparisons[length] = run_arms(
                    arms, ratios, repeats=args.repeats, warmup=args.warmup, threads=args.threads
                )
                for run in args.runs:
                    runs[run][length] = median_figures(comparisons[length].samples[run])
                print(summary_lines(family, length, comparisons[length]), file=sys.stderr, flush=True)
            figures[family] = derived_figures(runs, comparisons)
            if family == "qwen3_5" and len(args.lengths) >= 2:
                figures["qwen3_6_27b_64k_gb_per_device"] = large_model_estimate(
                    figures[family]["saved_bytes_per_token"] / (sizes["hidden_size"] * sizes["num_hidden_layers"])
                )
    return {
        "config": {
            "sizes": SIZES,
            "qwen3_5_sizes": QWEN3_5_SIZES,
            "lora_rank": LORA_RANK,
            "threads": args.threads,
            "prompt_tokens": PROMPT_TOKENS,
        },
        "figures": figures,
        "load_average": [load_start, os.getloadavg()[0]],
        "repeats": args.repeats,
        "environment": environment_record(args.threads, before, load_now()),
    }


if __name__ == "__main__":
    import tyro

    cli = tyro.cli(Args)
    if cli.worker:
        worker(cli)
    else:
        print(json.dumps(main(cli)))
