"""Quantized-base benchmark: LoRA on a frozen FP8 or MXFP4 base kept quantized, against the same
model with a bf16 base.

    python benchmarks/quantized_base.py [--formats fp8 mxfp4] [--steps 5] [--threads 2]
    python benchmarks/quantized_base.py --paper-only     # just the on-paper table

Models (random weights, made with archon.tools.align.make_tiny_hf_checkpoint, then quantized with
archon.quant.export.quantize_checkpoint by the published recipes), sized so that the experts hold
most of the parameters, as in the published MoE checkpoints:
    fp8    Qwen3-MoE: hidden 1024, 4 layers (all MoE), 16 heads and 4 KV heads of 64, 32 experts,
           top-4, expert width 512, vocabulary 4096, untied head; FP8 e4m3 with 128x128 block scales
           on every projection of the decoder layers (attention and experts), as Qwen3-30B-A3B-FP8
           and DeepSeek-V3 store them; router, norms, embeddings and head in bf16
    mxfp4  GPT-OSS: the same sizes (8 KV heads, attention biases and sinks, sliding window 128 on
           every other layer); MXFP4 experts (gate_up_proj, down_proj), everything else bf16, as
           GPT-OSS is published
Each measurement runs in its own process:
    memory (per format and base)   build_model in bf16 with quantized_base "keep" and "dequantize"
           (the bf16 base): parameter bytes of the whole base and of the quantized weights alone
           (data and scales, against the same weights in bf16), and the growth of the process's
           anonymous resident memory over the build (after freeing the heap the load left behind)
    step   a LoRA train step (r=16 on every linear layer and the experts; token-level policy
           gradient on the RL-shaped batch of benchmarks/train_step.py: 16 sequences of 64-256
           tokens, 2238 tokens) in each compute dtype of --step-dtypes (default fp32, as a bf16 step
           takes about 7x as long on this CPU; LoRA factors stay fp32): the base kept quantized
           (dequantized in every GEMM's forward and again in its backward) against the same base
           dequantized at load into that dtype. The two trainers run in one process, their steps
           alternated (benchmarks/arms.py: `warmup` rounds, then `steps` rounds of one step each,
           the order reversed every other round), so both see the same load; medians of wall time
           and of process CPU time, and the median of the per-round ratios with their min and max
           (a verdict on the goal is printed only when the rounds agree, arms.SPREAD_BOUND).
           Also the time to dequantize every quantized weight once (a step does it twice).
    logprob_gap   the trainer's log-probs on the kept-quantized base (fp32) against HF transformers
           on the same checkpoint dequantized by transformers itself (FineGrainedFP8Config /
           Mxfp4Config with dequantize=True, fp32; its mxfp4 path dequantizes into bf16, which holds
           every e2m1 x 2^k product exactly, and is cast to fp32), on the batch's completion tokens.
Then, on paper (paper_table): memory per device for LoRA RL on Kimi K2 (FP8) and GPT-OSS-120B (MXFP4
experts) on 8 and 16 H200s, from the bytes per parameter measured here and the parameter counts of
the published configs (checked against transformers' own models of those configs, on the meta
device). The CPU, its instruction set, the threads and the load averages are reported: other work
on the machine perturbs the timings. The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Measure the checkout this script belongs to, whatever an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arms import (  # noqa: E402  (benchmarks/ is the script's own folder)
    MIN_REPEATS,
    Ratio,
    RatioSummary,
    check_repeats,
    describe,
    environment_record,
    goal_verdict,
    load_now,
    run_arms,
    verdict_line,
)
from train_step import PROMPT_LEN, anon_rss_mb, sequence_lengths  # noqa: E402

COMMON_SIZES = dict(
    vocab_size=4096,
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    head_dim=64,
    num_experts_per_tok=4,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)
MODELS = {
    "fp8": (
        "qwen3_moe",
        dict(
            COMMON_SIZES,
            num_key_value_heads=4,
            num_experts=32,
            moe_intermediate_size=512,
            intermediate_size=2048,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "mxfp4": (
        "gpt_oss",
        dict(
            COMMON_SIZES,
            num_key_value_heads=8,
            num_local_experts=32,
            intermediate_size=512,
            sliding_window=128,
            max_position_embeddings=131072,
        ),
    ),
}
FP8_BLOCK = (128, 128)
LORA_RANK, LORA_ALPHA = 16, 32.0
GOALS = {"fp8_base_over_bf16": 0.55, "mxfp4_experts_over_bf16": 0.3, "step_time_ratio": 1.3}
H200_GB = 141.0


@dataclass
class Args:
    formats: tuple[str, ...] = ("fp8", "mxfp4")
    steps: int = MIN_REPEATS
    """Measured rounds of alternated train steps, one step of each trainer a round (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    step_dtypes: tuple[str, ...] = ("float32",)
    """Compute dtypes of the timed train steps (base and activations; LoRA factors stay fp32). fp32 by
    default: a bf16 LoRA step of these models takes about 7x as long as an fp32 one on this CPU."""
    threads: int = 2
    """Intra-op threads of every measurement."""
    seed: int = 0
    paper_only: bool = False
    """Print only the on-paper table (bytes per parameter from archon's storage layout)."""
    role: str = "main"
    """Internal: the measurement this process makes (memory, step, logprob_gap)."""
    checkpoint: str = ""
    """Internal: the quantized HF checkpoint."""
    base: str = "keep"
    """Internal: quantized_base of the memory measurement."""
    dtype: str = "float32"
    """Internal: compute dtype of the step measurement."""


def _quant_format(name: str):
    from archon.quant import QuantFormat

    return QuantFormat("fp8", FP8_BLOCK) if name == "fp8" else QuantFormat("mxfp4", (1, 32))


# ---- memory ------------------------------------------------------------------------------------------


def _release_heap() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def base_bytes(loaded) -> dict:
    """Parameter bytes and counts of a built model's base (LoRA factors left out): the whole base,
    and the weights the checkpoint stores quantized (kept: their data and scale storage;
    dequantized at load: the weights themselves)."""
    from archon.checkpoint.hf import HFCheckpoint
    from archon.lora import is_lora_param
    from archon.quant import QuantizedCheckpoint, quantized_weights

    model = loaded.model
    kept = quantized_weights(model)  # archon key -> (module, name); empty when dequantized at load
    params = {name: p for name, p in model.named_parameters() if not is_lora_param(name)}
    if kept:
        quantized_params = {key: _numel(module._quantized[name].rows_shape) for key, (module, name) in kept.items()}
    else:
        hf_keys = QuantizedCheckpoint(HFCheckpoint(loaded.path), loaded.quant_format).keys()
        quantized_params = {
            key: p.numel()
            for key, p in params.items()
            if set(loaded.converter.hf_sources(key, hf_keys)) & loaded.quantized_hf_keys
        }
    out = {"base_bytes": 0, "quantized_bytes": 0, "quantized_params": sum(quantized_params.values())}
    storage = ("_qdata", "_qscale")
    out["base_params"] = out["quantized_params"] + sum(
        p.numel() for name, p in params.items() if name not in quantized_params and not name.endswith(storage)
    )
    for name, param in params.items():
        nbytes = param.numel() * param.element_size()
        out["base_bytes"] += nbytes
        if name.removesuffix("_qdata").removesuffix("_qscale") in quantized_params:
            out["quantized_bytes"] += nbytes
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_memory(args: Args) -> dict:
    import torch
    import transformers  # noqa: F401  (libraries are loaded before the baseline)

    from archon.build import build_model

    torch.set_num_threads(args.threads)
    _release_heap()
    before = anon_rss_mb()
    start = time.perf_counter()
    loaded = build_model(args.checkpoint, dtype=torch.bfloat16, quantized_base=args.base)
    build_s = time.perf_counter() - start
    _release_heap()
    grown = anon_rss_mb() - before
    return {"base": args.base, "rss_anon_growth_mb": grown, "build_s": build_s, **base_bytes(loaded)}


# ---- train step --------------------------------------------------------------------------------------


def _batch(vocab: int, seed: int):
    """benchmarks/train_step.py's RL-shaped batch, tokens drawn from this model's vocabulary."""
    import torch

    from archon.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in sequence_lengths(seed)]
    advantages = torch.randn(len(seqs), generator=g).tolist()
    return PackedBatch.from_sequences(seqs, prompt_lens=[PROMPT_LEN] * len(seqs), advantages=advantages)


def _pg_loss(mb, logprobs, ctx):
    """Token-level policy gradient: -sum(A * log p) / #completion tokens."""
    return -(logprobs * mb.advantages * mb.loss_mask).sum() / ctx.global_tokens, {}


def _trainer(args: Args, base: str, dtype: str = "float32"):
    from archon.lora import LoRAConfig
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    return Trainer(
        TrainerConfig(
            model_path=args.checkpoint,
            lora=LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules="all-linear"),
            quantized_base=base,
            dtype=dtype,
            device="cpu",
            micro_batch_tokens=8192,
            optim=OptimConfig(lr=1e-4, max_grad_norm=1.0),
            seed=args.seed,
        )
    )


def _dequantize_all_s(model, dtype) -> float:
    """Seconds to dequantize every quantized weight of `model` once in `dtype` (median of 3), into one
    reused buffer as the GEMMs do on the CPU."""
    import torch

    from archon.quant import dequantize, quantized_weights

    weights = []
    for module, name in quantized_weights(model).values():
        data, scale = module.storage(name)
        fmt = module._quantized[name].fmt
        weights.append((fmt, data, scale, (*data.shape[:-1], fmt.in_features(data.shape[-1]))))
    buffer = torch.empty(max(_numel(shape) for *_, shape in weights), dtype=dtype)

    def once() -> float:
        start = time.perf_counter()
        for fmt, data, scale, shape in weights:
            dequantize(fmt, data, scale, dtype, out=buffer[: _numel(shape)].view(shape))
        return time.perf_counter() - start

    return statistics.median(once() for _ in range(3))


def run_step(args: Args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    trainers = {"keep": _trainer(args, "keep", args.dtype), "dequantize": _trainer(args, "dequantize", args.dtype)}
    batch = _batch(trainers["keep"].model.args.vocab_size, args.seed)

    def step_arm(trainer):
        def measure() -> dict:
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            loss = trainer.train_step(batch, _pg_loss)["loss"]
            return {"wall_s": time.perf_counter() - wall_start, "cpu_s": time.process_time() - cpu_start, "loss": loss}

        return measure

    result = run_arms(
        {name: step_arm(trainer) for name, trainer in trainers.items()},
        [
            Ratio("step_time_ratio", "keep", "dequantize", "wall_s"),
            Ratio("step_time_ratio_cpu", "keep", "dequantize", "cpu_s"),
        ],
        repeats=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        progress=False,
    )
    dequantize_s = _dequantize_all_s(trainers["keep"].model, getattr(torch, args.dtype))
    wall = {name: [s["wall_s"] for s in samples] for name, samples in result.samples.items()}
    losses = {name: [s["loss"] for s in samples] for name, samples in result.samples.items()}
    ratio, ratio_cpu = result.ratios["step_time_ratio"], result.ratios["step_time_ratio_cpu"]
    return {
        "dtype": args.dtype,
        "tokens": batch.num_tokens,
        "trainable_params": sum(p.numel() for p in trainers["keep"].trainable),
        "wall_s": {name: result.median(name, "wall_s") for name in trainers},
        "cpu_s": {name: result.median(name, "cpu_s") for name in trainers},
        "wall_s_all": wall,
        "step_time_ratio": ratio.median,
        "step_time_ratio_min": ratio.min,
        "step_time_ratio_max": ratio.max,
        "step_time_ratio_cpu": ratio_cpu.median,
        "step_time_ratio_cpu_min": ratio_cpu.min,
        "step_time_ratio_cpu_max": ratio_cpu.max,
        "dequantize_every_weight_once_s": dequantize_s,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses["keep"], losses["dequantize"])),
        "comparison": result.to_json(),
    }


# ---- log-prob gap -------------------------------------------------------------------------------------


def run_logprob_gap(args: Args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    torch.set_num_threads(args.threads)
    trainer = _trainer(args, "keep")
    batch = _batch(trainer.model.args.vocab_size, args.seed)
    archon_lp = trainer.logprobs(batch).logprobs.double()
    del trainer
    method = json.loads((Path(args.checkpoint) / "config.json").read_text())["quantization_config"]["quant_method"]
    config = FineGrainedFP8Config(dequantize=True) if method == "fp8" else Mxfp4Config(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, quantization_config=config)
    hf = hf.float().eval()  # transformers' mxfp4 dequantization lands in bf16, exactly
    hf_lp = torch.zeros(batch.num_tokens, dtype=torch.float64)
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for start, end in zip(cu[:-1], cu[1:]):
            logits = hf(batch.tokens[None, start:end]).logits[0, :-1].double()
            hf_lp[start : end - 1] = torch.log_softmax(logits, -1).gather(-1, batch.tokens[start + 1 : end, None])[:, 0]
    gap = (archon_lp - hf_lp)[batch.loss_mask].abs()  # both [T]; the loss-mask positions are the scored ones
    return {
        "tokens": int(gap.numel()),
        "max_abs_logprob_diff": gap.max().item(),
        "mean_abs_logprob_diff": gap.mean().item(),
    }


ROLES = {"memory": run_memory, "step": run_step, "logprob_gap": run_logprob_gap}


# ---- on paper: Kimi K2 and GPT-OSS-120B ----------------------------------------------------------------


@dataclass(frozen=True)
class Weights:
    """`count` weights of [out, in] (per layer times layers, or per expert times experts and layers)."""

    part: str
    count: int
    out_features: int
    in_features: int
    quantized: bool
    lora: bool
    """Whether LoRA on all linear layers and the experts adapts it (r * (in + out) per weight)."""

    @property
    def routed(self) -> bool:
        return self.part == "routed experts"

    @property
    def params(self) -> int:
        return self.count * self.out_features * self.in_features


# The published configs' fields that size the models (HF config kwargs; Kimi K2 is a DeepSeek-V3).
KIMI_K2_CONFIG = dict(
    hidden_size=7168,
    num_hidden_layers=61,
    first_k_dense_replace=1,
    intermediate_size=18432,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_group=1,
    topk_group=1,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=163840,
    tie_word_embeddings=False,
)
GPT_OSS_120B_CONFIG = dict(
    hidden_size=2880,
    num_hidden_layers=36,
    num_local_experts=128,
    num_experts_per_tok=4,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=201088,
    tie_word_embeddings=False,
)


def kimi_k2_weights(c: dict = KIMI_K2_CONFIG) -> tuple[list[Weights], int]:
    """Kimi K2's weights (DeepSeek-V3's architecture: MLA, dense layers, then MoE layers of routed
    experts and a shared expert), FP8 with 128x128 blocks on every projection of the decoder layers,
    as published; and the count of its other (bf16) parameters: norms and the routers'
    score-correction biases."""
    hidden, layers, dense = c["hidden_size"], c["num_hidden_layers"], c["first_k_dense_replace"]
    experts, width, heads = c["n_routed_experts"], c["moe_intermediate_size"], c["num_attention_heads"]
    q_rank, kv_rank, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    qk_dim, v_dim = c["qk_nope_head_dim"] + rope, c["v_head_dim"]
    moe, shared = layers - dense, c["n_shared_experts"] * width
    weights = [
        Weights("attention", layers, q_rank, hidden, True, True),  # q_a_proj
        Weights("attention", layers, heads * qk_dim, q_rank, True, True),  # q_b_proj
        Weights("attention", layers, kv_rank + rope, hidden, True, True),  # kv_a_proj_with_mqa: 576 rows
        Weights("attention", layers, heads * (qk_dim - rope + v_dim), kv_rank, True, True),  # kv_b_proj
        Weights("attention", layers, hidden, heads * v_dim, True, True),  # o_proj
        Weights("dense MLP", 2 * dense, c["intermediate_size"], hidden, True, True),  # gate_proj, up_proj
        Weights("dense MLP", dense, hidden, c["intermediate_size"], True, True),  # down_proj
        Weights("shared experts", 2 * moe, shared, hidden, True, True),
        Weights("shared experts", moe, hidden, shared, True, True),
        Weights("routed experts", moe * experts, 2 * width, hidden, True, True),  # gate_up_proj
        Weights("routed experts", moe * experts, hidden, width, True, True),  # down_proj
        Weights("routers", moe, experts, hidden, False, False),
        Weights("embeddings and head", 2, c["vocab_size"], hidden, False, False),
    ]
    other = layers * (2 * hidden + q_rank + kv_rank) + hidden + moe * experts  # norms, final norm, biases
    return weights, other


def gpt_oss_120b_weights(c: dict = GPT_OSS_120B_CONFIG) -> tuple[list[Weights], int]:
    """GPT-OSS-120B's weights, MXFP4 on the routed experts only, as published; and the count of its
    other (bf16) parameters: biases, attention sinks, norms."""
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    experts, width = c["num_local_experts"], c["intermediate_size"]
    q_dim, kv_dim = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    weights = [
        Weights("attention", layers, q_dim, hidden, False, True),  # q_proj
        Weights("attention", 2 * layers, kv_dim, hidden, False, True),  # k_proj, v_proj
        Weights("attention", layers, hidden, q_dim, False, True),  # o_proj
        Weights("routed experts", layers * experts, 2 * width, hidden, True, True),  # gate_up_proj
        Weights("routed experts", layers * experts, hidden, width, True, True),  # down_proj
        Weights("routers", layers, experts, hidden, False, False),
        Weights("embeddings and head", 2, c["vocab_size"], hidden, False, False),
    ]
    biases = q_dim + 2 * kv_dim + hidden + experts + experts * (2 * width + hidden)  # attention, router, experts
    other = layers * (biases + c["num_attention_heads"] + 2 * hidden) + hidden  # + sinks, norms; final norm
    return weights, other


PAPER_MODELS = {
    "Kimi K2": ("deepseek_v3", KIMI_K2_CONFIG, kimi_k2_weights, "fp8", "n_routed_experts", "moe_intermediate_size"),
    "GPT-OSS-120B": (
        "gpt_oss",
        GPT_OSS_120B_CONFIG,
        gpt_oss_120b_weights,
        "mxfp4",
        "num_local_experts",
        "intermediate_size",
    ),
}  # name: (model_type, config, weights, format, experts field, expert width field)


def check_parameter_counts() -> dict[str, int]:
    """Each paper model's count against transformers' own model of its config, built on the meta
    device (parameters and persistent buffers, such as DeepSeek-V3's score-correction biases)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    counts = {}
    for name, (model_type, config, weights_fn, *_) in PAPER_MODELS.items():
        weights, other = weights_fn(config)
        ours = sum(w.params for w in weights) + other
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
        theirs = sum(t.numel() for t in model.state_dict().values())
        if ours != theirs:
            raise RuntimeError(f"{name}: {ours} parameters by this script's shapes, {theirs} in transformers' model")
        counts[name] = theirs
    return counts


def storage_bytes_per_param(fmt_name: str, in_features: int) -> float:
    """Bytes per parameter of archon's in-memory storage of a quantized weight with `in_features`
    inputs (data and scales, archon.quant.formats)."""
    import torch

    fmt = _quant_format(fmt_name)
    data_shape, scale_shape = fmt.storage_shapes((1, in_features))
    scale_size = torch.empty((), dtype=fmt.scale_dtype()).element_size()
    return (_numel(data_shape) + _numel(scale_shape) * scale_size) / in_features


def paper_table(bytes_per_param: dict[str, float], devices=(8, 16), lora_rank: int = LORA_RANK) -> dict:
    """GB per H200 of LoRA RL with the base kept quantized and with a bf16 base, the base and the
    adapter sharded evenly over `devices` (FSDP2 for attention and dense weights, expert parallelism
    for the routed experts, which are then never gathered), from `bytes_per_param` ({"fp8": ...,
    "mxfp4": ..., "bf16": 2.0}, measured) and the published configs' shapes:
        base       quantized weights x their bytes per parameter, the rest x bf16's
        LoRA       rank `lora_rank` on every linear layer and every expert: fp32 factors, their
                   gradients and AdamW's two moments, 16 bytes per adapter parameter
        transient  the largest local expert projection dequantized in bf16 (the kept-quantized base
                   dequantizes one projection's local experts per GEMM; chunked, so nothing else in fp32)
    Activations, the KV cache of colocated generation and the FSDP-gathered attention block are not
    counted (they depend on tokens per micro-batch; see the long-context section)."""
    table = {}
    for name, (_, config, weights_fn, fmt, experts_field, width_field) in PAPER_MODELS.items():
        weights, other = weights_fn(config)
        experts, gate_up = config[experts_field], 2 * config[width_field] * config["hidden_size"]
        quantized = sum(w.params for w in weights if w.quantized)
        plain = sum(w.params for w in weights if not w.quantized) + other
        lora_by_weight = [(w, w.count * lora_rank * (w.in_features + w.out_features)) for w in weights if w.lora]
        lora = sum(n for _, n in lora_by_weight)
        lora_unrouted = sum(n for w, n in lora_by_weight if not w.routed)
        parts: dict[str, int] = {}
        for w in weights:
            parts[w.part] = parts.get(w.part, 0) + w.params
        rows = {}
        for n in devices:
            transient = experts // n * gate_up * bytes_per_param["bf16"] / 1e9
            lora_gb, lora_unrouted_gb = lora * 16 / n / 1e9, lora_unrouted * 16 / n / 1e9
            for base in (fmt, "bf16"):
                base_gb = (quantized * bytes_per_param[base] + plain * bytes_per_param["bf16"]) / n / 1e9
                extra = transient if base != "bf16" else 0.0
                total = base_gb + lora_gb + extra
                rows[f"{n} x H200, {base} base"] = {
                    "base_gb": round(base_gb, 1),
                    "lora_state_gb": round(lora_gb, 1),
                    "dequantized_transient_gb": round(extra, 1),
                    "total_gb": round(total, 1),
                    "left_for_activations_gb": round(H200_GB - total, 1),
                    "total_without_routed_expert_lora_gb": round(base_gb + lora_unrouted_gb + extra, 1),
                }
        table[name] = {
            "params": quantized + plain,
            "quantized_params": quantized,
            "bf16_params": plain,
            "params_by_part": {**parts, "norms, biases, sinks": other},
            "lora_params": lora,
            "lora_params_without_routed_experts": lora_unrouted,
            "format": fmt,
            "per_device": rows,
        }
    return table


def print_paper_table(table: dict, bytes_per_param: dict[str, float]) -> None:
    print(f"bytes per parameter: {', '.join(f'{k} {v:.5f}' for k, v in bytes_per_param.items())}")
    for name, model in table.items():
        print(
            f"{name}: {model['params'] / 1e9:.1f}B parameters, {model['quantized_params'] / 1e9:.1f}B in "
            f"{model['format']}, {model['bf16_params'] / 1e9:.2f}B bf16; LoRA r={LORA_RANK} on every linear "
            f"layer and expert: {model['lora_params'] / 1e9:.2f}B"
        )
        print(
            "| devices, base | base | LoRA + AdamW | dequantized transient | total | left of 141 GB "
            "| total, no LoRA on routed experts |"
        )
        print("|---|---|---|---|---|---|---|")
        for row, r in model["per_device"].items():
            print(
                f"| {row} | {r['base_gb']} | {r['lora_state_gb']} | {r['dequantized_transient_gb']} | "
                f"{r['total_gb']} | {r['left_for_activations_gb']} | "
                f"{r['total_without_routed_expert_lora_gb']} |"
            )


# ---- driver -------------------------------------------------------------------------------------------


def _measure(role: str, args: Args, checkpoint: Path, base: str = "keep", dtype: str = "float32") -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        role,
        "--checkpoint",
        str(checkpoint),
        "--base",
        base,
        "--dtype",
        dtype,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{role} ({base}, {dtype}) on {checkpoint} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_format(args: Args, fmt_name: str, workdir: Path) -> dict:
    from archon.quant.export import quantize_checkpoint
    from archon.tools.align import make_tiny_hf_checkpoint

    model_type, sizes = MODELS[fmt_name]
    source = make_tiny_hf_checkpoint(model_type, workdir / f"{fmt_name}-source", seed=args.seed, **sizes)
    checkpoint = quantize_checkpoint(source, workdir / f"{fmt_name}-quantized", _quant_format(fmt_name))
    memory = {base: _measure("memory", args, checkpoint, base) for base in ("keep", "dequantize")}
    step = {dtype: _measure("step", args, checkpoint, dtype=dtype) for dtype in args.step_dtypes}
    gap = _measure("logprob_gap", args, checkpoint)
    keep, bf16 = memory["keep"], memory["dequantize"]
    if keep["quantized_params"] != bf16["quantized_params"] or keep["base_params"] != bf16["base_params"]:
        raise RuntimeError(f"{fmt_name}: the kept and dequantized builds count different parameters: {memory}")
    return {
        "model_type": model_type,
        "sizes": sizes,
        "format": str(_quant_format(fmt_name)),
        "params": keep["base_params"],
        "quantized_params": keep["quantized_params"],
        "memory": memory,
        "base_over_bf16": keep["base_bytes"] / bf16["base_bytes"],
        "quantized_over_bf16": keep["quantized_bytes"] / bf16["quantized_bytes"],
        "rss_growth_over_bf16": keep["rss_anon_growth_mb"] / bf16["rss_anon_growth_mb"],
        "bytes_per_param": {
            "quantized": keep["quantized_bytes"] / keep["quantized_params"],
            "bf16": bf16["quantized_bytes"] / bf16["quantized_params"],
        },
        "step": step,
        "logprob_gap": gap,
    }


def main(args: Args) -> dict:
    unknown = [f for f in args.formats if f not in MODELS]
    if unknown:
        raise ValueError(f"--formats names {unknown}; expected some of {list(MODELS)}")
    bad_dtypes = [d for d in args.step_dtypes if d not in ("float32", "bfloat16")]
    if bad_dtypes:
        raise ValueError(f"--step-dtypes names {bad_dtypes}; expected float32 and/or bfloat16")
    check_repeats(args.steps, quick=False)  # before the minutes of building and measuring memory
    load_start = os.getloadavg()[0]
    before = load_now()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt_name in args.formats:
            results[fmt_name] = measure_format(args, fmt_name, Path(tmp))
            print(f"{fmt_name}: {json.dumps(results[fmt_name])}", file=sys.stderr, flush=True)
    bytes_per_param = _paper_bytes_per_param()
    for fmt_name, r in results.items():  # measured, where measured
        bytes_per_param[fmt_name] = r["bytes_per_param"]["quantized"]
        bytes_per_param["bf16"] = r["bytes_per_param"]["bf16"]
    return {
        "config": {
            "lora_rank": LORA_RANK,
            "lora_targets": "all-linear (experts included)",
            "threads": args.threads,
            "steps": args.steps,
            "step_dtypes": args.step_dtypes,
            "memory_dtype": "bfloat16",
            "fp8_block": FP8_BLOCK,
        },
        "goals": GOALS,
        "formats": results,
        "paper_bytes_per_param": bytes_per_param,
        "paper_parameter_counts_match_transformers": check_parameter_counts(),
        "paper": paper_table(bytes_per_param),
        "load_average_1m_start_end": [load_start, os.getloadavg()[0]],
        "repeats": args.steps,
        "environment": environment_record(args.threads, before, load_now()),
    }


def _paper_bytes_per_param() -> dict[str, float]:
    """Bytes per parameter of the published models' quantized weights in archon's storage (their
    inputs are multiples of every block: 7168, 1536, 512, 8192, 2048; 2880 = 90 x 32)."""
    return {"fp8": storage_bytes_per_param("fp8", 7168), "mxfp4": storage_bytes_per_param("mxfp4", 2880), "bf16": 2.0}


def _print_summary(summary: dict) -> None:
    for fmt_name, r in summary["formats"].items():
        keep, bf16, gap = r["memory"]["keep"], r["memory"]["dequantize"], r["logprob_gap"]
        print(
            f"{fmt_name} ({r['model_type']}, {r['params'] / 1e6:.0f}M parameters, "
            f"{r['quantized_params'] / 1e6:.0f}M quantized): base {keep['base_bytes'] / 2**20:.0f} MB kept vs "
            f"{bf16['base_bytes'] / 2**20:.0f} MB bf16 = {r['base_over_bf16']:.3f}; quantized weights "
            f"{r['quantized_over_bf16']:.3f}; anonymous RSS growth {keep['rss_anon_growth_mb']:.0f} vs "
            f"{bf16['rss_anon_growth_mb']:.0f} MB = {r['rss_growth_over_bf16']:.3f}"
        )
        for dtype, step in r["step"].items():
            print(
                f"  LoRA step ({dtype}, {step['tokens']} tokens): kept {step['wall_s']['keep']:.2f} s, "
                f"dequantized {step['wall_s']['dequantize']:.2f} s (medians); dequantizing every weight once "
                f"{step['dequantize_every_weight_once_s']:.2f} s"
            )
            for name in ("step_time_ratio", "step_time_ratio_cpu"):
                summary = RatioSummary.from_json(name, step["comparison"]["ratios"][name])
                label = f"  kept / dequantized step, {'CPU' if name.endswith('cpu') else 'wall'} time"
                print(describe(summary, label))
                if name == "step_time_ratio":
                    print(verdict_line(summary, goal_verdict(summary, GOALS["step_time_ratio"]), label))
        print(
            f"  log-prob gap to HF dequantized (fp32): max {gap['max_abs_logprob_diff']:.2e} over "
            f"{gap['tokens']} tokens"
        )
    print_paper_table(summary["paper"], summary["paper_bytes_per_param"])
    env = summary["environment"]
    print(
        f"{env['cpu_model']} ({env['cpu_capability']}), {env['threads']} threads; load average before "
        f"{env['load_average_before']}, after {env['load_average_after']}"
    )


def _cli() -> None:
    import tyro

    args = tyro.cli(Args)
    if args.role != "main":
        print(json.dumps(ROLES[args.role](args)))
        return
    if args.paper_only:
        bytes_per_param = _paper_bytes_per_param()
        counts = check_parameter_counts()
        table = paper_table(bytes_per_param)
        print_paper_table(table, bytes_per_param)
        print(
            json.dumps(
                {
                    "paper_bytes_per_param": bytes_per_param,
                    "paper_parameter_counts_match_transformers": counts,
                    "paper": table,
                }
            )
        )
        return
    summary = main(args)
    _print_summary(summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    _cli()
