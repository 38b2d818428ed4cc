"""MoE training-step benchmark: archon MoE LoRA (grouped-GEMM experts) vs HF transformers + PEFT.

    python benchmarks/moe_train_step.py [--steps 3] [--threads 2] [--repeats 5]

Both train the same random-weight Qwen3-MoE (hidden 512, 6 layers, 8 heads, 4 KV heads, 32 experts,
top-4, expert width 384, vocab 32000, fp32) with LoRA r=16 on attention (q/k/v/o) and on the routed
experts (gate_up_proj, down_proj), on the RL-shaped batch of benchmarks/train_step.py (16 sequences
of 64-256 tokens, a 32-token prompt each, token-level policy-gradient loss on the completions).
archon packs the batch; HF pads it. HF runs its best experts implementation on this machine
(`grouped_mm`) and PEFT adapts the experts through `target_parameters`.

Each measurement runs in its own process (one warm-up, then `steps` timed steps):
    archon_grouped   archon, experts as grouped GEMMs (base and LoRA factors)
    archon_loop      archon, the reference loop over experts (one matmul per expert and factor)
    hf_peft          HF + PEFT
    experts_layer    one expert layer alone, forward + backward on the batch's routed slots,
                     grouped against loop (in one process, one run of each a round, alternated)
The three train-step processes run alternately (benchmarks/arms.py): after `warmup` rounds,
`repeats` rounds of one process each, the order reversed every other round. Each ratio is the
median of the rounds' ratios, reported with their min and max; a verdict is printed only when the
rounds agree (arms.SPREAD_BOUND). Peak RSS is sampled during the train steps (loading excluded).
The CPU, its instruction set, the threads and the load averages before and after are reported:
on a shared machine other work perturbs the timings. The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of train_step.py

import train_step  # noqa: E402
from arms import (  # noqa: E402
    Ratio,
    RatioSummary,
    check_repeats,
    describe,
    median_figures,
    run_arms,
    speed_verdict,
    verdict_line,
)
from train_step import BenchArgs, make_checkpoint, make_sequences, run_archon, run_hf_peft  # noqa: E402

MOE_CONFIG = dict(
    vocab_size=train_step.MODEL_CONFIG["vocab_size"],  # make_sequences draws tokens from it
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=384,
    intermediate_size=1536,  # unused: every layer is an MoE layer
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _set_grouped(grouped: bool):
    def prepare(model) -> None:
        from archon.models.common.moe import GroupedExperts

        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert len(experts) == MOE_CONFIG["num_hidden_layers"]
        for module in experts:
            module.grouped_mm = grouped

    return prepare


def run_experts_layer(args: BenchArgs) -> dict:
    """Forward + backward of layer 0's experts (with LoRA) on the slots the batch routes to them."""
    import torch

    from archon.build import build_model
    from archon.lora import LoRAConfig

    torch.set_num_threads(args.threads)
    lora = LoRAConfig(rank=train_step.LORA_RANK, alpha=train_step.LORA_ALPHA, target_modules=(*ATTENTION, "experts"))
    model = build_model(args.checkpoint, lora=lora).model
    moe = model.layers[0].mlp
    tokens = sum(len(s) for s in make_sequences(args.seed)[0])
    x = torch.randn(tokens, MOE_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        top_weights, top_indices = moe.gate(x)

    def step(grouped: bool):
        def measure() -> float:
            moe.experts.grouped_mm = grouped
            x_in = x.detach().requires_grad_()
            start = time.perf_counter()
            moe.experts(x_in, top_weights, top_indices).pow(2).mean().backward()
            return time.perf_counter() - start

        return measure

    result = run_arms(
        {"grouped": step(True), "loop": step(False)},
        [Ratio("grouped_over_loop", "loop", "grouped")],
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        progress=False,
    )
    return {
        "tokens": tokens,
        "grouped_s": result.median("grouped"),
        "loop_s": result.median("loop"),
        "comparison": result.to_json(),
    }


def run_hf(args: BenchArgs) -> dict:
    return run_hf_peft(
        args,
        model_kwargs=dict(experts_implementation="grouped_mm"),
        lora_kwargs=dict(target_modules=list(ATTENTION), target_parameters=EXPERT_PARAMETERS),
    )


ROLES = {
    "archon_grouped": lambda a: run_archon(
        a, lora=True, timed=True, lora_targets=(*ATTENTION, "experts"), prepare=_set_grouped(True)
    ),
    "archon_loop": lambda a: run_archon(
        a, lora=True, timed=True, profile=False, lora_targets=(*ATTENTION, "experts"), prepare=_set_grouped(False)
    ),
    "hf_peft": run_hf,
    "experts_layer": run_experts_layer,
}


STEP_ROLES = ("archon_grouped", "archon_loop", "hf_peft")


def main(args: BenchArgs) -> dict:
    check_repeats(args.repeats, quick=False)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = str(make_checkpoint(Path(tmp) / "qwen3-moe", args.seed, MOE_CONFIG, "qwen3_moe"))
        comparison = run_arms(
            {role: (lambda role=role: train_step._measure(role, args, script=__file__)) for role in STEP_ROLES},
            [
                Ratio("archon_over_hf_peft_tok_s", "archon_grouped", "hf_peft", "tok_s"),
                Ratio("grouped_over_loop_step", "archon_grouped", "archon_loop", "tok_s"),
            ],
            repeats=args.repeats,
            warmup=args.warmup,
            threads=args.threads,
        )
        results = {role: median_figures(comparison.samples[role]) for role in STEP_ROLES}
        results["experts_layer"] = train_step._measure("experts_layer", args, script=__file__)
    archon, loop, hf, layer = (results[r] for r in ("archon_grouped", "archon_loop", "hf_peft", "experts_layer"))
    if archon["trainable_params"] != hf["trainable_params"]:
        raise RuntimeError(f"archon trains {archon['trainable_params']} parameters, HF+PEFT {hf['trainable_params']}")
    speed, grouped_step = comparison.ratios["archon_over_hf_peft_tok_s"], comparison.ratios["grouped_over_loop_step"]
    grouped_layer = RatioSummary.from_json("grouped_over_loop", layer["comparison"]["ratios"]["grouped_over_loop"])
    for summary, label, above, below in (
        (speed, "real tokens/s, archon MoE LoRA / HF+PEFT", "archon is faster", "archon is slower"),
        (grouped_step, "whole step, grouped / loop (tokens/s)", "grouped GEMM is faster", "grouped GEMM is slower"),
        (
            grouped_layer,
            "expert layer alone, grouped / loop (1 / time)",
            "grouped GEMM is faster",
            "grouped GEMM is slower",
        ),
    ):
        print(describe(summary, label), flush=True)
        print(verdict_line(summary, speed_verdict(summary, above, below), label), flush=True)
    return {
        "config": {
            **MOE_CONFIG,
            "lora_rank": train_step.LORA_RANK,
            "lora_targets": [*ATTENTION, *EXPERT_PARAMETERS],
            "threads": args.threads,
            "steps": args.steps,
            "real_tokens": archon["tokens_per_step"],
            "padded_tokens": hf["padded_tokens_per_step"],
            "trainable_params": archon["trainable_params"],
        },
        "archon_tok_s": archon["tok_s"],
        "hf_peft_tok_s": hf["tok_s"],
        "ratio": speed.median,
        "ratio_min": speed.min,
        "ratio_max": speed.max,
        "archon_loop_tok_s": loop["tok_s"],
        "grouped_over_loop_step": grouped_step.median,
        "grouped_over_loop_step_min": grouped_step.min,
        "grouped_over_loop_step_max": grouped_step.max,
        "grouped_over_loop_experts_layer": grouped_layer.median,
        "grouped_over_loop_experts_layer_min": grouped_layer.min,
        "grouped_over_loop_experts_layer_max": grouped_layer.max,
        "experts_layer_s": {"grouped": layer["grouped_s"], "loop": layer["loop_s"]},
        "archon_peak_rss_mb": archon["peak_rss_mb"],
        "archon_loop_peak_rss_mb": loop["peak_rss_mb"],
        "hf_peft_peak_rss_mb": hf["peak_rss_mb"],
        "archon_time_by_op": archon["time_by_op"],
        "hf_peft_time_by_op": hf["time_by_op"],
        "archon_losses": archon["losses"],
        "hf_peft_losses": hf["losses"],
        "load_average_1m_start_end": [load_start, os.getloadavg()[0]],
        "repeats": comparison.repeats,
        "verdict_allowed": comparison.verdict_allowed and grouped_layer.verdict_allowed,
        "environment": comparison.environment,
        "comparison": comparison.to_json(),
        "experts_layer_comparison": layer["comparison"],
    }


def _cli() -> None:
    import tyro

    args = tyro.cli(BenchArgs)
    if args.role != "main":
        print(json.dumps(ROLES[args.role](args)))
        return
    summary = main(args)
    print(
        f"real tokens/s (medians): archon MoE LoRA {summary['archon_tok_s']:.0f}, HF+PEFT "
        f"{summary['hf_peft_tok_s']:.0f}, ratio {summary['ratio']:.2f} (min {summary['ratio_min']:.2f}, max "
        f"{summary['ratio_max']:.2f} over {summary['repeats']} rounds)"
    )
    print(
        f"grouped over loop: whole step {summary['grouped_over_loop_step']:.2f}x, expert layer alone "
        f"{summary['grouped_over_loop_experts_layer']:.2f}x (medians)"
    )
    print(
        f"peak RSS MB: archon {summary['archon_peak_rss_mb']:.0f} (loop {summary['archon_loop_peak_rss_mb']:.0f}), "
        f"HF+PEFT {summary['hf_peft_peak_rss_mb']:.0f}"
    )
    print(f"archon time by op: {summary['archon_time_by_op']}; HF+PEFT: {summary['hf_peft_time_by_op']}")
    env = summary["environment"]
    print(
        f"{env['cpu_model']} ({env['cpu_capability']}), {env['threads']} threads; load average before "
        f"{env['load_average_before']}, after {env['load_average_after']}"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    _cli()
