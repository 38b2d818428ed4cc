"""The fidelity guard's cost: the same GRPO run with rollout.fidelity.mode=stop (the default) and
with the guard off, on a tiny random Qwen3 with the built-in engine.

    python benchmarks/fidelity_guard.py [--steps 6] [--repeats 5] [--canary] [--quick]

Per token the guard reads the gaps the trainer's scoring computed anyway (one reduction over the
data-parallel ranks a step); with --canary (algorithm.recompute_old_logprobs=false, the bypass
mode) it also generates and scores a canary batch after each publish. The two arms run alternately
(benchmarks/arms.py): after a warm-up round, `repeats` rounds of each, the order reversed every
other round. The figure of an arm is the sum of its steps' step_s after the first step (which
warms up); `overhead` is guard / off, the median of the rounds' ratios with their min and max
(goal: at most 1.01). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arms import Ratio, describe, goal_verdict, run_arms, verdict_line  # noqa: E402

GOAL = 1.01  # guard step time / off step time, at most


def write_setup(root: Path) -> Path:
    """A tiny random Qwen3 with a character tokenizer in ROOT/model and 2-digit additions in
    ROOT/train.jsonl."""
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, build_char_tokenizer, write_jsonl
    from archon.tools.tiny_checkpoint import make_tiny_hf_checkpoint

    tokenizer = build_char_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        "qwen3", root / "model", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
    )
    tokenizer.save_pretrained(model_dir)
    train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=256, num_held_out=8))
    write_jsonl(train, root / "train.jsonl")
    return model_dir


def run_once(root: Path, model_dir: Path, mode: str, args: argparse.Namespace) -> float:
    """Seconds of the run's steps after the first, with rollout.fidelity.mode `mode`."""
    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun

    run_dir = root / f"run_{mode}"
    flags = [
        "--model.path", str(model_dir), "--data.path", str(root / "train.jsonl"),
        "--steps", str(args.steps), "--eval.every", "0",
        "--rollout.prompts-per-step", "8", "--rollout.group-size", "4", "--rollout.max-new-tokens", "16",
        "--reward.num-workers", "0", "--lora.rank", "8", "--lora.alpha", "16",
        "--logging.run-dir", str(run_dir), "--logging.no-progress", "--logging.backends", "--overwrite",
        "--rollout.fidelity.mode", mode,
    ]  # fmt: skip
    if args.canary:
        flags.append("--algorithm.no-recompute-old-logprobs")
    RLRun(parse_config(flags)).run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(record["step_s"] for record in records[1:])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--canary", action="store_true", help="bypass mode: the guard's canary after each publish")
    parser.add_argument("--quick", action="store_true", help="check the script: 1 round, 3 steps, no measurement")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_setup(root)
        arms = {mode: (lambda mode=mode: run_once(root, model_dir, mode, args)) for mode in ("stop", "off")}
        result = run_arms(
            arms, [Ratio("overhead", "stop", "off")], repeats=args.repeats, quick=args.quick, threads=None
        )
    overhead = result.ratios["overhead"]
    print(describe(overhead, "guard step time / off"))
    print(verdict_line(overhead, goal_verdict(overhead, GOAL), "guard step time / off"))
    report = {"canary": args.canary, "steps": args.steps, "goal": GOAL, "comparison": result.to_json()}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
