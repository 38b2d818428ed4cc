"""Multi-LoRA: K tasks trained in one job on one base, against the same K tasks run one after
another as single-adapter jobs (the plain recipe), with the same model, steps and settings.

    python benchmarks/multi_lora.py [--tasks 4] [--steps 10] [--device cpu] [--repeats 5]

The base is the built-in demo's warm-started small Qwen3 (recipes/configs/demo.yaml, cached in
.cache/archon/demo); the tasks are arithmetic (2-digit +, -, *, 1-digit +, ...), each GRPO with its
own LoRA r=16 on every linear layer, `prompts_per_step` prompts x 8 samples a step, native rollouts.
Every job is a fresh process, so its peak memory is its own.

The two arms, the K-task job and the K single-task jobs one after another, run alternately
(benchmarks/arms.py): after `warmup` rounds, `repeats` rounds of each, the order reversed every
other round.

Reported (the last line printed is JSON):
    multi:      wall_s, steps_s (the RL steps only), peak_mb, samples_per_s of the K-task job
    sequential: the same summed over the K single-task jobs (peak_mb: the largest of them)
    wall_ratio        multi wall_s / sequential wall_s          (goal <= 0.5)
    peak_memory_ratio multi peak_mb / one single-task job's peak (goal <= 1.3)
Figures are medians over the rounds; each ratio is the median of the rounds' ratios, with their
min and max, and a verdict on a goal is printed only when the rounds agree (arms.SPREAD_BOUND).
peak_mb is the process's peak resident memory on CPU, the peak allocated device memory on an
accelerator. The CPU, its instruction set and the load averages before and after are reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arms import (  # noqa: E402
    MIN_REPEATS,
    Ratio,
    check_repeats,
    describe,
    goal_verdict,
    median_figures,
    run_arms,
    verdict_line,
)

GOALS = {"wall_ratio": 0.5, "peak_memory_ratio": 1.3}  # at most
TASK_SPECS = [
    ("add", ("+",), 2),
    ("sub", ("-",), 2),
    ("mul", ("*",), 2),
    ("add1", ("+",), 1),
    ("sub1", ("-",), 1),
    ("mul1", ("*",), 1),
]


@dataclass
class BenchArgs:
    tasks: int = 4
    """K: tasks in the multi-task job (and single-task jobs run one after another)."""
    steps: int = 10
    """RL steps of every job."""
    prompts_per_step: int = 16
    micro_batch_tokens: int = 768
    """Token budget of a forward/backward in every job: it bounds the activations' memory whatever
    the number of tasks in the batch. One task's minibatch here is about 600 tokens, so a
    single-task job trains each minibatch in one forward, and the K-task job (K times the tokens)
    in forwards of the same size; with a budget of K minibatches instead, the K-task job's
    activations, and so its peak memory, grow K-fold."""
    device: str = "cpu"
    repeats: int = MIN_REPEATS
    """Measured rounds of the alternated arms (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    out: str = "runs/multi_lora"
    worker: str | None = None
    """Internal: run one job from this config file and print its figures."""


def _task_data(out: Path, count: int) -> list[tuple[str, Path]]:
    from archon.rl.data.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

    if count > len(TASK_SPECS):
        raise SystemExit(f"--tasks {count}: at most {len(TASK_SPECS)} tasks are defined")
    data = []
    for name, operations, digits in TASK_SPECS[:count]:
        train, _ = arithmetic_splits(
            ArithmeticTaskConfig(
                operations=operations, min_digits=digits, max_digits=digits, num_train=90, num_held_out=0
            )
        )
        data.append((name, write_jsonl(train, out / f"{name}.jsonl")))
    return data


def _common(model_dir: Path, args: BenchArgs, run_dir: Path) -> str:
    return (
        f"steps: {args.steps}\nseed: 0\nmodel: {{path: {model_dir}, device: {args.device}}}\n"
        f"micro_batch_tokens: {args.micro_batch_tokens}\n"
        f"rollout: {{group_size: 8, prompts_per_step: {args.prompts_per_step}, max_new_tokens: 5}}\n"
        "eval: {every: 0}\ncheckpoint: {every: 0}\n"
        f"logging: {{run_dir: {run_dir}, backends: [], progress: false}}\noverwrite: true\n"
    )


TASK_SETTINGS = (
    "reward: {function: exact, num_workers: 0}",
    "lora: {rank: 16, alpha: 32.0}",
    "optim: {lr: 0.002, max_grad_norm: 1.0}",
    "algorithm: {name: grpo, minibatches: 2}",
)


def _single_config(model_dir, args, out, name, data) -> Path:
    path = out / f"single_{name}.yaml"
    settings = "\n".join(TASK_SETTINGS)
    path.write_text(_common(model_dir, args, out / f"single_{name}") + f"data: {{path: {data}}}\n{settings}\n")
    return path


def _multi_config(model_dir, args, out, tasks) -> Path:
    lines = ["tasks:"]
    for name, data in tasks:
        lines += [f"  - name: {name}", f"    data: {{path: {data}}}", *(f"    {s}" for s in TASK_SETTINGS)]
    path = out / "multi.yaml"
    path.write_text(_common(model_dir, args, out / "multi") + "\n".join(lines) + "\n")
    return path


def _worker(config_path: str) -> None:
    """One job in this process: its wall time (start-up included), the seconds of its RL steps,
    samples generated, and peak memory."""
    import resource

    import torch

    torch.set_num_threads(1)
    from archon.rl.config import parse_config

    start = time.perf_counter()
    config = parse_config(["--config", config_path])
    from archon.rl.loop import RLRun

    RLRun(config).run()
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (Path(config.logging.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps_s = sum(r["step_s"] for r in records if "step_s" in r)
    samples = config.steps * config.rollout.prompts_per_step * config.rollout.group_size * max(len(config.tasks), 1)
    if config.model.device.startswith("cuda"):
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"wall_s": wall, "steps_s": steps_s, "samples": samples, "peak_mb": peak_mb}))


def _job(config: Path) -> dict:
    result = subprocess.run([sys.executable, __file__, "--worker", str(config)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"job {config} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(args: BenchArgs) -> dict:
    from archon.demos.warm_start import prepare_demo
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rl.config import load_config_file

    check_repeats(args.repeats, quick=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = load_config_file(DEMO_CONFIG)
    files = prepare_demo(demo.demo, demo.parallel, demo.seed, rank=0)
    tasks = _task_data(out, args.tasks)
    single_configs = [_single_config(files.model_dir, args, out, name, data) for name, data in tasks]
    multi_config = _multi_config(files.model_dir, args, out, tasks)
    last_singles: list[dict] = []

    def sequential_arm() -> dict:
        singles = [_job(config) for config in single_configs]
        last_singles[:] = singles
        figures = {
            "wall_s": sum(s["wall_s"] for s in singles),
            "steps_s": sum(s["steps_s"] for s in singles),
            "samples": sum(s["samples"] for s in singles),
            "peak_mb": max(s["peak_mb"] for s in singles),
        }
        return figures | {"samples_per_s": figures["samples"] / figures["wall_s"]}

    def multi_arm() -> dict:
        figures = _job(multi_config)
        return figures | {"samples_per_s": figures["samples"] / figures["wall_s"]}

    ratios = [
        Ratio("wall_ratio", "multi", "sequential", "wall_s"),
        Ratio("steps_ratio", "multi", "sequential", "steps_s"),
        Ratio("peak_memory_ratio", "multi", "sequential", "peak_mb"),
    ]
    result = run_arms(
        {"sequential": sequential_arm, "multi": multi_arm}, ratios, repeats=args.repeats, warmup=args.warmup, threads=1
    )
    for name, summary in result.ratios.items():
        print(describe(summary), flush=True)
        if name in GOALS:
            print(verdict_line(summary, goal_verdict(summary, GOALS[name])), flush=True)
    report = {
        "tasks": args.tasks,
        "steps": args.steps,
        "device": args.device,
        "multi": median_figures(result.samples["multi"]),
        "sequential": median_figures(result.samples["sequential"]),
        "single_jobs": last_singles,
        **{name: summary.median for name, summary in result.ratios.items()},
        **{f"{name}_min": summary.min for name, summary in result.ratios.items()},
        **{f"{name}_max": summary.max for name, summary in result.ratios.items()},
        "goals": GOALS,
        "repeats": args.repeats,
        "verdict_allowed": result.verdict_allowed,
        "environment": result.environment,
        "comparison": result.to_json(),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    import tyro

    parsed = tyro.cli(BenchArgs)
    if parsed.worker is not None:
        _worker(parsed.worker)
    else:
        main(parsed)
