#!/usr/bin/env python3
"""Golden runs for refactoring: record short real runs, then check that a changed tree reproduces
them bit for bit on the same machine and arithmetic.

    .ci/golden_runs.py record .cache/golden.json     # before the change
    .ci/golden_runs.py check .cache/golden.json      # after each commit
    .ci/golden_runs.py check-old .cache/golden.json  # a change that adds metrics: the old ones unchanged

Four runs through `torchrun recipes/grpo_lora.py` on two ranks of one thread each: the demo
shortened to 6 steps, a two-task run on the demo base, the code-tool demo shortened to 3 steps, and
the demo with context parallelism over the two ranks. Each run keeps every numeric value of every
`metrics.jsonl` record except timings and memory, the sorted set of metric keys, and a SHA-256 of
every file under the run's adapter exports. A check compares them for exact equality (floats as
their repr) and names the first run, step and key that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo_lora.py"
# values that measure the machine, not the math
MACHINE_KEYS = ("_s", "idle_fraction", "time", "memory", "rss", "_mb", "_gb")
COMMON = ["--logging.no-progress", "--overwrite"]


def _two_task_config(run_dir: Path, work: Path) -> list[str]:
    """Two tasks (addition twice, with different seeds for their data order) on the demo base."""
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rl.config import load_config_file
    from archon.rl.demo import prepare_demo

    config = load_config_file(DEMO_CONFIG)
    files = prepare_demo(config.demo, config.parallel, config.seed, rank=0, log=lambda message: None)
    tasks = "".join(
        f"  - name: {name}\n    data: {{path: {files.train_path}, seed: {seed}}}\n"
        f"    eval_path: {files.held_out_path}\n    reward: {{function: exact, num_workers: 0}}\n"
        f"    lora: {{rank: {rank}, alpha: 32.0}}\n    algorithm: {{name: grpo, minibatches: 2}}\n"
        "    optim: {lr: 0.002, max_grad_norm: 1.0}\n"
        for name, seed, rank in (("first", 1, 16), ("second", 2, 8))
    )
    path = work / "two_tasks.yaml"
    path.write_text(
        f"steps: 4\nseed: 5\nmodel: {{path: {files.model_dir}, device: cpu}}\n"
        "rollout: {group_size: 4, prompts_per_step: 8, max_new_tokens: 5}\n"
        f"eval: {{every: 4, max_prompts: 16}}\nlogging: {{run_dir: {run_dir}}}\ntasks:\n{tasks}"
    )
    return ["--config", str(path)]


def _runs(work: Path) -> dict[str, list[str]]:
    demo = ["--steps", "6", "--eval.every", "3", "--eval.max-prompts", "16", "--checkpoint.every", "3"]
    return {
        "demo": demo + ["--logging.run-dir", str(work / "demo")],
        "two_tasks": _two_task_config(work / "two_tasks", work),
        "code_tool": [
            "--config",
            str(ROOT / "recipes/configs/code_tool_demo.yaml"),
            "--steps",
            "3",
            "--eval.every",
            "3",
            "--eval.max-prompts",
            "8",
            "--logging.run-dir",
            str(work / "code_tool"),
        ],
        "cp2": demo + ["--parallel.cp", "2", "--logging.run-dir", str(work / "cp2")],
    }


def _run(name: str, args: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RECIPE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd + args + COMMON, env=env, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(
            f"golden run {name!r} failed (rc {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    records = []
    keys = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        keys.update(record)
        records.append(
            {
                k: repr(v)
                for k, v in sorted(record.items())
                if isinstance(v, (int, float)) and not k.endswith(MACHINE_KEYS)
            }
        )
    hashes = {}
    for path in sorted(run_dir.rglob("*.safetensors")):
        if "checkpoints" in path.parts:
            continue  # DCP shards and optimizer state: the adapter exports say the same
        hashes[str(path.relative_to(run_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    if not hashes:
        raise SystemExit(f"golden run {name!r} wrote no adapter under {run_dir}")
    return {"records": records, "keys": sorted(keys), "adapters": hashes}


def collect() -> dict:
    with tempfile.TemporaryDirectory(prefix="golden_") as tmp:
        work = Path(tmp)
        results = {}
        for name, args in _runs(work).items():
            print(f"golden run {name} ...", flush=True)
            results[name] = _run(name, args, work / name)
        return results


def _first_difference(want: dict, got: dict, new_keys_allowed: bool = False) -> str | None:
    for name in want:
        if name not in got:
            return f"{name}: missing"
        w, g = want[name], got[name]
        if new_keys_allowed:
            added = set(g["keys"]) - set(w["keys"])
            if added:
                print(f"{name}: new metric keys (not compared): {sorted(added)}")
            g = {
                **g,
                "keys": w["keys"],
                "records": [{k: v for k, v in r.items() if k not in added} for r in g["records"]],
            }
        if w["keys"] != g["keys"]:
            return (
                f"{name}: metric keys differ: only before {sorted(set(w['keys']) - set(g['keys']))}, "
                f"only after {sorted(set(g['keys']) - set(w['keys']))}"
            )
        if len(w["records"]) != len(g["records"]):
            return f"{name}: {len(w['records'])} records before, {len(g['records'])} after"
        for i, (rw, rg) in enumerate(zip(w["records"], g["records"])):
            for key in sorted(set(rw) | set(rg)):
                if rw.get(key) != rg.get(key):
                    return (
                        f"{name}: record {i} (step {rw.get('step')}), {key!r}: "
                        f"{rw.get(key)} before, {rg.get(key)} after"
                    )
        if w["adapters"] != g["adapters"]:
            return f"{name}: adapter files differ: {w['adapters']} before, {g['adapters']} after"
    return None


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "check", "check-old"):
        raise SystemExit(__doc__)
    path = Path(sys.argv[2])
    results = collect()
    if sys.argv[1] == "record":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        print(f"recorded {sum(len(r['records']) for r in results.values())} records of {len(results)} runs in {path}")
        return
    difference = _first_difference(json.loads(path.read_text()), results, sys.argv[1] == "check-old")
    if difference:
        raise SystemExit(f"golden runs differ: {difference}")
    print(f"golden runs: all {len(results)} bit-identical to {path}")


if __name__ == "__main__":
    main()
