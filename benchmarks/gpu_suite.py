"""GPU readiness suite: one command that checks archon on a CUDA device and measures it.

    python benchmarks/gpu_suite.py --out DIR            # on a CUDA machine (bf16 where it says so)
    python benchmarks/gpu_suite.py --tiny --out DIR     # the same checks at tiny sizes on CPU (CI)

Checks (each runs on its own: a failure is recorded and the next check still runs):
    alignment    every registered family against HF transformers on the same device: fp32 at the
                 CPU tolerances, and bf16 judged against what bf16 costs HF itself (see BF16_*)
    train        a LoRA train step in bf16 for a dense and an MoE family on packed sequences of
                 varied length (on CUDA through the flash varlen attention kernel): the loss falls,
                 gradients are finite, the first loss is within TRAIN_BF16_LOSS_RTOL of fp32
    generation   native greedy decoding in fp32 gives HF `generate`'s tokens on the same device, and
                 sampled log-probs equal Engine.logprobs on the same tokens
    memory       the chunked log-prob head's peak memory grows with O(T x D), not O(T x V)
    throughput   a dense LoRA train step at a realistic width in bf16: tokens/s, and model FLOPs
                 utilisation against the bf16 matmul peak measured in the same run
    prefill      native generation from one long prompt (32K tokens on CUDA) prefilled in one forward
                 and in chunks of rollout.prefill_chunk_tokens, in fp32: the same greedy tokens and
                 log-probs, and on CUDA the peak memory of each (the chunked one's activations are a chunk's)
    moe          an MoE LoRA train step (Qwen3-MoE, LoRA on attention and experts) at a realistic
                 width in bf16: tokens/s and MFU with grouped-GEMM experts, and the speed-up over
                 the loop over experts; and, on one device (no expert parallelism), grouped experts
                 against the loop in fp32 and bf16: outputs and gradients agree
    offload      a LoRA train step of a small Qwen3 at a long sequence with activation offload and
                 without (its hooks only counting): peak device memory, step time, the two ratios,
                 and the first forward-backward's loss and gradients against the run without
    quantized    a Qwen3-MoE in FP8 (block-scaled e4m3) and a GPT-OSS with MXFP4 experts, made by
                 quantizing random checkpoints with the published recipes, kept quantized under
                 LoRA in bf16 against the same checkpoints dequantized at load (the bf16 base): the
                 LoRA train step (loss finite and equal, every LoRA gradient finite and non-zero,
                 base parameter bytes below the bf16 base's; step time and on CUDA peak memory
                 against the bf16 base), and greedy generation with the built-in engine (the same tokens)
    rollout_systems
                 replay: a Qwen3-MoE samples in bf16 with the built-in engine, recording its routing,
                 and the trainer scores in fp32 with and without the recorded experts: after a token
                 routed differently the replayed log-probs are nearer the sampler's, elsewhere equal
                 speculative: greedy decoding with a drafter equals plain decoding (a Qwen3 drafted by
                 itself against its CUDA-graph decode step on CUDA; a DeepSeek-V3 drafted by its MTP
                 layer), sampled tokens' log-probs equal the trainer's; acceptance and tok/s reported
                 partial: two adapter versions published during a generation of the built-in engine,
                 each token tagged with the version that sampled it, at that version's log-prob
    tinker       (opt-in, --only tinker) the Tinker-compatible server (archon.serve) on the device,
                 driven by the tinker SDK: forward_backward / optim_step lower the loss, and sampled
                 log-probs equal compute_logprobs (LOGPROB_ATOL); untested on hardware
Context parallelism needs two devices and is not checked here (the suite runs on one); its CPU
tests run CP against one process with gloo, and benchmarks/long_context.py measures it.

What --tiny changes: everything runs on the CPU at tiny sizes. bf16 runs where it checks numerics
(alignment, train), but attention takes the per-sequence SDPA path, as the flash varlen kernel is
CUDA-only; peak memory is the storage the head's tensors allocate (as tests/memory_tracking.py
counts it), not torch.cuda.max_memory_allocated; throughput runs in fp32 against the fp32 matmul
peak, and its figures say nothing about a GPU; offload copies CPU tensors into fresh host buffers
(offload_host_tensors), so only its saved-activation counts, not device memory, are measured;
prefill compares tokens and log-probs only (the storage meter cannot follow the causal-bias tensor
that attention after a prefix passes to SDPA).

The last line printed is JSON: {"pass": ..., "checks": {name: {"pass": ..., figures...}}, ...}.
DIR gets gpu_suite.log (progress, figures, tracebacks) and gpu_suite.json (the same JSON).
The exit code is 0 when every check passed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

# Measure the checkout this script belongs to, whatever an editable install points at.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

log = logging.getLogger("gpu_suite")

CHECKS = (
    "alignment",
    "train",
    "generation",
    "memory",
    "throughput",
    "moe",
    "offload",
    "prefill",
    "quantized",
    "rollout_systems",
)
OPT_IN_CHECKS = ("tinker",)
"""Checks run only when --only names them: tinker  one round of the Tinker-compatible server (archon.serve)
driven by the tinker SDK: forward_backward, optim_step, save_weights_and_get_sampling_client and
sample on the device, the sampled log-probs against compute_logprobs (untested on hardware)."""

# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3), so a bf16 model is judged against the
# error that HF itself makes in bf16, both measured against HF in fp32 on the same inputs. archon
# reaches its bf16 logits by other, equally valid roundings (packed sequences, fused kernels,
# different reduction orders), so it may err by a few times HF's amount, not by orders more:
#     p90 over tokens of max_v |archon_bf16 - hf_fp32| <= BF16_FACTOR * (the same for hf_bf16) + BF16_ABS_LOGITS
#     mean KL(hf_fp32 || archon_bf16)                  <= BF16_FACTOR**2 * KL(hf_fp32 || hf_bf16) + BF16_ABS_KL
# (KL grows with the square of a logit perturbation, hence the squared factor). The 90th percentile
# rather than the maximum: in MoE families a few tokens sit near a tie between experts, and bf16
# rounding flips their expert choice in fp32's disfavour, moving those tokens' logits by O(1) in
# HF and archon alike, but on different tokens (the maximum is reported too). The absolute terms
# only matter when HF's bf16 error happens to be near zero.
BF16_FACTOR = 4.0
BF16_ABS_LOGITS = 1e-2
BF16_ABS_KL = 1e-5
# The first train step's loss (mean NLL, before any update) in bf16 against fp32 on the same
# weights and tokens: a relative difference of a few bf16 roundoffs.
TRAIN_BF16_LOSS_RTOL = 2e-2
# Native rollout log-probs against Engine.logprobs, and greedy generation, in fp32: the CPU contract.
LOGPROB_ATOL = 1e-5
# A base kept quantized against the same checkpoint dequantized at load, both bf16: the GEMMs see the
# same bf16 weights (each dequantized in fp32 and rounded once), so the first losses differ by no
# more than the kernels' summation order.
QUANTIZED_LOSS_RTOL = 1e-3


@dataclass(frozen=True)
class Sizes:
    """Everything that differs in size between the CUDA run and --tiny."""

    align_seq_lens: tuple[int, ...]
    train_overrides: dict[str, Any]
    """HF config kwargs over each train family's tiny config."""
    train_seq_lens: tuple[int, ...]
    train_steps: int
    train_lr: float
    gen_max_new_tokens: int
    memory_vocab: int
    memory_dim: int
    memory_tokens: tuple[int, int]
    """(small, large) token counts for the head's peak-memory comparison."""
    memory_chunk: int
    memory_dtype: torch.dtype
    throughput_config: dict[str, Any]
    """A Qwen3 config (HF kwargs) for the throughput step."""
    throughput_tokens: int
    throughput_sequences: int
    throughput_prompt_len: int
    throughput_dtype: str
    throughput_steps: int
    moe_config: dict[str, Any]
    """A Qwen3-MoE config (HF kwargs) for the MoE step; throughput_* give its batch and dtype."""
    lora_rank: int
    offload_config: dict[str, Any]
    """A Qwen3 config (HF kwargs) for the activation-offload step."""
    offload_tokens: int
    offload_sequences: int
    offload_min_bytes: int
    """Saved tensors offloaded from this size up (archon's OFFLOAD_MIN_BYTES on CUDA)."""
    offload_steps: int
    """Timed train steps of each run (the median is reported)."""
    prefill_config: dict[str, Any]
    """HF kwargs over the tiny Qwen3 config for the prefill check's model."""
    prefill_tokens: int
    """The prefill check's prompt length."""
    prefill_chunk: int
    """Its prefill_chunk_tokens."""
    quantized_models: dict[str, tuple[str, dict[str, Any]]]
    """Format ("fp8", "mxfp4") -> (model_type, HF kwargs over its tiny config) for the quantized check."""
    quantized_fp8_block: tuple[int, int]
    """weight_block_size of the FP8 model."""


TINY = Sizes(
    align_seq_lens=(7, 1, 13, 33),
    train_overrides={},
    train_seq_lens=(9, 17, 4, 23, 12, 1),
    train_steps=5,
    train_lr=1e-2,
    gen_max_new_tokens=6,
    memory_vocab=4096,
    memory_dim=32,
    memory_tokens=(512, 4096),
    memory_chunk=256,
    memory_dtype=torch.float32,
    throughput_config=dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    throughput_tokens=256,
    throughput_sequences=4,
    throughput_prompt_len=8,
    throughput_dtype="float32",
    throughput_steps=2,
    moe_config=dict(
        vocab_size=1024,
        hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    lora_rank=4,
    offload_config=dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    offload_tokens=512,
    offload_sequences=2,
    offload_min_bytes=4096,
    offload_steps=3,
    prefill_config={},
    prefill_tokens=480,
    prefill_chunk=64,
    # The tiny configs (a dense first layer in Qwen3-MoE); FP8 blocks that leave partial edge blocks.
    quantized_models={"fp8": ("qwen3_moe", {}), "mxfp4": ("gpt_oss", {})},
    quantized_fp8_block=(16, 24),
)
FULL = Sizes(
    align_seq_lens=(9, 1, 16, 31, 64, 200),
    # Heads of 64 and 128 dimensions, as real models have, so the flash kernel runs its usual tiles.
    train_overrides=dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=128,
    ),
    train_seq_lens=(37, 5, 128, 64, 300, 17, 1, 211),
    train_steps=6,
    train_lr=1e-2,
    gen_max_new_tokens=16,
    memory_vocab=151936,
    memory_dim=4096,
    memory_tokens=(4096, 32768),
    memory_chunk=1024,
    memory_dtype=torch.bfloat16,
    throughput_config=dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    throughput_tokens=16384,
    throughput_sequences=16,
    throughput_prompt_len=128,
    throughput_dtype="bfloat16",
    throughput_steps=3,
    # Qwen3-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert width 768), 4 layers.
    moe_config=dict(
        vocab_size=151936,
        hidden_size=2048,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    lora_rank=16,
    # A small Qwen3 at one 16K-token sequence: the saved activations outweigh the weights.
    offload_config=dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    offload_tokens=16384,
    offload_sequences=1,
    offload_min_bytes=1 << 20,
    offload_steps=3,
    # As many key/value heads as query heads: in fp32 on CUDA, grouped-query attention has no
    # memory-efficient SDPA kernel, and the one-shot prefill's fallback would hold [H, T, T] scores.
    prefill_config=dict(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        max_position_embeddings=40960,
    ),
    prefill_tokens=32768,
    prefill_chunk=2048,
    # Expert-dominated MoE layers (2 layers; the checkpoints are quantized on the host, so ~0.5B
    # parameters each), as published: 128x128 FP8 blocks on every projection; MXFP4 on GPT-OSS's experts.
    quantized_models={
        "fp8": (
            "qwen3_moe",
            dict(
                vocab_size=32768,
                hidden_size=2048,
                num_hidden_layers=2,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=32,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                mlp_only_layers=[],
                max_position_embeddings=32768,
            ),
        ),
        "mxfp4": (
            "gpt_oss",
            dict(
                vocab_size=32768,
                hidden_size=2048,
                intermediate_size=2048,
                num_hidden_layers=2,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                num_local_experts=16,
                num_experts_per_tok=4,
                sliding_window=128,
            ),
        ),
    },
    quantized_fp8_block=(128, 128),
)
TRAIN_FAMILIES = {"dense": "qwen3", "moe": "qwen3_moe"}
GEN_FAMILIES = ("qwen3", "qwen3_moe")
GEN_PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


@dataclass
class SuiteArgs:
    out: str = "gpu_suite_out"
    """Directory for gpu_suite.log and gpu_suite.json (created if missing)."""
    tiny: bool = False
    """Tiny sizes on the CPU (what CI runs); without it the suite needs CUDA."""
    only: tuple[str, ...] = ()
    """Run just these checks (default: all of them, CHECKS)."""
    seed: int = 0


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    seed: int
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ---- shared helpers ----------------------------------------------------------------------------------


def _hf_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()


def _tiny_checkpoint(ctx: Context, model_type: str, name: str, **overrides) -> Path:
    from archon.tools.align import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(model_type, ctx.workdir / name, seed=ctx.seed, **overrides)


@contextlib.contextmanager
def count_varlen_calls():
    """Counts calls of torch's flash varlen attention while the block runs: {"calls": n}."""
    from torch.nn.attention import varlen

    original = varlen.varlen_attn
    counter = {"calls": 0}

    @functools.wraps(original)  # keeps the signature that models/common/attention.py inspects
    def counted(*args, **kwargs):
        counter["calls"] += 1
        return original(*args, **kwargs)

    varlen.varlen_attn = counted
    try:
        yield counter
    finally:
        varlen.varlen_attn = original


def _release(ctx: Context) -> None:
    import gc

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def _run_parts(ctx: Context, check: str, parts: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each part of a check run on its own: a failure is recorded (with its traceback in the log)
    and the next part still runs; the device is released after each."""
    results = {}
    for name, run in parts.items():
        try:
            results[name] = run()
        except Exception as exc:  # one part's failure must not hide the others'
            log.error("%s %s failed:\n%s", check, name, traceback.format_exc())
            results[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            _release(ctx)
        log.info("%s %s: %s", check, name, results[name])
    return results


# ---- 1. alignment -----------------------------------------------------------------------------------


def check_alignment(ctx: Context) -> dict[str, Any]:
    from archon.spec import supported_model_types

    families = _run_parts(
        ctx, "alignment", {t: functools.partial(_align_family, ctx, t) for t in supported_model_types()}
    )
    return {
        "pass": all(r["pass"] for r in families.values()),
        "tolerances": {
            "fp32_max_abs_logits_diff": _align_tolerances()[0],
            "fp32_mean_kl": _align_tolerances()[1],
            "bf16_p90_abs_logits_diff": f"{BF16_FACTOR} * hf_bf16 + {BF16_ABS_LOGITS}",
            "bf16_mean_kl": f"{BF16_FACTOR**2} * hf_bf16 + {BF16_ABS_KL}",
        },
        "families": families,
    }


def _align_tolerances() -> tuple[float, float]:
    from archon.tools.align import MAX_ABS_LOGITS_DIFF, MAX_MEAN_KL

    return MAX_ABS_LOGITS_DIFF, MAX_MEAN_KL


def _p90_token_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """90th percentile over tokens of each token's max |logit difference| ([T, V] inputs)."""
    return torch.quantile((logits - reference).abs().amax(dim=-1).double(), 0.9).item()


def _align_family(ctx: Context, model_type: str) -> dict[str, Any]:
    """archon vs HF in fp32 and in bf16 on one packed batch, all logits against HF in fp32."""
    from archon.build import build_model
    from archon.tools.align import _compare_logits, _hf_forward, packed_batch

    device = ctx.device
    path = _tiny_checkpoint(ctx, model_type, f"align-{model_type}")
    seq_lens = ctx.sizes.align_seq_lens
    hf32 = _hf_model(path, torch.float32, device)
    seqs, tokens, positions, cu_seqlens = packed_batch(seq_lens, hf32.config.get_text_config().vocab_size, ctx.seed)
    seqs = [s.to(device) for s in seqs]
    packed = (tokens.to(device), positions.to(device), cu_seqlens.to(device), max(seq_lens))

    def archon_logits(dtype: torch.dtype) -> torch.Tensor:
        model = build_model(path, dtype=dtype, device=device).model.eval()
        with torch.no_grad():
            return model(*packed).float()

    with torch.no_grad():
        reference = _hf_forward(hf32, seqs)
    del hf32
    fp32_max, fp32_kl = _compare_logits(archon_logits(torch.float32), reference)
    max_tol, kl_tol = _align_tolerances()
    report: dict[str, Any] = {
        "tokens": int(tokens.numel()),
        "fp32_max_abs_logits_diff": fp32_max,
        "fp32_mean_kl": fp32_kl,
    }
    with torch.no_grad():
        hf_bf16 = _hf_forward(_hf_model(path, torch.bfloat16, device), seqs).float()
    archon_bf16 = archon_logits(torch.bfloat16)
    hf_max, hf_kl = _compare_logits(hf_bf16, reference)
    archon_max, archon_kl = _compare_logits(archon_bf16, reference)
    hf_p90, archon_p90 = _p90_token_error(hf_bf16, reference), _p90_token_error(archon_bf16, reference)
    report.update(
        hf_bf16_max_abs_logits_diff=hf_max,
        hf_bf16_p90_abs_logits_diff=hf_p90,
        hf_bf16_mean_kl=hf_kl,
        bf16_max_abs_logits_diff=archon_max,
        bf16_p90_abs_logits_diff=archon_p90,
        bf16_mean_kl=archon_kl,
    )
    report["pass"] = (
        fp32_max <= max_tol
        and fp32_kl <= kl_tol
        and archon_p90 <= BF16_FACTOR * hf_p90 + BF16_ABS_LOGITS
        and archon_kl <= BF16_FACTOR**2 * hf_kl + BF16_ABS_KL
    )
    return report


# ---- 2. LoRA train step ------------------------------------------------------------------------------


def _nll_loss(batch, logprobs, ctx):
    """Mean negative log-likelihood of the completion tokens."""
    return -(logprobs * batch.loss_mask).sum() / ctx.global_tokens, {}


def _train_batch(vocab: int, seq_lens: tuple[int, ...], seed: int):
    from archon.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in seq_lens]
    return PackedBatch.from_sequences(seqs, prompt_lens=[max(1, n // 3) for n in seq_lens])


def _engine(ctx: Context, path: Path, dtype: str, lora_rank: int, lr: float, micro_batch_tokens: int, parallel=None):
    from archon.lora import LoRAConfig
    from archon.parallel import ParallelConfig
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, target_modules="all-linear")
    return Trainer(
        TrainerConfig(
            model_path=str(path),
            lora=lora,
            dtype=dtype,
            device=ctx.device.type,
            optim=OptimConfig(lr=lr, max_grad_norm=1.0),
            micro_batch_tokens=micro_batch_tokens,
            seed=ctx.seed,
            parallel=parallel or ParallelConfig(),
        )
    )


def check_train(ctx: Context) -> dict[str, Any]:
    families = _run_parts(
        ctx, "train", {kind: functools.partial(_train_family, ctx, t) for kind, t in TRAIN_FAMILIES.items()}
    )
    for kind, model_type in TRAIN_FAMILIES.items():
        families[kind].setdefault("model_type", model_type)
    return {
        "pass": all(r["pass"] for r in families.values()),
        "loss_rtol_bf16_vs_fp32": TRAIN_BF16_LOSS_RTOL,
        "families": families,
    }


def _train_family(ctx: Context, model_type: str) -> dict[str, Any]:
    sizes = ctx.sizes
    path = _tiny_checkpoint(ctx, model_type, f"train-{model_type}", **_overrides_for(model_type, sizes.train_overrides))
    batch = _train_batch(_vocab(path), sizes.train_seq_lens, ctx.seed)
    dtype = "bfloat16"
    trainer = _engine(ctx, path, dtype, sizes.lora_rank, sizes.train_lr, batch.num_tokens)
    losses, grad_norms, nonfinite = [], [], []
    with count_varlen_calls() as varlen:
        for step in range(sizes.train_steps):
            metrics = trainer.forward_backward(batch, _nll_loss)
            bad = [
                n
                for n, p in trainer.model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            nonfinite += [f"step {step}: {n}" for n in bad]
            grad_norms.append(trainer.optimizer_step()["grad_norm"])
            losses.append(metrics["loss"])
    del trainer
    _release(ctx)
    fp32_first = _engine(ctx, path, "float32", sizes.lora_rank, sizes.train_lr, batch.num_tokens)
    fp32_loss = fp32_first.forward_backward(batch, _nll_loss)["loss"]
    del fp32_first

    loss_rel_diff = abs(losses[0] - fp32_loss) / abs(fp32_loss)
    falls = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    varlen_ok = varlen["calls"] > 0 or not ctx.cuda  # CPU has no flash varlen kernel
    return {
        "model_type": model_type,
        "dtype": dtype,
        "tokens": batch.num_tokens,
        "sequences": batch.num_sequences,
        "losses": losses,
        "grad_norms": grad_norms,
        "fp32_first_loss": fp32_loss,
        "first_loss_rel_diff": loss_rel_diff,
        "nonfinite_grads": nonfinite[:10],
        "varlen_attention_calls": varlen["calls"],
        "loss_falls": falls,
        "pass": falls
        and not nonfinite
        and loss_rel_diff <= TRAIN_BF16_LOSS_RTOL
        and varlen_ok
        and all(math.isfinite(g) for g in grad_norms),
    }


def _overrides_for(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The size overrides that the family's HF config has fields for."""
    from transformers import AutoConfig

    known = AutoConfig.for_model(model_type).to_dict()
    return {k: v for k, v in overrides.items() if k in known}


def _vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


# ---- 3. generation -----------------------------------------------------------------------------------


def check_generation(ctx: Context) -> dict[str, Any]:
    families = _run_parts(ctx, "generation", {t: functools.partial(_generation_family, ctx, t) for t in GEN_FAMILIES})
    return {"pass": all(r["pass"] for r in families.values()), "logprob_atol": LOGPROB_ATOL, "families": families}


def _generation_family(ctx: Context, model_type: str) -> dict[str, Any]:
    from archon.batch import PackedBatch
    from archon.build import build_model
    from archon.lora import lora_parameters
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    device, new_tokens = ctx.device, ctx.sizes.gen_max_new_tokens
    path = _tiny_checkpoint(ctx, model_type, f"gen-{model_type}")

    # Greedy: archon's KV-cached decoding against HF generate, both fp32 on this device.
    model = build_model(path, device=device).model.eval()
    samples = NativeRolloutEngine(model, device).generate(
        GEN_PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=0)
    )
    del model
    hf = _hf_model(path, torch.float32, device)
    hf_tokens = []
    with torch.no_grad():
        for prompt in GEN_PROMPTS:
            out = hf.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            hf_tokens.append(out[0, len(prompt) :].tolist())
    del hf
    archon_tokens = [s.completion_ids for s in samples]
    greedy_equal = archon_tokens == hf_tokens

    # Sampled: the rollout's log-probs against the trainer's on the same tokens, with a live adapter.
    trainer = _engine(ctx, path, "float32", ctx.sizes.lora_rank, 1e-3, 1 << 20)
    g = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():
        for p in lora_parameters(trainer.model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, n=2, seed=ctx.seed + 3)
    sampled = NativeRolloutEngine(trainer.model, device).generate(GEN_PROMPTS, sampling)
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in sampled], prompt_lens=[len(s.prompt_ids) for s in sampled]
    )
    trainer = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout = torch.tensor([lp for s in sampled for lp in s.logprobs])
    logprob_diff = (trainer - rollout).abs().max().item()
    return {
        "greedy_tokens_equal_hf": greedy_equal,
        "archon_greedy": archon_tokens,
        "hf_greedy": hf_tokens,
        "sampled_tokens": int(rollout.numel()),
        "max_abs_logprob_diff_vs_engine": logprob_diff,
        "pass": greedy_equal and logprob_diff <= LOGPROB_ATOL,
    }


# ---- 4. memory ---------------------------------------------------------------------------------------


def _load_peak_allocated():
    """tests/memory_tracking.py's PeakAllocated: storage bytes that tensors hold (CPU included)."""
    spec = importlib.util.spec_from_file_location("memory_tracking", REPO_ROOT / "tests" / "memory_tracking.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PeakAllocated


def _peak_bytes(ctx: Context, run: Callable[[], Any]) -> int:
    """Peak bytes allocated while run() runs, above what was allocated before: on CUDA
    torch.cuda.max_memory_allocated, on the CPU the storage its tensors hold (tests/memory_tracking.py)."""
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device)
        run()
        torch.cuda.synchronize(ctx.device)
        return torch.cuda.max_memory_allocated(ctx.device) - before
    with _load_peak_allocated()() as tracker:
        run()
    return tracker.peak


def _head_peak_bytes(ctx: Context, T: int, chunked: bool) -> int:
    """Peak bytes allocated by one forward and backward of the label log-prob head over T tokens."""
    from archon.head import label_logprobs

    sizes, device = ctx.sizes, ctx.device
    V, D, dtype = sizes.memory_vocab, sizes.memory_dim, sizes.memory_dtype
    g = torch.Generator(device=device).manual_seed(ctx.seed)
    hidden = torch.randn(T, D, generator=g, device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=g, device=device, dtype=dtype) / math.sqrt(D)
    labels = torch.randint(0, V, (T,), generator=g, device=device)

    def run():
        if chunked:
            lp, _ = label_logprobs(hidden, weight, labels, chunk_size=sizes.memory_chunk)
        else:
            lp = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, labels[:, None])[:, 0]
        lp.sum().backward()

    return _peak_bytes(ctx, run)


def check_memory(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    small_T, large_T = sizes.memory_tokens
    V, D = sizes.memory_vocab, sizes.memory_dim
    _head_peak_bytes(ctx, small_T, True)  # warm-up: library workspaces are not the head's
    small = _head_peak_bytes(ctx, small_T, True)
    large = _head_peak_bytes(ctx, large_T, True)
    unchunked_small = _head_peak_bytes(ctx, small_T, False)
    _release(ctx)
    full_logits_large = large_T * V * 4
    # What may grow with T is O(T x D) (per-token fp32 directions and the hidden-state gradient):
    # at most four fp32 [T, D] tensors, as the CPU test allows.
    growth_bound = large_T * D * 4 * 4
    meter_sees_logits = unchunked_small >= small_T * V * 4
    return {
        "meter": "torch.cuda.max_memory_allocated" if ctx.cuda else "storage bytes (tests/memory_tracking.py)",
        "vocab": V,
        "dim": D,
        "dtype": str(sizes.memory_dtype),
        "chunk_size": sizes.memory_chunk,
        "tokens": [small_T, large_T],
        "peak_mb": [small / 2**20, large / 2**20],
        "growth_mb": (large - small) / 2**20,
        "growth_bound_mb": growth_bound / 2**20,
        "full_fp32_logits_mb_at_large": full_logits_large / 2**20,
        "unchunked_peak_mb_at_small": unchunked_small / 2**20,
        "pass": large <= small + growth_bound and large < full_logits_large / 4 and meter_sees_logits,
    }


# ---- 5. throughput -----------------------------------------------------------------------------------


def matmul_peak_flops(ctx: Context, dtype: torch.dtype) -> float:
    """Best FLOP/s of a square matmul in `dtype` on this device (8192 on CUDA, 256 on CPU)."""
    n = 8192 if ctx.cuda else 256
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    for _ in range(3):
        a @ b
    ctx.synchronize()
    best = math.inf
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        ctx.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def throughput_lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` lengths spread on a log scale over an 8x range, shuffled, summing to `total`."""
    raw = [8 ** (i / (count - 1)) for i in range(count)]
    lengths = [max(2, int(total * r / sum(raw))) for r in raw]
    lengths[-1] += total - sum(lengths)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return [lengths[i] for i in order]


def train_step_flops(config: dict[str, Any], lengths: list[int], loss_tokens: int, lora_rank: int) -> float:
    """Model FLOPs of one LoRA train step (matmuls and attention; frozen base weights).

    Frozen weights cost forward + input gradient (4 per weight per token), LoRA factors also their
    weight gradient (6). Causal attention is 2*L^2*H*hd per layer forward, x3 with backward. The
    head (frozen) runs on the loss tokens only.
    """
    D, I, H, KV, hd, layers, V = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    linear = D * H * hd * 2 + D * KV * hd * 2 + 3 * D * I
    lora = lora_rank * ((D + H * hd) * 2 + (D + KV * hd) * 2 + 3 * (D + I))
    flops = sum(lengths) * layers * (4 * linear + 6 * lora)
    flops += 3 * sum(2 * n * n * H * hd for n in lengths) * layers
    flops += loss_tokens * 4 * D * V
    return float(flops)


def _random_checkpoint(
    ctx: Context, config_kwargs: dict[str, Any], dtype: torch.dtype, name: str, model_type: str = "qwen3"
) -> Path:
    """An HF checkpoint with HF's own random init, made on this device (fast at 2B params)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(ctx.seed)
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out = ctx.workdir / name
    model.save_pretrained(out)
    return out


def _pg_loss(mb, logprobs, lctx):
    """Token-level policy gradient: -sum(A * log p) / #completion tokens."""
    return -(logprobs * mb.advantages * mb.loss_mask).sum() / lctx.global_tokens, {}


def _pg_batch(ctx: Context, vocab: int, lengths: list[int]):
    """Random sequences of `lengths`, each a throughput_prompt_len-token prompt and a completion with
    a random advantage."""
    from archon.batch import PackedBatch

    g = torch.Generator().manual_seed(ctx.seed)
    return PackedBatch.from_sequences(
        [torch.randint(0, vocab, (n,), generator=g) for n in lengths],
        prompt_lens=[ctx.sizes.throughput_prompt_len] * len(lengths),
        advantages=torch.randn(len(lengths), generator=g).tolist(),
    )


def check_throughput(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    dtype = getattr(torch, sizes.throughput_dtype)
    peak = matmul_peak_flops(ctx, dtype)
    start = time.perf_counter()
    path = _random_checkpoint(ctx, sizes.throughput_config, dtype, "throughput-qwen3")
    _release(ctx)
    checkpoint_s = time.perf_counter() - start
    lengths = throughput_lengths(sizes.throughput_tokens, sizes.throughput_sequences, ctx.seed)
    batch = _pg_batch(ctx, sizes.throughput_config["vocab_size"], lengths)
    start = time.perf_counter()
    trainer = _engine(ctx, path, sizes.throughput_dtype, sizes.lora_rank, 1e-5, batch.num_tokens)
    load_s = time.perf_counter() - start

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with count_varlen_calls() as varlen:
        trainer.train_step(batch, _pg_loss)  # warm-up
        ctx.synchronize()
        start = time.perf_counter()
        losses = [trainer.train_step(batch, _pg_loss)["loss"] for _ in range(sizes.throughput_steps)]
        ctx.synchronize()
        step_s = (time.perf_counter() - start) / sizes.throughput_steps
    flops = train_step_flops(sizes.throughput_config, lengths, batch.num_loss_tokens, sizes.lora_rank)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.trainable)
    del trainer
    _release(ctx)
    expect_varlen = ctx.cuda and dtype in (torch.bfloat16, torch.float16)
    return {
        "config": {**sizes.throughput_config, "lora_rank": sizes.lora_rank, "dtype": sizes.throughput_dtype},
        "params": params,
        "trainable_params": trainable,
        "tokens_per_step": batch.num_tokens,
        "sequences": len(lengths),
        "max_seqlen": max(lengths),
        "loss_tokens": batch.num_loss_tokens,
        "step_s": step_s,
        "tokens_per_s": batch.num_tokens / step_s,
        "model_tflop_per_step": flops / 1e12,
        "achieved_tflop_s": flops / step_s / 1e12,
        "matmul_peak_tflop_s": peak / 1e12,
        "mfu": flops / step_s / peak,
        "peak_memory_gb": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None,
        "checkpoint_s": checkpoint_s,
        "load_s": load_s,
        "losses": losses,
        "varlen_attention_calls": varlen["calls"],
        "pass": all(math.isfinite(x) for x in losses) and (varlen["calls"] > 0 or not expect_varlen),
    }


# ---- 6. MoE ------------------------------------------------------------------------------------------

# Grouped experts against the loop over experts, on the same device and inputs: the largest error of
# the output and of each gradient relative to that tensor's largest magnitude. fp32 differs only in
# summation order; bf16 output roundings (2^-8 relative) may differ between the two.
MOE_GROUPED_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


def moe_train_step_flops(config: dict[str, Any], lengths: list[int], loss_tokens: int, lora_rank: int) -> float:
    """Model FLOPs of one MoE LoRA train step with LoRA on attention and the routed experts (frozen
    base weights): attention projections, the router, the top-k experts each token goes to, causal
    attention and the head on the loss tokens, counted as in `train_step_flops`."""
    D, H, KV, hd, layers, V = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    E, k, I = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    attention = D * H * hd * 2 + D * KV * hd * 2
    experts = k * 3 * D * I
    lora = lora_rank * ((D + H * hd) * 2 + (D + KV * hd) * 2) + k * lora_rank * ((D + 2 * I) + (I + D))
    flops = sum(lengths) * layers * (4 * (attention + experts + D * E) + 6 * lora)
    flops += 3 * sum(2 * n * n * H * hd for n in lengths) * layers
    flops += loss_tokens * 4 * D * V
    return float(flops)


def _set_grouped(model: torch.nn.Module, grouped: bool) -> None:
    from archon.models.common.moe import GroupedExperts

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grouped_mm = grouped


def _grouped_vs_loop(ctx: Context, dtype: str) -> dict[str, Any]:
    """One expert layer of the MoE config (with LoRA, B non-zero) on routed random tokens: the grouped
    path against the loop, forward and backward, and whether grouped GEMM really ran."""
    import torch.nn.functional as F

    from archon.lora import LoRAConfig
    from archon.models.common.moe import GroupedExperts, SoftmaxTopKRouter

    config = ctx.sizes.moe_config
    D, E, k = config["hidden_size"], config["num_experts"], config["num_experts_per_tok"]
    I = config["moe_intermediate_size"]
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    with torch.device(ctx.device):
        router = SoftmaxTopKRouter(D, E, k, norm_topk_prob=True)
        experts = GroupedExperts(E, D, I, LoRAConfig(rank=ctx.sizes.lora_rank, alpha=2.0 * ctx.sizes.lora_rank))
    with torch.no_grad():
        for param in (*router.parameters(), *experts.parameters()):
            param.copy_(torch.randn(param.shape, generator=g, device=ctx.device) / math.sqrt(param.shape[-1]))
    experts.to(getattr(torch, dtype))
    tokens = ctx.sizes.throughput_tokens // 4
    x = torch.randn(tokens, D, generator=g, device=ctx.device, dtype=getattr(torch, dtype))
    with torch.no_grad():
        top_weights, top_indices = router(x.float())
    grad_out = torch.randn(x.shape, generator=g, device=ctx.device, dtype=x.dtype)
    results = {}
    calls = {"grouped_mm": 0}
    original = F.grouped_mm

    def counted(*args, **kwargs):
        calls["grouped_mm"] += 1
        return original(*args, **kwargs)

    for grouped in (True, False):
        experts.grouped_mm = grouped
        experts.zero_grad(set_to_none=True)
        x_in = x.detach().requires_grad_()
        F.grouped_mm = counted
        try:
            out = experts(x_in, top_weights.to(x.dtype), top_indices)
            out.backward(grad_out)
        finally:
            F.grouped_mm = original
        grads = {name: p.grad.float() for name, p in experts.named_parameters() if p.grad is not None}
        results[grouped] = {"output": out.detach().float(), "input_grad": x_in.grad.float(), **grads}
    errors = {
        name: float((results[True][name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        for name, ref in results[False].items()
    }
    worst = max(errors.values())
    return {
        "dtype": dtype,
        "tokens": tokens,
        "compared": sorted(errors),
        "max_rel_err": worst,
        "grouped_mm_calls": calls["grouped_mm"],
        "pass": worst <= MOE_GROUPED_RTOL[dtype]
        and calls["grouped_mm"] > 0
        and results[True].keys() == results[False].keys(),
    }


def _moe_steps(ctx: Context, trainer, batch, loss_fn, steps: int) -> tuple[float, list[float]]:
    trainer.train_step(batch, loss_fn)  # warm-up
    ctx.synchronize()
    start = time.perf_counter()
    losses = [trainer.train_step(batch, loss_fn)["loss"] for _ in range(steps)]
    ctx.synchronize()
    return (time.perf_counter() - start) / steps, losses


def check_moe(ctx: Context) -> dict[str, Any]:
    from archon.batch import PackedBatch
    from archon.lora import LoRAConfig
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    sizes = ctx.sizes
    parity = {dtype: _grouped_vs_loop(ctx, dtype) for dtype in ("float32", "bfloat16")}
    _release(ctx)
    dtype = getattr(torch, sizes.throughput_dtype)
    peak = matmul_peak_flops(ctx, dtype)
    path = _random_checkpoint(ctx, sizes.moe_config, dtype, "moe-qwen3_moe", model_type="qwen3_moe")
    _release(ctx)
    lengths = throughput_lengths(sizes.throughput_tokens, sizes.throughput_sequences, ctx.seed)
    g = torch.Generator().manual_seed(ctx.seed)
    batch = PackedBatch.from_sequences(
        [torch.randint(0, sizes.moe_config["vocab_size"], (n,), generator=g) for n in lengths],
        prompt_lens=[sizes.throughput_prompt_len] * len(lengths),
        advantages=torch.randn(len(lengths), generator=g).tolist(),
    )
    lora = LoRAConfig(
        rank=sizes.lora_rank,
        alpha=2.0 * sizes.lora_rank,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
    )
    trainer = Trainer(
        TrainerConfig(
            model_path=str(path),
            lora=lora,
            dtype=sizes.throughput_dtype,
            device=ctx.device.type,
            optim=OptimConfig(lr=1e-5, max_grad_norm=1.0),
            micro_batch_tokens=batch.num_tokens,
            seed=ctx.seed,
        )
    )

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    grouped_s, losses = _moe_steps(ctx, trainer, batch, _pg_loss, sizes.throughput_steps)
    peak_memory_gb = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    _set_grouped(trainer.model, False)
    loop_s, loop_losses = _moe_steps(ctx, trainer, batch, _pg_loss, sizes.throughput_steps)
    flops = moe_train_step_flops(sizes.moe_config, lengths, batch.num_loss_tokens, sizes.lora_rank)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.trainable)
    del trainer
    _release(ctx)
    return {
        "config": {**sizes.moe_config, "lora_rank": sizes.lora_rank, "dtype": sizes.throughput_dtype},
        "params": params,
        "trainable_params": trainable,
        "tokens_per_step": batch.num_tokens,
        "step_s": grouped_s,
        "tokens_per_s": batch.num_tokens / grouped_s,
        "model_tflop_per_step": flops / 1e12,
        "achieved_tflop_s": flops / grouped_s / 1e12,
        "matmul_peak_tflop_s": peak / 1e12,
        "mfu": flops / grouped_s / peak,
        "loop_step_s": loop_s,
        "grouped_speedup_over_loop": loop_s / grouped_s,
        "peak_memory_gb": peak_memory_gb,
        "losses": losses,
        "loop_losses": loop_losses,
        "grouped_vs_loop": parity,
        "pass": all(math.isfinite(x) for x in losses + loop_losses) and all(p["pass"] for p in parity.values()),
    }


# ---- 7. activation offload ---------------------------------------------------------------------------

# The first forward-backward with offload against the one without, on the same weights and tokens:
# the copies are exact, so on the CPU the gradients are equal; CUDA's attention backward may add in
# another order from one run to the next, so there the largest gradient difference, relative to the
# gradient's largest magnitude, is held to a few bf16 roundoffs.
OFFLOAD_GRAD_RTOL = 2e-2


def _offload_run(ctx: Context, path: Path, batch, offload: bool) -> dict[str, Any]:
    """One run's first forward-backward (loss, LoRA gradients) and timed train steps. Offload comes
    from `parallel.activation_offload` on CUDA and is forced on the CPU; without it the same hooks
    only count the saved activations."""
    from archon.lora import is_lora_param
    from archon.parallel import ParallelConfig, apply_activation_offload

    sizes = ctx.sizes
    parallel = ParallelConfig(activation_offload=offload and ctx.cuda)
    trainer = _engine(ctx, path, sizes.throughput_dtype, sizes.lora_rank, 1e-5, batch.num_tokens, parallel)
    if offload and ctx.cuda:
        hooks = trainer.model.activation_offload
    else:
        hooks = apply_activation_offload(
            trainer.model.layers, offload=offload, offload_host_tensors=not ctx.cuda, min_bytes=sizes.offload_min_bytes
        )
    with torch.no_grad():  # B non-zero, so every factor has a gradient
        g = torch.Generator().manual_seed(ctx.seed)
        for name, param in trainer.model.named_parameters():
            if is_lora_param(name):
                param.copy_((torch.randn(param.shape, generator=g) * 0.02).to(param.dtype))
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    first = trainer.forward_backward(batch, _pg_loss)
    stats = dict(vars(hooks.stats))
    grads = {name: p.grad.float().cpu() for name, p in trainer.model.named_parameters() if is_lora_param(name)}
    for p in trainer.trainable:
        p.grad = None
    times = []
    for _ in range(sizes.offload_steps):
        ctx.synchronize()
        start = time.perf_counter()
        trainer.train_step(batch, _pg_loss)
        ctx.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    del trainer, hooks
    _release(ctx)
    return {
        "loss": first["loss"],
        "grads": grads,
        "stats": stats,
        "step_s": sorted(times)[len(times) // 2],
        "peak_memory_bytes": peak,
    }


def check_offload(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    dtype = getattr(torch, sizes.throughput_dtype)
    path = _random_checkpoint(ctx, sizes.offload_config, dtype, "offload-qwen3")
    _release(ctx)
    lengths = throughput_lengths(sizes.offload_tokens, sizes.offload_sequences, ctx.seed)
    batch = _pg_batch(ctx, sizes.offload_config["vocab_size"], lengths)
    plain = _offload_run(ctx, path, batch, offload=False)
    offloaded = _offload_run(ctx, path, batch, offload=True)
    grad_rel_diff = max(
        ((offloaded["grads"][name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        for name, g in plain["grads"].items()
    )
    grads_equal = all(torch.equal(offloaded["grads"][name], g) for name, g in plain["grads"].items())
    stats = offloaded["stats"]
    saved_peak_ratio = stats["peak_resident_bytes"] / plain["stats"]["peak_resident_bytes"]
    result = {
        "config": {**sizes.offload_config, "lora_rank": sizes.lora_rank, "dtype": sizes.throughput_dtype},
        "tokens": batch.num_tokens,
        "sequences": len(lengths),
        "min_bytes": sizes.offload_min_bytes,
        "tensors_offloaded_per_step": stats["tensors_offloaded"],
        "bytes_offloaded_per_step": stats["bytes_offloaded"],
        "saved_peak_bytes": {"plain": plain["stats"]["peak_resident_bytes"], "offload": stats["peak_resident_bytes"]},
        "saved_peak_ratio": saved_peak_ratio,
        "step_s": {"plain": plain["step_s"], "offload": offloaded["step_s"]},
        "step_time_ratio": offloaded["step_s"] / plain["step_s"],
        "loss": {"plain": plain["loss"], "offload": offloaded["loss"]},
        "grads_equal": grads_equal,
        "grad_max_rel_diff": grad_rel_diff,
    }
    passed = stats["tensors_offloaded"] > 0 and saved_peak_ratio < 1
    if ctx.cuda:
        memory_ratio = offloaded["peak_memory_bytes"] / plain["peak_memory_bytes"]
        result["peak_memory_gb"] = {
            "plain": plain["peak_memory_bytes"] / 2**30,
            "offload": offloaded["peak_memory_bytes"] / 2**30,
        }
        result["peak_memory_ratio"] = memory_ratio
        passed = passed and memory_ratio < 1 and grad_rel_diff <= OFFLOAD_GRAD_RTOL
    else:
        passed = passed and grads_equal and offloaded["loss"] == plain["loss"]
    result["pass"] = passed
    return result


# ---- 8. chunked prefill ------------------------------------------------------------------------------


def check_prefill(ctx: Context) -> dict[str, Any]:
    from archon.build import build_model
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    sizes = ctx.sizes
    path = _tiny_checkpoint(ctx, "qwen3", "prefill-qwen3", **sizes.prefill_config)
    model = build_model(path, device=ctx.device).model.eval()
    args = model.args
    g = torch.Generator().manual_seed(ctx.seed)
    prompt = torch.randint(0, args.vocab_size, (sizes.prefill_tokens,), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=sizes.gen_max_new_tokens, temperature=0)
    NativeRolloutEngine(model, ctx.device).generate([prompt[:64]], sampling)  # warm-up: library workspaces
    runs = {}
    for name, budget in (("one_shot", None), ("chunked", sizes.prefill_chunk)):
        _release(ctx)
        engine = NativeRolloutEngine(model, ctx.device, prefill_chunk_tokens=budget)
        samples = []
        start = time.perf_counter()
        run = lambda: samples.extend(engine.generate([prompt], sampling))  # noqa: E731
        peak = _peak_bytes(ctx, run) if ctx.cuda else run()
        runs[name] = {
            "sample": samples[0],
            "peak": peak,
            "generate_seconds": time.perf_counter() - start,
            "forwards": engine.stats.prefill_forwards,
            "largest": engine.stats.max_prefill_forward_tokens,
        }
    del model
    _release(ctx)
    one_shot, chunked = runs["one_shot"], runs["chunked"]
    tokens_equal = one_shot["sample"].completion_ids == chunked["sample"].completion_ids
    gap = max(abs(a - b) for a, b in zip(one_shot["sample"].logprobs, chunked["sample"].logprobs))
    # both runs hold the same cache: keys and values of every layer for the prompt and the new tokens
    kv_cache = (
        args.num_hidden_layers
        * 2
        * args.num_key_value_heads
        * args.head_dim
        * 4
        * (sizes.prefill_tokens + sizes.gen_max_new_tokens)
    )
    peaks = [one_shot["peak"], chunked["peak"]] if ctx.cuda else None
    return {
        "meter": "torch.cuda.max_memory_allocated" if ctx.cuda else None,
        "prompt_tokens": sizes.prefill_tokens,
        "prefill_chunk_tokens": sizes.prefill_chunk,
        "dtype": "float32",
        "prefill_forwards": [one_shot["forwards"], chunked["forwards"]],
        "largest_forward_tokens": [one_shot["largest"], chunked["largest"]],
        "peak_mb": [p / 2**20 for p in peaks] if peaks else None,
        "peak_ratio_chunked_to_one_shot": peaks[1] / peaks[0] if peaks else None,
        "kv_cache_mb": kv_cache / 2**20,
        "generate_seconds": [one_shot["generate_seconds"], chunked["generate_seconds"]],
        "greedy_tokens_equal": tokens_equal,
        "max_abs_logprob_diff": gap,
        "pass": tokens_equal
        and gap <= LOGPROB_ATOL
        and chunked["largest"] <= sizes.prefill_chunk
        and chunked["forwards"] == -(-sizes.prefill_tokens // sizes.prefill_chunk)
        and (peaks is None or peaks[1] < peaks[0]),
    }


# ---- 9. quantized bases ------------------------------------------------------------------------------


def check_quantized(ctx: Context) -> dict[str, Any]:
    formats = _run_parts(
        ctx, "quantized", {f: functools.partial(_quantized_format, ctx, f) for f in ctx.sizes.quantized_models}
    )
    return {
        "pass": all(r["pass"] for r in formats.values()),
        "loss_rtol_kept_vs_dequantized": QUANTIZED_LOSS_RTOL,
        "formats": formats,
    }


def _quantized_format(ctx: Context, fmt_name: str) -> dict[str, Any]:
    """One format: its checkpoint kept quantized and dequantized at load, each trained and sampled."""
    from archon.quant import QuantFormat
    from archon.quant.export import quantize_checkpoint

    sizes = ctx.sizes
    model_type, overrides = sizes.quantized_models[fmt_name]
    fmt = QuantFormat("fp8", sizes.quantized_fp8_block) if fmt_name == "fp8" else QuantFormat("mxfp4", (1, 32))
    source = _tiny_checkpoint(ctx, model_type, f"quantized-{fmt_name}-source", **overrides)
    path = quantize_checkpoint(source, ctx.workdir / f"quantized-{fmt_name}", fmt)
    _release(ctx)
    lengths = throughput_lengths(sizes.throughput_tokens, sizes.throughput_sequences, ctx.seed)
    batch = _pg_batch(ctx, _vocab(path), lengths)
    runs = {base: _quantized_run(ctx, path, batch, base) for base in ("keep", "dequantize")}
    kept, dense = runs["keep"], runs["dequantize"]
    loss_rel_diff = abs(kept["losses"][0] - dense["losses"][0]) / abs(dense["losses"][0])
    tokens_equal = kept["greedy"] == dense["greedy"]
    result = {
        "model_type": model_type,
        "format": str(fmt),
        "dtype": "bfloat16",
        "tokens_per_step": batch.num_tokens,
        "base_param_bytes": {"kept": kept["base_bytes"], "bf16": dense["base_bytes"]},
        "base_param_bytes_ratio": kept["base_bytes"] / dense["base_bytes"],
        "step_s": {"kept": kept["step_s"], "bf16": dense["step_s"]},
        "step_time_ratio": kept["step_s"] / dense["step_s"],
        "losses": {"kept": kept["losses"], "bf16": dense["losses"]},
        "first_loss_rel_diff": loss_rel_diff,
        "lora_grads_checked": kept["lora_grads_checked"],
        "bad_lora_grads": kept["bad_lora_grads"][:10],
        "greedy_tokens_equal": tokens_equal,
        "greedy_kept": kept["greedy"],
    }
    passed = (
        all(math.isfinite(x) for x in kept["losses"] + dense["losses"])
        and not kept["bad_lora_grads"]
        and kept["lora_grads_checked"] > 0
        and loss_rel_diff <= QUANTIZED_LOSS_RTOL
        and tokens_equal
        and kept["base_bytes"] < dense["base_bytes"]
    )
    if ctx.cuda:
        result["peak_memory_gb"] = {"kept": kept["peak_bytes"] / 2**30, "bf16": dense["peak_bytes"] / 2**30}
        # reported, not held: at these sizes the activations of 16K tokens outweigh the base, and the
        # kept base adds the dequantized local experts of one projection while its GEMM runs
        result["peak_memory_ratio"] = kept["peak_bytes"] / dense["peak_bytes"]
    result["pass"] = passed
    return result


def _quantized_run(ctx: Context, path: Path, batch, base: str) -> dict[str, Any]:
    """A bf16 LoRA trainer on `path` with model.quantized_base = `base`: greedy tokens of the built-in
    engine with a non-zero adapter, then the first forward-backward's LoRA gradients, and timed steps."""
    from archon.lora import LoRAConfig, is_lora_param
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    sizes = ctx.sizes
    lora = LoRAConfig(rank=sizes.lora_rank, alpha=2.0 * sizes.lora_rank, target_modules="all-linear")
    trainer = Trainer(
        TrainerConfig(
            model_path=str(path),
            lora=lora,
            dtype="bfloat16",
            device=ctx.device.type,
            quantized_base=base,
            optim=OptimConfig(lr=1e-5, max_grad_norm=1.0),
            micro_batch_tokens=batch.num_tokens,
            seed=ctx.seed,
        )
    )
    base_bytes = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if not is_lora_param(n))
    with torch.no_grad():  # B non-zero, so every factor has a gradient and the adapter changes the tokens
        g = torch.Generator().manual_seed(ctx.seed)
        for name, param in trainer.model.named_parameters():
            if is_lora_param(name):
                param.copy_((torch.randn(param.shape, generator=g) * 0.02).to(param.dtype))
    greedy = NativeRolloutEngine(trainer.model, ctx.device).generate(
        GEN_PROMPTS, SamplingParams(max_new_tokens=sizes.gen_max_new_tokens, temperature=0)
    )
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    losses = [trainer.forward_backward(batch, _pg_loss)["loss"]]
    lora_grads = {name: p.grad for name, p in trainer.model.named_parameters() if is_lora_param(name)}
    bad = [
        name
        for name, grad in lora_grads.items()
        if grad is None or not bool(torch.isfinite(grad).all()) or not bool(grad.abs().sum() > 0)
    ]
    trainer.optimizer_step()
    step_s, more = _moe_steps(ctx, trainer, batch, _pg_loss, sizes.throughput_steps)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    del trainer
    _release(ctx)
    return {
        "base_bytes": base_bytes,
        "greedy": [s.completion_ids for s in greedy],
        "losses": losses + more,
        "lora_grads_checked": len(lora_grads),
        "bad_lora_grads": bad,
        "step_s": step_s,
        "peak_bytes": peak,
    }


# ---- 10. rollout systems -----------------------------------------------------------------------------


def check_rollout_systems(ctx: Context) -> dict[str, Any]:
    runs = {"replay": _replay_part, "speculative": _speculative_part, "partial": _partial_part}
    parts = _run_parts(ctx, "rollout_systems", {name: functools.partial(run, ctx) for name, run in runs.items()})
    return {"pass": all(r["pass"] for r in parts.values()), "parts": parts}


def _replay_part(ctx: Context) -> dict[str, Any]:
    """Routing replay across precisions: the built-in engine samples (and records its routing) with
    a bf16 copy of the policy, the trainer scores in fp32 with and without the recorded experts.
    bf16 moves the routers' scores, so some tokens' top-k flips between the two; with replay the
    trainer routes as the sampler did and its log-probs are nearer the sampler's. Held: on the tokens
    whose routing flipped, the replayed gap is below the gap without replay; elsewhere it is equal."""
    import copy

    from archon.lora import lora_parameters
    from archon.models.common.moe import moe_routers, recorded_routing, take_recorded
    from archon.rl.rollouts import rollout_batch
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import ROUTED_EXPERTS_EXTRA

    sizes = ctx.sizes
    config = {k: v for k, v in sizes.moe_config.items() if k != "num_hidden_layers"}
    path = _tiny_checkpoint(ctx, "qwen3_moe", "replay", num_hidden_layers=2, **config)
    trainer = _engine(ctx, path, "float32", sizes.lora_rank, 1e-3, 1 << 20)
    g = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():
        for p in lora_parameters(trainer.model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    sampler = copy.deepcopy(trainer.model).to(torch.bfloat16).eval()
    prompts = [torch.randint(0, _vocab(path), (n,), generator=g).tolist() for n in (17, 5, 64, 33)]
    sampling = SamplingParams(max_new_tokens=sizes.gen_max_new_tokens * 4, temperature=1.0, n=4, seed=ctx.seed)
    samples = NativeRolloutEngine(sampler, ctx.device, record_routing=True).generate(prompts, sampling)
    del sampler
    _release(ctx)
    batch = rollout_batch(samples, torch.zeros(len(samples)), trainer_version=0, routed_experts=True)
    recorded = batch.extras[ROUTED_EXPERTS_EXTRA]
    replayed = trainer.logprobs(batch).logprobs
    batch.extras.pop(ROUTED_EXPERTS_EXTRA)
    own = trainer.logprobs(batch).logprobs
    # which tokens the fp32 trainer routes differently on its own (any layer, as sets of experts)
    routers = moe_routers(trainer.model)
    with torch.no_grad(), recorded_routing(trainer.model):
        trainer.model(
            batch.tokens.to(ctx.device),
            batch.positions.to(ctx.device),
            batch.cu_seqlens.to(ctx.device),
            batch.max_seqlen,
        )
        own_ids = take_recorded(routers)
    flipped_token = (own_ids.sort(-1).values.cpu() != recorded.long().sort(-1).values).any(-1).any(-1)
    # position t's log-prob (of the label t+1) reads positions <= t: a flip at any of them counts
    mask = batch.loss_mask
    rollout = batch.rollout_logprobs
    gap_replay, gap_own = (replayed - rollout).abs(), (own - rollout).abs()
    flipped_before = torch.zeros_like(mask)
    for start, end in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
        flipped_before[start:end] = flipped_token[start:end].long().cumsum(0) > 0
    affected = mask & flipped_before
    unaffected = mask & ~flipped_before
    result = {
        "sampler_dtype": "bfloat16",
        "trainer_dtype": "float32",
        "tokens": int(mask.sum()),
        "tokens_routed_differently": int(flipped_token.sum()),
        "scored_tokens_after_a_flip": int(affected.sum()),
        "mean_gap_after_a_flip": {
            "replay": float(gap_replay[affected].mean()) if affected.any() else None,
            "own": float(gap_own[affected].mean()) if affected.any() else None,
        },
        "max_gap_no_flip": {"replay": float(gap_replay[unaffected].max()), "own": float(gap_own[unaffected].max())},
    }
    result["pass"] = bool(
        torch.isfinite(replayed[mask]).all()
        and torch.equal(replayed[unaffected], own[unaffected])
        and (not affected.any() or gap_replay[affected].mean() < gap_own[affected].mean())
    )
    return result


def _speculative_part(ctx: Context) -> dict[str, Any]:
    """Speculative decoding on this device: greedy tokens equal plain decoding's (a dense Qwen3 whose
    plain decode step is captured in a CUDA graph on CUDA, drafted by itself; a DeepSeek-V3 with an
    MTP layer drafting), and sampled tokens' log-probs equal the trainer's. Random weights make the
    MTP drafts mostly wrong; acceptance and tok/s are reported, not held."""
    import copy
    import importlib

    from archon.batch import PackedBatch
    from archon.build import build_model
    from archon.lora import lora_parameters
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.rollout.speculative import DraftModelDrafter, MTPDrafter

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    add_mtp_weights = importlib.import_module("helpers").add_mtp_weights
    new_tokens = ctx.sizes.gen_max_new_tokens * 4
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    result: dict[str, Any] = {}

    def timed(engine, sampling):
        ctx.synchronize()
        start = time.perf_counter()
        samples = engine.generate(GEN_PROMPTS, sampling)
        ctx.synchronize()
        return samples, sum(len(s.completion_ids) for s in samples) / (time.perf_counter() - start)

    dense = build_model(_tiny_checkpoint(ctx, "qwen3", "spec-qwen3"), device=ctx.device).model.eval()
    plain_engine = NativeRolloutEngine(dense, ctx.device)
    plain, plain_tps = timed(plain_engine, greedy)
    self_drafted = NativeRolloutEngine(dense, ctx.device, drafter=DraftModelDrafter(dense, 3))
    drafted, drafted_tps = timed(self_drafted, greedy)
    result["qwen3_self_draft"] = {
        "greedy_tokens_equal": [s.completion_ids for s in drafted] == [s.completion_ids for s in plain],
        "acceptance": self_drafted.stats.speculative_accepted / max(1, self_drafted.stats.speculative_proposed),
        "tokens_per_s": {"plain": plain_tps, "speculative": drafted_tps},
    }
    del dense, plain_engine, self_drafted
    _release(ctx)

    path = add_mtp_weights(_tiny_checkpoint(ctx, "deepseek_v3", "spec-deepseek"), "num_nextn_predict_layers")
    trainer = _engine(ctx, path, "float32", ctx.sizes.lora_rank, 1e-3, 1 << 20)
    mtp_model = build_model(path, device=ctx.device, mtp=True).model.eval()
    plain, plain_tps = timed(NativeRolloutEngine(mtp_model, ctx.device), greedy)
    mtp_engine = NativeRolloutEngine(mtp_model, ctx.device, drafter=MTPDrafter(mtp_model, 2))
    drafted, drafted_tps = timed(mtp_engine, greedy)
    # sampled with a draft model the target often accepts (its own base), scored by the trainer
    g = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():
        for p in lora_parameters(trainer.model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    draft = copy.deepcopy(mtp_model)
    draft.mtp = torch.nn.ModuleList()
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, n=2, seed=ctx.seed)
    sampled_engine = NativeRolloutEngine(trainer.model, ctx.device, drafter=DraftModelDrafter(draft, 3))
    sampled = sampled_engine.generate(GEN_PROMPTS, sampling)
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in sampled], prompt_lens=[len(s.prompt_ids) for s in sampled]
    )
    scored = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    gap = float((scored - torch.tensor([lp for s in sampled for lp in s.logprobs])).abs().max())
    result["deepseek_v3_mtp"] = {
        "greedy_tokens_equal": [s.completion_ids for s in drafted] == [s.completion_ids for s in plain],
        "acceptance": mtp_engine.stats.speculative_accepted / max(1, mtp_engine.stats.speculative_proposed),
        "tokens_per_s": {"plain": plain_tps, "speculative": drafted_tps},
        "sampled_acceptance": sampled_engine.stats.speculative_accepted
        / max(1, sampled_engine.stats.speculative_proposed),
        "sampled_max_abs_logprob_diff_vs_trainer": gap,
    }
    result["pass"] = (
        result["qwen3_self_draft"]["greedy_tokens_equal"]
        and result["qwen3_self_draft"]["acceptance"] == 1.0
        and result["deepseek_v3_mtp"]["greedy_tokens_equal"]
        and gap <= LOGPROB_ATOL
    )
    return result


def _partial_part(ctx: Context) -> dict[str, Any]:
    """Partial rollouts on the built-in engine: adapter versions 1 and 2 published (from another
    thread) while a generation runs, each after a given decode step; every token carries the version
    that sampled it, and its log-prob is the trainer's under that version. Versions 1 and 2 change
    only the last layer's MLP factors, so what the engine cached under an earlier version is what
    the trainer computes, and the comparison is exact."""
    import threading

    from archon.lora import lora_parameters
    from archon.rl.rollouts import rollout_batch
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine, _Generation

    trainer = _engine(ctx, _tiny_checkpoint(ctx, "qwen3", "partial"), "float32", ctx.sizes.lora_rank, 1e-3, 1 << 20)
    params = lora_parameters(trainer.model)
    last = len(trainer.model.layers) - 1
    g = torch.Generator().manual_seed(ctx.seed)
    versions = {0: {n: (torch.randn(p.shape, generator=g) * 0.3).to(p.device) for n, p in params.items()}}
    for version in (1, 2):
        versions[version] = {
            n: (
                torch.randn(t.shape, generator=g).to(t.device) * 0.3
                if n.startswith(f"layers.{last}.") and ".mlp." in n
                else t
            )
            for n, t in versions[version - 1].items()
        }
    publish_after, new_tokens = (5, 11), 18
    reached = [threading.Event() for _ in publish_after]
    published = [threading.Event() for _ in publish_after]
    decode, steps = _Generation._decode, [0]

    def decode_then_hold(self, busy):
        decode(self, busy)
        steps[0] += 1
        if steps[0] in publish_after:
            reached[publish_after.index(steps[0])].set()
            published[publish_after.index(steps[0])].wait(120)

    engine = NativeRolloutEngine(trainer.model, ctx.device)
    engine.update_adapter(0, versions[0])
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=2, seed=ctx.seed)
    out: dict[str, Any] = {}
    _Generation._decode = decode_then_hold
    try:
        thread = threading.Thread(target=lambda: out.setdefault("samples", engine.generate(GEN_PROMPTS, sampling)))
        thread.start()
        for k, version in enumerate((1, 2)):
            if not reached[k].wait(300):
                raise RuntimeError(f"the generation did not reach decode step {publish_after[k]}")
            engine.update_adapter(version, versions[version])
            published[k].set()
        thread.join(300)
    finally:
        _Generation._decode = decode
        for event in published:
            event.set()
    samples = out["samples"]
    expected = [0] * (publish_after[0] + 1) + [1] * (publish_after[1] - publish_after[0])
    expected += [2] * (new_tokens - len(expected))
    versions_exact = all(s.token_versions == expected for s in samples)
    batch = rollout_batch(samples, torch.zeros(len(samples)), trainer_version=2)
    token_version = 2 - batch.extras["version_lag"]
    gaps = {}
    for version, factors in versions.items():
        engine.update_adapter(version, factors)
        at = batch.loss_mask & (token_version == version)
        scored = trainer.logprobs(batch, 1.0).logprobs
        gaps[version] = float((scored[at] - batch.rollout_logprobs[at]).abs().max())
    return {
        "token_versions_exact": versions_exact,
        "max_abs_logprob_diff_per_version": gaps,
        "pass": versions_exact and all(gap <= LOGPROB_ATOL for gap in gaps.values()),
    }


def check_tinker(ctx: Context) -> dict[str, Any]:
    """A Qwen3 served by archon.serve on the device, driven through the tinker SDK over loopback."""
    import tinker

    from archon.serve.config import ServeConfig
    from archon.serve.server import start_server

    path = _tiny_checkpoint(ctx, "qwen3", "tinker_base")
    config = ServeConfig(base_model=str(path), port=0, api_key="tml-gpu-suite", device=str(ctx.device))
    config.checkpoint_dir = str(ctx.workdir / "tinker_checkpoints")
    server = start_server(config)
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-gpu-suite")
        client = service.create_lora_training_client(base_model=str(path), rank=8, seed=ctx.seed).result()
        tokens = torch.randint(_vocab(path), (33,), generator=torch.Generator().manual_seed(ctx.seed)).tolist()
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32},
        )
        losses = []
        for _ in range(3):
            step = client.forward_backward([datum], "cross_entropy")
            client.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
            losses.append(step.result().metrics["loss:sum"])
        sampler = client.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints(tokens[:8])
        sample = sampler.sample(prompt, 2, tinker.types.SamplingParams(max_tokens=8, seed=ctx.seed)).result()
        gap = 0.0
        for sequence in sample.sequences:
            scored = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(tokens[:8] + sequence.tokens)).result()
            gap = max(gap, max(abs(a - b) for a, b in zip(sequence.logprobs, scored[8:])))
        service.close("success").result()
    finally:
        server.shutdown()
        server.server_close()
    return {
        "pass": losses[-1] < losses[0] and gap <= LOGPROB_ATOL and all(len(s.tokens) == 8 for s in sample.sequences),
        "losses": losses,
        "max_sampled_logprob_diff": gap,
    }


# ---- driver ------------------------------------------------------------------------------------------

CHECK_FNS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "alignment": check_alignment,
    "train": check_train,
    "generation": check_generation,
    "memory": check_memory,
    "throughput": check_throughput,
    "moe": check_moe,
    "offload": check_offload,
    "prefill": check_prefill,
    "quantized": check_quantized,
    "rollout_systems": check_rollout_systems,
    "tinker": check_tinker,
}


def environment(ctx: Context) -> dict[str, Any]:
    import transformers

    from archon.models.common.attention import _varlen_takes_enable_gqa

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(ctx.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "varlen_takes_enable_gqa": _varlen_takes_enable_gqa(),
    }
    try:
        import peft

        env["peft"] = peft.__version__
    except ImportError:
        env["peft"] = None
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(
            gpu=props.name,
            gpu_memory_gb=props.total_memory / 2**30,
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
        )
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def run_suite(args: SuiteArgs) -> dict[str, Any]:
    unknown = [name for name in args.only if name not in CHECKS + OPT_IN_CHECKS]
    if unknown:
        raise ValueError(
            f"--only names unknown check(s) {', '.join(unknown)}; expected some of {', '.join(CHECKS + OPT_IN_CHECKS)}"
        )
    if args.tiny:
        device, sizes = torch.device("cpu"), TINY
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the full suite needs a CUDA device (torch.cuda.is_available() is False); "
                "run with --tiny for the CPU-sized checks"
            )
        device, sizes = torch.device("cuda", 0), FULL
        torch.cuda.set_device(device)
        # fp32 means fp32 (no TF32), whatever the environment asks for: the fp32 checks hold
        # archon to 1e-4 of HF.
        torch.set_float32_matmul_precision("highest")
    selected = args.only or CHECKS
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp:
        ctx = Context(device=device, sizes=sizes, seed=args.seed, workdir=Path(tmp))
        result: dict[str, Any] = {"mode": "tiny-cpu" if args.tiny else "cuda", "environment": environment(ctx)}
        log.info("environment: %s", result["environment"])
        checks: dict[str, Any] = {}
        for name in selected:
            log.info("---- %s", name)
            start = time.perf_counter()
            try:
                checks[name] = CHECK_FNS[name](ctx)
            except Exception as exc:
                log.error("%s failed:\n%s", name, traceback.format_exc())
                checks[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                _release(ctx)
            checks[name]["seconds"] = round(time.perf_counter() - start, 2)
            log.info("%s: %s", name, "PASS" if checks[name]["pass"] else "FAIL")
    result["checks"] = checks
    result["pass"] = all(c["pass"] for c in checks.values())
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def _json_default(value):
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def main(argv: list[str] | None = None) -> int:
    import tyro

    from archon.checkpoint.atomic import atomic_write_json

    args = tyro.cli(SuiteArgs, args=argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    handlers = [logging.FileHandler(out / "gpu_suite.log", mode="w"), logging.StreamHandler(sys.stderr)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", handlers=handlers, force=True)
    log.info("gpu_suite %s", asdict(args))
    try:
        result = run_suite(args)
    except (ValueError, RuntimeError) as exc:  # bad arguments, or no CUDA without --tiny
        log.error("gpu_suite: %s", exc)
        return 2
    line = json.dumps(result, default=_json_default)
    atomic_write_json(out / "gpu_suite.json", json.loads(line))
    log.info("wrote %s", out / "gpu_suite.json")
    print(line, flush=True)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
