"""Training-step benchmark: archon LoRA on packed sequences vs HF transformers + PEFT on padded ones.

    python benchmarks/train_step.py [--steps 3] [--threads 2] [--repeats 5]

Both train the same random-weight Qwen3 (hidden 512, 4 layers, 8 heads, 4 KV heads, intermediate
1536, vocab 32000, fp32) with LoRA r=16 on all linear layers, on the same RL-shaped batch: 16
sequences of 64-256 tokens (log-spaced), each a 32-token prompt and a completion, with a
token-level policy-gradient loss on the completions. HF needs the batch padded to the longest
sequence; archon packs it.

Each measurement runs in its own process, so each peak RSS is its own:
    archon_lora    archon LoRA: one warm-up and `steps` timed train steps, then one profiled step
    hf_peft        HF + PEFT LoRA: the same
    archon_full    archon full-parameter training on the same batch and settings (no profile)
    lora_vs_full   archon LoRA and full-parameter trainers in one process, one step of each a
                   round, alternated: the LoRA / full step-time ratio (LoRA skips the base
                   weights' gradients, about a third of a step's matmul FLOPs)
    *_mem          LoRA and full-parameter steps on a wider model whose weights dominate memory
                   (254M parameters, ~1 GB fp32; 2 x 128 tokens, activation checkpointing)
archon_lora and hf_peft, whose tokens/s make the headline ratio, run alternately
(benchmarks/arms.py): after `warmup` rounds, `repeats` rounds of one process each, the order
reversed every other round; so do lora_vs_full's steps. Each ratio is the median of the rounds'
ratios, reported with their min and max; a verdict is printed only when the rounds agree
(arms.SPREAD_BOUND). archon_full and the *_mem measurements run once each (their figures are
memory and a tokens/s printed for reference, not a timing ratio). Peak RSS is sampled during the
train steps (loading excluded). Useful FLOPs count real (non-pad) tokens only and are compared
with the fp32 matmul peak measured in the same run. The CPU, its instruction set, the threads and
the load averages before and after are reported: on a shared machine other work perturbs the
timings. The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Measure the checkout this script belongs to, whatever an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arms import (  # noqa: E402
    MIN_REPEATS,
    Ratio,
    RatioSummary,
    check_repeats,
    describe,
    median_figures,
    run_arms,
    speed_verdict,
    verdict_line,
)

MODEL_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# Weights-dominated model for the LoRA / full fine-tuning memory ratio (254M parameters).
MEMORY_MODEL_CONFIG = dict(
    MODEL_CONFIG,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
)
MEMORY_BATCH = dict(sequences=2, length=128)
NUM_SEQUENCES = 16
MIN_LEN, MAX_LEN = 64, 256
PROMPT_LEN = 32
LORA_RANK, LORA_ALPHA = 16, 32.0
LR = 1e-4


@dataclass
class BenchArgs:
    steps: int = 3
    """Timed train steps per framework (after one warm-up step)."""
    threads: int = 2
    """Intra-op threads for every measurement."""
    seed: int = 0
    repeats: int = MIN_REPEATS
    """Measured rounds of alternated arms (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    role: str = "main"
    """Internal: which measurement this process makes."""
    checkpoint: str = ""
    """Internal: the HF checkpoint directory."""
    memory_checkpoint: str = ""
    """Internal: the HF checkpoint of the weights-dominated model."""


def _rss_mb() -> float:
    """Current resident set size (Linux /proc; psutil elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def anon_rss_mb() -> float:
    """Anonymous resident memory (heap, stacks, tensors) of this process: the resident set less its
    file-backed and shared pages (/proc/self/statm), the RssAnon of /proc/self/status. Under memory
    pressure the kernel evicts file-backed pages (shared libraries, mmap'd checkpoints) from the
    resident set at any time; without swap, anonymous memory stays, so this does not move with
    the machine's other jobs."""
    _, resident, shared = (int(v) for v in Path("/proc/self/statm").read_text().split()[:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _lifetime_peak_rss_mb() -> float:
    """Peak RSS of this process image (VmHWM is per address space, so it starts afresh at exec;
    ru_maxrss would include the parent's peak from before the exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class PeakRSS:
    """Peak RSS while a block runs, sampled every 5 ms from a thread (the kernel's own
    high-water mark is only updated lazily, so it can miss a peak that has been freed again).
    `anonymous`: count anonymous memory only (`anon_rss_mb`, Linux), which the eviction of
    file-backed pages under memory pressure does not move.

    Heap memory freed before the block (e.g. while loading, whose checkpoint reads go through mmap)
    is first handed back to the OS, so the block is measured on its own."""

    def __init__(self, anonymous: bool = False) -> None:
        self._measure = anon_rss_mb if anonymous else _rss_mb

    def __enter__(self) -> "PeakRSS":
        import ctypes
        import gc
        import threading

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.start_mb = self.peak_mb = self._measure()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak_mb = max(self.peak_mb, self._measure())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._measure())


def sequence_lengths(seed: int) -> list[int]:
    """Lengths spread evenly on a log scale from MIN_LEN to MAX_LEN (RL responses skew short),
    shuffled; the longest is MAX_LEN, so HF pads everything to it."""
    import torch

    ratio = MAX_LEN / MIN_LEN
    lengths = [round(MIN_LEN * ratio ** (i / (NUM_SEQUENCES - 1))) for i in range(NUM_SEQUENCES)]
    order = torch.randperm(NUM_SEQUENCES, generator=torch.Generator().manual_seed(seed)).tolist()
    return [lengths[i] for i in order]


def make_sequences(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = sequence_lengths(seed)
    seqs = [torch.randint(0, MODEL_CONFIG["vocab_size"], (n,), generator=g) for n in lengths]
    advantages = torch.randn(NUM_SEQUENCES, generator=g).tolist()
    return seqs, advantages


def useful_flops(lengths: list[int], lora: bool) -> float:
    """FLOPs of one training step on the real tokens only (matmuls and attention).

    Frozen base weights cost forward + input-gradient (4 per weight per token); trained weights
    also their weight gradient (6). Attention is causal: 2*L^2*H*hd per layer forward, x3 with
    backward. The head runs on loss tokens only.
    """
    c = MODEL_CONFIG
    D, I, H, KV, hd, L, V = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    layer_linear = D * H * hd * 2 + D * KV * hd * 2 + 3 * D * I
    lora_params = LORA_RANK * ((D + H * hd) * 2 + (D + KV * hd) * 2 + 3 * (D + I))
    tokens = sum(lengths)
    loss_tokens = sum(n - PROMPT_LEN for n in lengths)
    base_factor = 4 if lora else 6
    flops = tokens * L * (base_factor * layer_linear + (6 * lora_params if lora else 0))
    flops += 3 * sum(2 * n * n * H * hd for n in lengths) * L
    flops += loss_tokens * base_factor * D * V
    return float(flops)


def matmul_peak_flops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# ---- one process per measurement -------------------------------------------------------------------


def _archon_trainer(
    args: BenchArgs,
    lora: bool,
    activation_checkpoint: str = "none",
    micro_tokens: int = 8192,
    head_chunk: int = 1024,
    checkpoint: str | None = None,
    lora_targets="all-linear",
):
    from archon.lora import LoRAConfig
    from archon.parallel import ParallelConfig
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    return Trainer(
        TrainerConfig(
            model_path=checkpoint or args.checkpoint,
            lora=LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=lora_targets) if lora else None,
            parallel=ParallelConfig(activation_checkpoint=activation_checkpoint),
            optim=OptimConfig(lr=LR, max_grad_norm=1.0),
            device="cpu",
            micro_batch_tokens=micro_tokens,
            head_chunk_size=head_chunk,
            seed=args.seed,
        )
    )


def _pg_loss(batch, logprobs, ctx):
    """Token-level policy gradient: -sum(A * log p) / #completion tokens."""
    loss = -(logprobs * batch.advantages * batch.loss_mask).sum() / ctx.global_tokens
    return loss, {}


def _profile_breakdown(step) -> dict[str, float]:
    """Shares of one step's CPU time: by op kind (self time: matmul, attention, everything else),
    and the inclusive time of the log-prob head and of the optimizer step (these overlap the
    op kinds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    inclusive = {"head": 0.0, "optimizer": 0.0}
    for event in prof.key_averages():
        name, t = event.key, event.self_cpu_time_total
        if any(k == name for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")):
            kinds["matmul"] += t
        elif "attention" in name:
            kinds["attention"] += t
        else:
            kinds["other"] += t
        if name.startswith("_ChunkedLabelLogprobs"):
            inclusive["head"] += event.cpu_time_total
        elif name.startswith("Optimizer.step"):
            inclusive["optimizer"] += event.cpu_time_total
    total = sum(kinds.values()) or 1.0
    shares = {k: round(v / total, 3) for k, v in kinds.items()}
    shares.update({f"{k} (inclusive)": round(v / total, 3) for k, v in inclusive.items() if v})
    return shares


def run_archon(
    args: BenchArgs,
    lora: bool,
    timed: bool,
    memory_model: bool = False,
    profile: bool = True,
    prepare=None,
    **trainer_kw,
) -> dict:
    """One archon measurement; `prepare(model)` (if given) adjusts the built model before it is timed."""
    import torch
    import transformers  # noqa: F401  (libraries are imported before the baseline RSS is taken)

    import archon.trainer  # noqa: F401
    from archon.batch import PackedBatch
    from archon.build import load_hf_config

    load_hf_config(args.checkpoint)

    torch.set_num_threads(args.threads)
    seqs, advantages = make_sequences(args.seed)
    if memory_model:
        seqs = [s[: MEMORY_BATCH["length"]] for s in seqs if len(s) >= MEMORY_BATCH["length"]]
        seqs, advantages = seqs[: MEMORY_BATCH["sequences"]], advantages[: MEMORY_BATCH["sequences"]]
        trainer_kw["checkpoint"] = args.memory_checkpoint
    baseline = _rss_mb()
    trainer = _archon_trainer(args, lora, **trainer_kw)
    if prepare is not None:
        prepare(trainer.model)
    batch = PackedBatch.from_sequences(seqs, prompt_lens=[PROMPT_LEN] * len(seqs), advantages=advantages)
    with PeakRSS() as rss:
        if timed:
            trainer.train_step(batch, _pg_loss)  # warm-up
        steps = args.steps if timed else 1
        start = time.perf_counter()
        losses = [trainer.train_step(batch, _pg_loss)["loss"] for _ in range(steps)]
        elapsed = time.perf_counter() - start
    out = {
        "tokens_per_step": batch.num_tokens,
        "step_s": elapsed / steps,
        "tok_s": batch.num_tokens * steps / elapsed,
        "losses": losses,
        "baseline_rss_mb": baseline,
        "after_load_rss_mb": rss.start_mb,
        "peak_rss_mb": rss.peak_mb,
        "lifetime_peak_rss_mb": _lifetime_peak_rss_mb(),
        "trainable_params": sum(p.numel() for p in trainer.trainable),
    }
    if timed and profile:
        out["time_by_op"] = _profile_breakdown(lambda: trainer.train_step(batch, _pg_loss))
    return out


def run_hf_peft(args: BenchArgs, model_kwargs: dict | None = None, lora_kwargs: dict | None = None) -> dict:
    """HF + PEFT LoRA; `model_kwargs` go to from_pretrained, `lora_kwargs` replace the LoraConfig targets."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    seqs, advantages = make_sequences(args.seed)
    baseline = _rss_mb()
    model = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, dtype=torch.float32, attn_implementation="sdpa", **(model_kwargs or {})
    )
    targets = lora_kwargs or dict(target_modules="all-linear")
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, **targets))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)

    # Right-padded [B, L] batch with the attention mask HF needs; the loss covers completion tokens.
    B, L = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
        attention_mask[i, : len(s)] = 1
    labels = input_ids[:, 1:]
    loss_mask = attention_mask[:, 1:].bool().clone()
    loss_mask[:, : PROMPT_LEN - 1] = False
    adv = torch.tensor(advantages)[:, None].expand(B, L - 1)

    def step() -> float:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None])[..., 0]
        loss = -(logprobs * adv * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    with PeakRSS() as rss:
        step()
        start = time.perf_counter()
        losses = [step() for _ in range(args.steps)]
        elapsed = time.perf_counter() - start
    real_tokens = sum(len(s) for s in seqs)
    return {
        "tokens_per_step": real_tokens,
        "padded_tokens_per_step": B * L,
        "step_s": elapsed / args.steps,
        "tok_s": real_tokens * args.steps / elapsed,
        "losses": losses,
        "baseline_rss_mb": baseline,
        "after_load_rss_mb": rss.start_mb,
        "peak_rss_mb": rss.peak_mb,
        "lifetime_peak_rss_mb": _lifetime_peak_rss_mb(),
        "trainable_params": sum(p.numel() for p in trainable),
        "time_by_op": _profile_breakdown(step),
    }


def run_lora_vs_full(args: BenchArgs) -> dict:
    import torch

    from archon.batch import PackedBatch

    torch.set_num_threads(args.threads)
    seqs, advantages = make_sequences(args.seed)
    batch = PackedBatch.from_sequences(seqs, prompt_lens=[PROMPT_LEN] * len(seqs), advantages=advantages)
    trainers = {"lora": _archon_trainer(args, lora=True), "full": _archon_trainer(args, lora=False)}

    def step_arm(trainer):
        def measure() -> float:
            start = time.perf_counter()
            trainer.train_step(batch, _pg_loss)
            return time.perf_counter() - start

        return measure

    for trainer in trainers.values():
        trainer.train_step(batch, _pg_loss)  # warm-up
    result = run_arms(
        {name: step_arm(trainer) for name, trainer in trainers.items()},
        [Ratio("lora_over_full_step_s", "lora", "full")],
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        progress=False,
    )
    return {
        "lora_step_s": result.median("lora"),
        "full_step_s": result.median("full"),
        "step_s_all": result.samples,
        "comparison": result.to_json(),
    }


MEMORY_SETTINGS = dict(activation_checkpoint="full", micro_tokens=512, head_chunk=128)
ROLES = {
    "archon_lora": lambda a: run_archon(a, lora=True, timed=True),
    "hf_peft": run_hf_peft,
    "archon_full": lambda a: run_archon(a, lora=False, timed=True, profile=False),
    "lora_vs_full": run_lora_vs_full,
    "archon_lora_mem": lambda a: run_archon(a, lora=True, timed=False, memory_model=True, **MEMORY_SETTINGS),
    "archon_full_mem": lambda a: run_archon(a, lora=False, timed=False, memory_model=True, **MEMORY_SETTINGS),
}


# ---- driver ----------------------------------------------------------------------------------------


def _measure(role: str, args: BenchArgs, script: str = __file__) -> dict:
    """Run `script --role role` in a fresh process and return the JSON it prints last."""
    cmd = [
        sys.executable,
        script,
        "--role",
        role,
        "--checkpoint",
        args.checkpoint,
        "--memory-checkpoint",
        args.memory_checkpoint,
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{role} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_checkpoint(out_dir: Path, seed: int, model_config: dict = MODEL_CONFIG, model_type: str = "qwen3") -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **model_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def main(args: BenchArgs) -> dict:
    check_repeats(args.repeats, quick=False)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = str(make_checkpoint(Path(tmp) / "qwen3", args.seed))
        args.memory_checkpoint = str(make_checkpoint(Path(tmp) / "qwen3-wide", args.seed, MEMORY_MODEL_CONFIG))
        peak = matmul_peak_flops(args.threads)
        comparison = run_arms(
            {role: (lambda role=role: _measure(role, args)) for role in ("archon_lora", "hf_peft")},
            [Ratio("archon_over_hf_peft_tok_s", "archon_lora", "hf_peft", "tok_s")],
            repeats=args.repeats,
            warmup=args.warmup,
            threads=args.threads,
        )
        results = {role: median_figures(comparison.samples[role]) for role in ("archon_lora", "hf_peft")}
        results |= {role: _measure(role, args) for role in ROLES if role not in results}
    speed = comparison.ratios["archon_over_hf_peft_tok_s"]
    print(describe(speed, "real tokens/s, archon LoRA / HF+PEFT"), flush=True)
    print(
        verdict_line(
            speed, speed_verdict(speed, "archon LoRA is faster", "archon LoRA is slower"), "archon LoRA vs HF+PEFT"
        ),
        flush=True,
    )
    lora_vs_full = RatioSummary.from_json(
        "lora_over_full_step_s", results["lora_vs_full"]["comparison"]["ratios"]["lora_over_full_step_s"]
    )
    print(describe(lora_vs_full, "step time, archon LoRA / full fine-tuning (one process, alternated)"), flush=True)
    print(
        verdict_line(
            lora_vs_full,
            speed_verdict(lora_vs_full, "the LoRA step is slower", "the LoRA step is faster"),
            "LoRA vs full fine-tuning step",
        ),
        flush=True,
    )
    seqs, _ = make_sequences(args.seed)
    lengths = [len(s) for s in seqs]
    archon, hf = results["archon_lora"], results["hf_peft"]
    flops = useful_flops(lengths, lora=True)
    lora_mem = results["archon_lora_mem"]
    full_mem = results["archon_full_mem"]

    def above_baseline(r):
        return r["peak_rss_mb"] - r["baseline_rss_mb"]

    summary = {
        "config": {
            **MODEL_CONFIG,
            "lora_rank": LORA_RANK,
            "threads": args.threads,
            "steps": args.steps,
            "sequences": NUM_SEQUENCES,
            "real_tokens": sum(lengths),
            "padded_tokens": hf["padded_tokens_per_step"],
        },
        "packing_bound": hf["padded_tokens_per_step"] / sum(lengths),
        "matmul_peak_gflop_s": peak / 1e9,
        "useful_gflop_per_step": flops / 1e9,
        "archon_useful_gflop_s": flops / archon["step_s"] / 1e9,
        "hf_peft_useful_gflop_s": flops / hf["step_s"] / 1e9,
        "archon_fraction_of_peak": flops / archon["step_s"] / peak,
        "hf_peft_fraction_of_peak": flops / hf["step_s"] / peak,
        "archon_time_by_op": archon["time_by_op"],
        "hf_peft_time_by_op": hf["time_by_op"],
        "archon_step_s": archon["step_s"],
        "hf_peft_step_s": hf["step_s"],
        "memory_setting": {
            **MEMORY_SETTINGS,
            **MEMORY_BATCH,
            "model": MEMORY_MODEL_CONFIG,
            "params": full_mem["trainable_params"],
        },
        "lora_mem_peak_rss_mb": lora_mem["peak_rss_mb"],
        "full_mem_peak_rss_mb": full_mem["peak_rss_mb"],
        "lora_over_full_peak_rss": lora_mem["peak_rss_mb"] / full_mem["peak_rss_mb"],
        "lora_over_full_above_baseline": above_baseline(lora_mem) / above_baseline(full_mem),
        "process_baseline_rss_mb": lora_mem["baseline_rss_mb"],
        "load_average_1m_start_end": [load_start, os.getloadavg()[0]],
        "archon_tok_s": archon["tok_s"],
        "hf_peft_tok_s": hf["tok_s"],
        "ratio": speed.median,
        "ratio_min": speed.min,
        "ratio_max": speed.max,
        "repeats": comparison.repeats,
        "verdict_allowed": comparison.verdict_allowed,
        "environment": comparison.environment,
        "comparison": comparison.to_json(),
        "archon_peak_rss_mb": archon["peak_rss_mb"],
        "hf_peft_peak_rss_mb": hf["peak_rss_mb"],
        "full_ft_tok_s": results["archon_full"]["tok_s"],
        "lora_over_full_step_s": lora_vs_full.median,
        "lora_over_full_step_s_min": lora_vs_full.min,
        "lora_over_full_step_s_max": lora_vs_full.max,
        "lora_vs_full_step_s": results["lora_vs_full"],
        "full_ft_peak_rss_mb": results["archon_full"]["peak_rss_mb"],
    }
    return summary


def _cli() -> None:
    import tyro

    args = tyro.cli(BenchArgs)
    if args.role != "main":
        print(json.dumps(ROLES[args.role](args)))
        return
    summary = main(args)
    print(
        f"real tokens/s (medians): archon LoRA {summary['archon_tok_s']:.0f}, HF+PEFT {summary['hf_peft_tok_s']:.0f}, "
        f"ratio {summary['ratio']:.2f} (min {summary['ratio_min']:.2f}, max {summary['ratio_max']:.2f} over "
        f"{summary['repeats']} rounds; packing alone bounds it near {summary['packing_bound']:.2f})"
    )
    print(
        f"useful GFLOP/s: archon {summary['archon_useful_gflop_s']:.1f}, HF+PEFT "
        f"{summary['hf_peft_useful_gflop_s']:.1f}; fp32 matmul peak {summary['matmul_peak_gflop_s']:.1f}"
    )
    print(f"archon time by op: {summary['archon_time_by_op']}; HF+PEFT: {summary['hf_peft_time_by_op']}")
    alternated = summary["lora_vs_full_step_s"]
    print(
        f"step time, alternated in one process: archon LoRA {alternated['lora_step_s']:.2f} s, full fine-tuning "
        f"{alternated['full_step_s']:.2f} s, LoRA / full = {summary['lora_over_full_step_s']:.2f} (min "
        f"{summary['lora_over_full_step_s_min']:.2f}, max {summary['lora_over_full_step_s_max']:.2f})"
    )
    print(
        f"peak RSS MB: archon LoRA {summary['archon_peak_rss_mb']:.0f}, HF+PEFT {summary['hf_peft_peak_rss_mb']:.0f}, "
        f"archon full-FT {summary['full_ft_peak_rss_mb']:.0f}"
    )
    print(
        f"weights-dominated model ({summary['memory_setting']['params'] / 1e6:.0f}M params): "
        f"LoRA {summary['lora_mem_peak_rss_mb']:.0f} MB vs "
        f"full {summary['full_mem_peak_rss_mb']:.0f} MB = {summary['lora_over_full_peak_rss']:.2f} "
        f"({summary['lora_over_full_above_baseline']:.2f} above the {summary['process_baseline_rss_mb']:.0f} MB "
        "process baseline)"
    )
    env = summary["environment"]
    print(
        f"{env['cpu_model']} ({env['cpu_capability']}), {env['threads']} threads; load average before "
        f"{env['load_average_before']}, after {env['load_average_after']}"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    _cli()
